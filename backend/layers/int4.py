"""4-bit AWQ and GPTQ checkpoints (`quantization="awq"` / `"gptq"`, as vLLM names them; GPTQ's
8 bits too), served by kernels.w4a16_matmul: weights stay packed, activations stay 16-bit.

The formats, as their writers define them (AutoAWQ's WQLinear_GEMM, AutoGPTQ's QuantLinear),
for a linear layer with K inputs, N outputs, P = 32 / bits values to an int32 word and
G = K / group_size groups; weight[n, k] = (q[k, n] - zero[g, n]) * scales[g, n]:
  AWQ (GEMM)  qweight [K, N / 8]: word [k, c] holds columns 8c .. 8c + 7, column 8c + AWQ_ORDER[i]
              in bits 4i ..; qzeros [G, N / 8] packed the same way; scales [G, N]; g = k // group.
  GPTQ        qweight [K / P, N]: word [r, n] holds rows rP .. rP + P - 1 in order (row rP + i in
              bits i * bits ..); qzeros [G, N / P] in order, each the zero minus 1 (stored zero + 1,
              wrapped to `bits` bits, is the zero); scales [G, N]; g = g_idx[k], which desc_act
              (act-order) shuffles.
Loading reads each tensor into "rows" (output rows first, so the layers' weight loaders place the
q/k/v and gate/up parts as for 16-bit weights): qweight [N, K / P] packed along K, zeros [N, G],
scales [N, G]. `process_weights_after_loading` then repacks into the kernel's layout (packed along
N, input rows sorted by group, see kernels/w4a16.py), or, for a 4-bit shape that the card's
measured table lists, into wgmma's fragment order (kernels/w4a16_fragment.py): the cost is logged
at load.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tritium import kernels
from tritium.kernels.reference import w4a16_dequantize_ref, w4a16_dequantize_values
from tritium.kernels.w4a16_fragment_layout import repack_fragment, unpack_fragment, uses_fragment_layout

from .linear import LinearBase, LinearMethod
from .split_k_partials import SplitKPartials

logger = logging.getLogger(__name__)

INT4_METHODS = ("awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_COLUMNS = tuple(AWQ_ORDER.index(j) for j in range(8))  # column j of a word is in slot AWQ_COLUMNS[j]
# Defaults where config.json declares nothing (quantization=awq|gptq with load_format=dummy).
DEFAULT_GROUP_SIZE = 128


def _field_error(field: str, value, wanted: str) -> ValueError:
    return ValueError(f"model: quantization_config.{field} is {value!r}; {wanted}")


@dataclass(frozen=True)
class Int4Config:
    """What a checkpoint's quantization_config says, checked: method "awq" or "gptq", bits 4
    (GPTQ: 4 or 8), group_size a power of two of at least 16 or -1 (one group over K)."""
    method: str
    bits: int = 4
    group_size: int = DEFAULT_GROUP_SIZE
    desc_act: bool = False

    @classmethod
    def from_config(cls, method: str, declared: dict | None) -> "Int4Config":
        c = declared or {}
        if method == "awq":
            bits = c.get("bits", c.get("w_bit", 4))
            group = c.get("group_size", c.get("q_group_size", DEFAULT_GROUP_SIZE))
            if bits != 4:
                raise _field_error("bits", bits, "Tritium serves 4-bit AWQ checkpoints")
            version = str(c.get("version", "gemm")).lower()
            if version != "gemm":
                raise _field_error("version", c.get("version"), "Tritium reads AutoAWQ's GEMM layout "
                                   "('gemm'); re-export the checkpoint with version='gemm'")
            if c.get("zero_point", True) is not True:
                raise _field_error("zero_point", c.get("zero_point"), "Tritium serves AWQ with zero points")
            desc_act = False
        elif method == "gptq":
            bits = c.get("bits", 4)
            group = c.get("group_size", DEFAULT_GROUP_SIZE)
            if bits not in (4, 8):
                raise _field_error("bits", bits, "Tritium serves GPTQ checkpoints of 4 or 8 bits")
            fmt = c.get("checkpoint_format", "gptq")
            if fmt != "gptq" or c.get("is_marlin_format"):
                field = "checkpoint_format" if fmt != "gptq" else "is_marlin_format"
                raise _field_error(field, c.get(field), "Tritium reads the GPTQ (v1) layout that "
                                   "AutoGPTQ and GPTQModel write by default, not marlin, bitblas, "
                                   "exllama-v2-only or gptq_v2 layouts")
            if c.get("lm_head"):
                raise _field_error("lm_head", True, "Tritium keeps the LM head in 16 bits")
            desc_act = bool(c.get("desc_act", False))
        else:
            raise ValueError(f"model: {method!r} is not a 4-bit format Tritium reads ({INT4_METHODS})")
        if not isinstance(group, int) or not (group == -1 or (group >= 16 and group & (group - 1) == 0)):
            raise _field_error("group_size", group, "it must be -1 or a power of two of at least 16")
        # Modules left in 16 bits are fine where Tritium keeps them so anyway (lm_head, a vision
        # tower); not when they are decoder projections.
        kept = [m for m in c.get("modules_to_not_convert") or [] if any(
            part in str(m) for part in ("layers", "self_attn", "mlp", "_proj"))]
        if kept or c.get("dynamic"):
            field = "modules_to_not_convert" if kept else "dynamic"
            raise _field_error(field, c.get(field), "Tritium quantizes every decoder projection alike")
        return cls(method, bits, group, desc_act)


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., W] int32 -> [..., W * 32 / bits] int32, value j of each word from bit j * bits."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*words.shape[:-1], -1)


def pack_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of unpack_words along the last dimension (a multiple of 32 / bits)."""
    per_word = 32 // bits
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, per_word)
    words = torch.zeros(v.shape[:-1], dtype=torch.int64, device=values.device)
    for j in range(per_word):
        words |= v[..., j] << (bits * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class Int4LinearMethod(LinearMethod):
    """Creates the packed parameters (qweight, qzeros, scales, GPTQ's g_idx) that checkpoints
    load into, repacks them after loading, and multiplies through kernels.w4a16_matmul (on the
    CPU, and for float32 activations: the dequantized weight through F.linear)."""

    keeps_partials = True  # a split-K launch's slices may go to the next kernel (LinearBase.forward)

    def __init__(self, config: Int4Config) -> None:
        self.config = config
        self.repack_seconds = 0.0
        self.repacked_layers = 0

    def create_weights(self, layer: LinearBase, in_features: int, out_features: int,
                       dtype: torch.dtype) -> None:
        c = self.config
        group = in_features if c.group_size == -1 else c.group_size
        per_word = 32 // c.bits
        if in_features % group or in_features % per_word or out_features % per_word:
            raise ValueError(f"model: a {in_features} -> {out_features} projection does not "
                             f"split into quantization_config.group_size {c.group_size} groups "
                             f"and {per_word}-value words")
        layer.group_size = group
        groups = in_features // group

        def param(name: str, shape: tuple, tensor_dtype: torch.dtype, to_rows, fill) -> None:
            p = nn.Parameter(torch.empty(shape, dtype=tensor_dtype), requires_grad=False)
            p.weight_loader = layer.weight_loader
            # Unpacking runs where the parameter lives (the GPU: milliseconds, not seconds).
            p.checkpoint_rows = lambda ckpt_name, t: to_rows(ckpt_name, t.to(p.device), layer)
            p.dummy_fill = lambda: fill(p)
            setattr(layer, name, p)

        param("qweight", (out_features, in_features // per_word), torch.int32, self._qweight_rows,
              lambda p: p.random_(-2**31, 2**31 - 1))
        param("qzeros", (out_features, groups), torch.int32, self._qzeros_rows,
              lambda p: p.random_(0, 2**c.bits))
        param("scales", (out_features, groups), torch.float32, self._scales_rows,
              lambda p: p.copy_(p.uniform_(1e-3, 2e-3).half()))  # fp16, as checkpoints hold them
        if c.method == "gptq":
            g_idx = nn.Parameter(torch.empty(in_features, dtype=torch.int32), requires_grad=False)
            g_idx.weight_loader = self._g_idx_loader
            g_idx.whole_input = True  # one tensor for all of a fused projection's parts
            # Random weights of an act-order checkpoint put each group's channels anywhere
            # along K, as real ones do, so the kernel's gathered path is what a benchmark runs.
            g_idx.dummy_fill = lambda: g_idx.copy_(
                (torch.randperm(in_features) if c.desc_act else torch.arange(in_features)) // group)
            layer.g_idx = g_idx

    # ---- checkpoint tensors -> rows ------------------------------------------------------------
    def _check(self, name: str, t: torch.Tensor, dim: int, size: int, layout: str,
               dtype: torch.dtype) -> None:
        if t.dim() != 2 or t.shape[dim] != size or t.dtype != dtype:
            raise ValueError(f"model: {name} is {t.dtype} {tuple(t.shape)}; {self.config.method} "
                             f"stores it as {dtype} {layout}")

    def _qweight_rows(self, name: str, t: torch.Tensor, layer: LinearBase) -> torch.Tensor:
        bits, k = self.config.bits, layer.in_features
        if self.config.method == "awq":
            self._check(name, t, 0, k, f"[K = {k}, N / 8]", torch.int32)
            values = unpack_words(t, 4).view(k, -1, 8)[:, :, list(AWQ_COLUMNS)].reshape(k, -1)
            return pack_words(values.t(), 4)
        self._check(name, t, 0, k * bits // 32, f"[K * {bits} / 32 = {k * bits // 32}, N]", torch.int32)
        return t.t().contiguous()

    def _qzeros_rows(self, name: str, t: torch.Tensor, layer: LinearBase) -> torch.Tensor:
        bits, groups = self.config.bits, layer.in_features // layer.group_size
        self._check(name, t, 0, groups, f"[G = {groups}, N * {bits} / 32]", torch.int32)
        values = unpack_words(t, bits)
        if self.config.method == "awq":
            values = values.view(groups, -1, 8)[:, :, list(AWQ_COLUMNS)].reshape(groups, -1)
        else:  # GPTQ stores zero - 1 (AutoGPTQ's torch dequantizer adds 1 and masks to `bits`)
            values = (values + 1) & ((1 << bits) - 1)
        return values.t().contiguous()

    def _scales_rows(self, name: str, t: torch.Tensor, layer: LinearBase) -> torch.Tensor:
        groups = layer.in_features // layer.group_size
        if t.dim() != 2 or t.shape[0] != groups or not t.is_floating_point():
            raise ValueError(f"model: {name} is {t.dtype} {tuple(t.shape)}; {self.config.method} "
                             f"stores scales as float [G = {groups}, N]")
        return t.t().float()

    @staticmethod
    def _g_idx_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape != param.shape:
            raise ValueError(f"model: g_idx has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
        if getattr(param, "loaded", False) and not torch.equal(param.data, loaded.to(param.device, param.dtype)):
            raise ValueError("model: the parts of a fused projection (q/k/v or gate/up) have "
                             "different g_idx; Tritium needs them to share one input order, as "
                             "GPTQ's act-order gives projections of the same input")
        param.data.copy_(loaded)
        param.loaded = True

    # ---- repacking and the matmul --------------------------------------------------------------
    def process_weights_after_loading(self, layer: LinearBase) -> None:
        start = time.perf_counter()
        bits, k, group = self.config.bits, layer.in_features, layer.group_size
        values = unpack_words(layer.qweight.data, bits)  # [N, K]
        perm = None
        g_idx = getattr(layer, "g_idx", None)
        if g_idx is not None:
            g = g_idx.data.long()
            want = torch.arange(k, device=g.device) // group
            if not torch.equal(g, want):
                order = torch.sort(g, stable=True).indices
                if not torch.equal(g[order], want):
                    raise ValueError(f"model: a g_idx does not put {group} input channels in "
                                     f"each of {k // group} groups (quantization_config.group_size)")
                perm, values = order.to(torch.int32), values[:, order]
            del layer.g_idx
        # The fragment layout where the card's measured table says it is faster for this shape.
        layer.fragment_layout = uses_fragment_layout(values.shape[0], k, bits, group, values.device)
        words = repack_fragment(values.t()) if layer.fragment_layout else pack_words(values.t(), bits)
        layer.qweight = nn.Parameter(words, requires_grad=False)
        scales = layer.scales.data.t().contiguous()
        half = scales.to(torch.float16)
        exact = torch.equal(half.float(), scales)  # fp16 checkpoint scales are; keep others in float32
        layer.scales = nn.Parameter(half if exact else scales, requires_grad=False)
        layer.zeros = nn.Parameter(layer.qzeros.data.t().to(layer.scales.dtype).contiguous(),
                                   requires_grad=False)
        del layer.qzeros
        layer.register_buffer("perm", perm, persistent=False)
        if layer.qweight.is_cuda:
            torch.cuda.synchronize(layer.qweight.device)
        self.repack_seconds += time.perf_counter() - start
        self.repacked_layers += 1

    def loading_done(self) -> None:
        logger.info("Repacked %d %s projections (%d-bit, group %s) for the W4A16 kernel in %.2f s",
                    self.repacked_layers, self.config.method.upper(), self.config.bits,
                    self.config.group_size, self.repack_seconds)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None,
              keep_partials: bool = False) -> torch.Tensor | SplitKPartials:
        bits, group, perm = self.config.bits, layer.group_size, layer.perm
        if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
            rows = x.reshape(-1, x.shape[-1])
            reduce = not keep_partials
            if layer.fragment_layout:
                out = kernels.w4a16_fragment_linear(rows, layer.qweight, layer.scales, layer.zeros, group, perm,
                                                    reduce=reduce)
            else:
                out = kernels.w4a16_matmul(rows, layer.qweight, layer.scales, layer.zeros, group, perm, bits=bits,
                                           reduce=reduce)
            if out.dim() == 3:
                return SplitKPartials(out, x.dtype)
            out = out.view(*x.shape[:-1], out.shape[-1])
            return out if bias is None else out + bias
        # The same matrix a dequantized checkpoint holds, through the same F.linear.
        return F.linear(x, dequantized_weight(layer, bits, x.dtype), bias)


def dequantized_weight(layer: LinearBase, bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A repacked layer's [N, K] weight in the activations' order, in `dtype`, whichever layout it holds."""
    if layer.fragment_layout:
        q = unpack_fragment(layer.qweight)
        return w4a16_dequantize_values(q, layer.scales, layer.zeros, layer.group_size, layer.perm, dtype)
    return w4a16_dequantize_ref(layer.qweight, layer.scales, layer.zeros, layer.group_size, layer.perm,
                                bits=bits, dtype=dtype)
