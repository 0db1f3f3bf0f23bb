"""PyTorch references of the FP8 activation kernels (per-token quantization, the few-row FP8
matmul) and the FP8 constants they share with kernels/quant.py and backend/layers/quantization.py;
kernels/reference.py re-exports them."""
from __future__ import annotations

import torch

from . import FP8_MATMUL_MAX_ROWS
from . import validation as v
from . import validation_ops as vo

# FP8 (e4m3) activation quantization, shared with kernels/quant.py and backend/layers/quantization.py.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
FP8_MIN_SCALE = 1e-12  # an all-zero row still gets a finite, nonzero scale


def fp8_matmul_few_rows_ref(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                            weight_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, *,
                            reduce: bool = True) -> torch.Tensor:
    """(x_q @ weight^T) * x_scale * weight_scale in float32, in the kernel's order: the FP8 values
    multiply exactly and accumulate in float32, then both scales apply. (`reduce`: the kernel's
    choice to leave K slices unsummed; a reference has none, so it always returns [M, N].)"""
    vo.check_fp8_matmul("fp8_matmul_few_rows", x_q, x_scale, weight, weight_scale, out_dtype,
                       FP8_MATMUL_MAX_ROWS)
    return ((x_q.float() @ weight.float().t()) * x_scale * weight_scale).to(out_dtype)


def quantize_fp8_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q float8_e4m3fn [T, K], scale float32 [T, 1]); x ~= q * scale."""
    vo.check_quantize("quantize_fp8_per_token", x, v.REFERENCE_DTYPES)
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    # Multiply by the reciprocal, as the kernel does, so both round the same values.
    q = (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale
