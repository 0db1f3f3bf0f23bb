"""PyTorch references of the fused kernels, each the composition of the ops it fuses (so its result
is theirs by construction): kernels/reference.py's, in turn."""
from __future__ import annotations

import torch

from . import validation as v
from . import validation_ops as vo
from .reference import quantize_fp8_per_token_ref, rms_norm_ref, silu_and_mul_ref


def rms_norm_quant_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                           residual: torch.Tensor | None = None):
    """rms_norm_ref's output quantized per token: (q, scale) or, with residual, (q, scale, x + residual)."""
    vo.check_rms_norm("rms_norm_quant_fp8", x, weight, residual, v.REFERENCE_DTYPES)
    normed = rms_norm_ref(x, weight, eps, residual)
    if residual is None:
        return quantize_fp8_per_token_ref(normed)
    return (*quantize_fp8_per_token_ref(normed[0]), normed[1])


def silu_and_mul_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul_ref's output quantized per token: (q, scale)."""
    vo.check_silu_and_mul("silu_and_mul_quant_fp8", x, None, v.REFERENCE_DTYPES)
    return quantize_fp8_per_token_ref(silu_and_mul_ref(x))
