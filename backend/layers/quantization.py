"""FP8 weights and activations for the linear layers (`quantization="fp8"`, as vLLM names it).

Weights are quantized once, after loading: a 16-bit checkpoint's to float8_e4m3fn with one
scale per output channel; an FP8 checkpoint's (which the loader reads times its scales) back to
its own FP8 values, with its scales (per tensor or per channel) as the per-channel scales; a
block-wise FP8 checkpoint's (128 x 128 blocks) per output channel from its widened rows, which
rounds each weight a second time unless all blocks of its row share one scale. Activations are
quantized per token at every call (dynamic scaling, so no calibration data is needed). The matmul runs on FP8 tensor cores through torch._scaled_mm, which
applies both scales to the output (for up to 16 rows, our kernel: kernels/fp8_matmul.py);
Hopper runs FP8 at twice the bf16 rate and reads half the weight bytes. Embeddings, the LM head,
norms and the KV cache stay in the model dtype.
"""
from __future__ import annotations

import torch
from torch import nn

from tritium import kernels
from tritium.kernels.reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE
from tritium.kernels.validation_moe import FP8_BLOCK

from ..config import QUANTIZATIONS
from .int4 import INT4_METHODS, Int4Config, Int4LinearMethod
from .fp8_activation import Fp8Activation
from .linear import FP8_PER_TOKEN, LinearBase, LinearMethod
from .split_k_partials import SplitKPartials


def check_fp8_supported(device: torch.device, setting: str = "quantization='fp8'") -> None:
    """FP8 matmuls and conversions need compute capability 8.9 (Ada) or newer; the CPU emulates
    them (tests). `setting` names what asked for FP8 in the error."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"{setting} needs a GPU of compute capability 8.9 or newer; "
                         f"{torch.cuda.get_device_name(device)} is {major}.{minor}")


class Fp8LinearMethod(LinearMethod):
    """Loads 16-bit weights like the base method, then `process_weights_after_loading`
    replaces them with FP8 weights and per-channel scales. Takes its input as a 16-bit
    activation or already quantized (an Fp8Activation)."""

    input_quantization = FP8_PER_TOKEN
    keeps_partials = True

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        w = layer.weight.data
        scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp(min=FP8_MIN_SCALE)  # [N]
        checkpoint = getattr(layer.weight, "checkpoint_scale", None)
        if checkpoint is not None:
            # Rows read from an FP8 checkpoint keep its scales: the widened weight divided by
            # its own scale is the checkpoint's FP8 value up to the model dtype's rounding
            # (8 significant bits in bf16 against FP8's 4), which rounds back to that value.
            # Re-scaling by the row maximum would round each weight a second time.
            checkpoint = checkpoint.view(-1).to(scale.device)
            scale = torch.where(checkpoint > 0, checkpoint, scale)  # NaN (no scale) and 0 fail
        q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale.view(1, -1), requires_grad=False)

    def apply(self, layer: LinearBase, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None,
              keep_partials: bool = False) -> torch.Tensor | SplitKPartials:
        if layer.weight.dtype != FP8_DTYPE:
            raise RuntimeError("Fp8LinearMethod: weights were not quantized after loading")
        if isinstance(x, Fp8Activation):
            x_q, x_scale, dtype = x.q, x.scale, x.dtype
        else:
            (x_q, x_scale), dtype = kernels.quantize_fp8_per_token(x), x.dtype
        if x_q.is_cuda and x_q.shape[0] <= kernels.FP8_MATMUL_MAX_ROWS:
            # Decode batches of a few sequences: _scaled_mm's kernels are tiled for many rows
            # and read the weights more slowly than a bf16 matmul would (kernels/fp8_matmul.py).
            # (Slices only for a bf16 model: another dtype's output is the bf16 sum cast again.)
            out = kernels.fp8_matmul_few_rows(x_q, x_scale, layer.weight.data, layer.weight_scale.data,
                                              torch.bfloat16, reduce=not (keep_partials and dtype == torch.bfloat16))
            if out.dim() == 3:
                return SplitKPartials(out, dtype)
            out = out.to(dtype)
        elif x_q.is_cuda:
            # weight [N, K] row-major is the column-major [K, N] operand _scaled_mm wants.
            # Row-wise scales need a bf16 output; other model dtypes are cast after.
            out = torch._scaled_mm(x_q, layer.weight.t(), scale_a=x_scale,
                                   scale_b=layer.weight_scale, out_dtype=torch.bfloat16).to(dtype)
        else:  # emulation with the same rounding of inputs (tests; no FP8 matmul on the CPU)
            out = ((x_q.float() * x_scale) @ (layer.weight.float() * layer.weight_scale.t()).t()).to(dtype)
        return out if bias is None else out + bias


def fp8_weight_block_size(quantization_config: dict | None) -> tuple[int, int] | None:
    """The 128 x 128 blocks of a block-wise FP8 checkpoint (DeepSeek-V3's and Qwen3's FP8
    releases: quant_method "fp8", weight_block_size [128, 128] in config.json's
    quantization_config, each weight's `weight_scale_inv` one float per block, as vLLM's
    Fp8Config reads it); None for other checkpoints. Other block sizes are refused: the fused-MoE
    kernel's block scales cover 128 x 128."""
    config = quantization_config or {}
    if str(config.get("quant_method", "")).lower() != "fp8" or config.get("weight_block_size") is None:
        return None
    block = config["weight_block_size"]
    if not isinstance(block, (list, tuple)) or list(block) != [FP8_BLOCK, FP8_BLOCK]:
        raise ValueError(f"model: quantization_config.weight_block_size is {block!r}; Tritium reads "
                         f"block-wise FP8 checkpoints of [{FP8_BLOCK}, {FP8_BLOCK}] blocks only")
    return FP8_BLOCK, FP8_BLOCK


def get_linear_method(quantization: str | None, quantization_config: dict | None = None
                      ) -> LinearMethod | None:
    """`quantization_config`: config.json's, for the formats that read their layout from it."""
    if quantization is None:
        return None
    if quantization == "fp8":
        return Fp8LinearMethod()
    if quantization in INT4_METHODS:
        return Int4LinearMethod(Int4Config.from_config(quantization, quantization_config))
    raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")


def process_weights_after_loading(model: nn.Module) -> None:
    methods = {}
    for module in model.modules():
        if not isinstance(module, LinearBase):
            hook = getattr(module, "process_weights_after_loading", None)  # e.g. stacked experts
            if hook is not None:
                hook()
        else:
            hook = getattr(module.linear_method, "process_weights_after_loading", None)
            if hook is not None:
                hook(module)
                methods[id(module.linear_method)] = module.linear_method
    for method in methods.values():
        done = getattr(method, "loading_done", None)  # e.g. to log what repacking cost
        if done is not None:
            done()
