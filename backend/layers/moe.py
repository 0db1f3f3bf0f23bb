"""The mixture-of-experts MLP block: a router picks each token's top-k experts, the experts'
SwiGLU MLPs run as one fused kernel over stacked weights (kernels/moe.py), and Qwen2-MoE adds a
gated shared expert. Tensor parallelism shards every expert's intermediate dimension, as the
dense MLP's: each rank holds a slice of all experts and one all-reduce sums the partial outputs."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tritium import kernels
from tritium.kernels.reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE
from tritium.kernels.validation_moe import FP8_BLOCK

from .int4 import Int4LinearMethod
from .linear import LinearMethod, ReplicatedLinear
from .mlp import GatedMLP
from .parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from .quantization import Fp8LinearMethod


def check_block_fp8_experts(intermediate_size: int, tp: int) -> None:
    """Block-wise FP8 experts keep their checkpoint's 128 x 128 block scales: the gate and up
    projections each have their own grid of blocks, stacked along the output rows, and each
    rank's slice of the intermediate size must hold whole blocks (as vLLM's Fp8MoEMethod asks)."""
    if intermediate_size % FP8_BLOCK:
        raise ValueError(f"model: block-wise FP8 experts need a moe_intermediate_size that is a multiple "
                         f"of {FP8_BLOCK} (gate and up have blocks of their own), got {intermediate_size}")
    if intermediate_size // tp % FP8_BLOCK:
        raise ValueError(f"tensor_parallel_size={tp} splits the experts' moe_intermediate_size="
                         f"{intermediate_size} into {intermediate_size // tp} a rank, inside their "
                         f"{FP8_BLOCK} x {FP8_BLOCK} FP8 blocks.")


class FusedMoE(nn.Module):
    """One layer's experts, stacked at load: w13_weight [E, 2 * I_rank, H] (this rank's gate rows,
    then its up rows) and w2_weight [E, H, I_rank]. With quantization="fp8" both become
    float8_e4m3fn after loading (the kernel widens them in registers; activations stay 16-bit),
    with one scale per expert and output channel, or the checkpoint's own scales where it is FP8:
    per channel [E, N], or per 128 x 128 block [E, N / 128, K / 128]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 linear_method: LinearMethod | None = None) -> None:
        super().__init__()
        tp = get_tp_size()
        if intermediate_size % tp:
            raise ValueError(f"model: the experts' intermediate size {intermediate_size} does not "
                             f"split over {tp} tensor-parallel ranks")
        if isinstance(linear_method, Int4LinearMethod):
            raise ValueError("model: AWQ and GPTQ mixture-of-experts checkpoints are not supported "
                             "(bf16 and FP8 experts are)")
        self.fp8 = isinstance(linear_method, Fp8LinearMethod)
        self.num_experts, self.tp_rank = num_experts, get_tp_rank()
        self.intermediate = intermediate_size // tp  # this rank's
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate, dtype=dtype),
                                      requires_grad=False)
        for param, parts in ((self.w13_weight, ("gate", "up")), (self.w2_weight, ("down",))):
            param.weight_loader = self.weight_loader
            param.checkpoint_scale_loader = self.checkpoint_scale_loader
            param.expert_shards = [(e, p) for e in range(num_experts) for p in parts]  # (the loader checks)
        # An FP8 checkpoint's scales by "w13" / "w2" (NaN where an expert's part has none), kept
        # with quantization="fp8": per output channel [E, N], or per block [E, N/128, K/128].
        self.checkpoint_scales: dict[str, torch.Tensor] = {}
        self.checkpoint_block_scales: dict[str, torch.Tensor] = {}
        self.w13_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """One expert's checkpoint projection (gate or up [I, H], down [H, I]) into its place,
        cut to this rank's slice of I."""
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"model: checkpoint expert {expert} is not one of the model's "
                             f"{self.num_experts} experts")
        size, start = self.intermediate, self.tp_rank * self.intermediate
        if part == "down":
            target, piece = param.data[expert], loaded.narrow(1, start, size)
        else:
            offset = 0 if part == "gate" else size
            target, piece = param.data[expert].narrow(0, offset, size), loaded.narrow(0, start, size)
        if target.shape != piece.shape:
            raise ValueError(f"model: expert {expert} {part} projection has shape {tuple(loaded.shape)}; "
                             f"its slice {tuple(piece.shape)} does not fit {tuple(target.shape)}")
        target.copy_(piece)

    def checkpoint_scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str],
                                blocks: bool) -> None:
        """The FP8 checkpoint's scales of one expert's projection, whose weight the loader placed
        widened: per row [N, 1], or per block [ceil(N / 128), ceil(K / 128)], cut to this rank's
        slice as the weight was. Kept for quantization="fp8" only (else the widened weights
        are served)."""
        if not self.fp8:
            return
        expert, part = shard_id
        name = "w2" if part == "down" else "w13"
        size, start = self.intermediate, self.tp_rank * self.intermediate
        e, n, k = param.shape
        if blocks:
            check_block_fp8_experts(self.intermediate * get_tp_size(), get_tp_size())
            size, start = size // FP8_BLOCK, start // FP8_BLOCK
            shape, records = (e, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)), self.checkpoint_block_scales
        else:
            loaded, shape, records = loaded.reshape(-1), (e, n), self.checkpoint_scales
        record = records.get(name)
        if record is None:
            record = records[name] = torch.full(shape, float("nan"), dtype=torch.float32, device=param.device)
        if part == "down":  # (its rows, H, are whole on every rank; blocks: its columns are cut)
            target, piece = record[expert], loaded.narrow(1, start, size) if blocks else loaded
        else:
            target = record[expert].narrow(0, 0 if part == "gate" else size, size)
            piece = loaded.narrow(0, start, size)
        target.copy_(piece)

    def process_weights_after_loading(self) -> None:
        if not self.fp8:
            return
        # The checkpoint's own scales give its FP8 values back (the widened weight divided by its
        # scale rounds to that value, as Fp8LinearMethod's comment says); NaN (an expert's part
        # without one) and 0 fail `> 0`, and such parts take their maxima over FP8's largest.
        for name in ("w13", "w2"):
            w = getattr(self, f"{name}_weight").data.float()
            e, n, k = w.shape
            channels = self.checkpoint_scales.pop(name, None)
            blocks = self.checkpoint_block_scales.pop(name, None)
            if blocks is not None:
                scale = blocks
                if not bool((blocks > 0).all()):
                    nb, kb = blocks.shape[1:]
                    padded = torch.zeros(e, nb * FP8_BLOCK, kb * FP8_BLOCK, dtype=w.dtype, device=w.device)
                    padded[:, :n, :k] = w.abs()
                    amax = padded.view(e, nb, FP8_BLOCK, kb, FP8_BLOCK).amax(dim=(2, 4))
                    scale = torch.where(blocks > 0, blocks, (amax / FP8_MAX).clamp(min=FP8_MIN_SCALE))
                per_weight = scale.repeat_interleave(FP8_BLOCK, 1).repeat_interleave(FP8_BLOCK, 2)[:, :n, :k]
            else:
                scale = (w.abs().amax(dim=2) / FP8_MAX).clamp(min=FP8_MIN_SCALE)  # [E, N]
                if channels is not None:
                    scale = torch.where(channels > 0, channels, scale)
                per_weight = scale[..., None]
            q = (w / per_weight).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            setattr(self, f"{name}_weight", nn.Parameter(q, requires_grad=False))
            setattr(self, f"{name}_scale", scale)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the experts' outputs (the caller all-reduces)."""
        return kernels.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                             self.w13_scale, self.w2_scale)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated and 16-bit), experts, and an optional shared expert whose
    output a sigmoid gate scales (Qwen2-MoE); checkpoint names as Hugging Face's."""

    def __init__(self, c, dtype: torch.dtype, linear_method: LinearMethod | None = None) -> None:
        """c: the model's DecoderConfig (models/decoder_config.py)."""
        super().__init__()
        if c.hidden_act != "silu":  # the fused kernel's epilogue is SiLU-and-multiply
            raise ValueError(f"model: mixture-of-experts layers with hidden_act {c.hidden_act!r} are "
                             f"not supported (silu is)")
        self.top_k, self.renormalize = c.num_experts_per_tok, c.norm_topk_prob
        self.round_weights = c.router_weights_in_dtype
        self.gate = ReplicatedLinear(c.hidden_size, c.num_experts, False, dtype)
        self.experts = FusedMoE(c.num_experts, c.hidden_size, c.moe_intermediate_size, dtype, linear_method)
        if c.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(c.hidden_size, c.shared_expert_intermediate_size, False, dtype,
                                          linear_method)
            self.shared_expert_gate = ReplicatedLinear(c.hidden_size, 1, False, dtype)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        # Softmax in float32, top k, renormalised and rounded as the family's reference does.
        weights, ids = kernels.topk_softmax(logits, self.top_k, self.renormalize,
                                        x.dtype if self.round_weights else None)
        out = tp_all_reduce(self.experts(x, weights, ids))
        if self.shared_expert is not None:
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
