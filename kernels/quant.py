"""Dynamic per-token FP8 (e4m3) quantization of activations, for FP8 matmuls.

Each row (token) gets its own scale, amax(|x|) / 448, so one outlier token does not crush the
precision of the others; the matmul applies the row scales to its output (torch._scaled_mm's
rowwise scaling). One program per row: a first pass over the row finds amax, a second writes
the quantized row, so the activation is read twice and written once, in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import validation, validation_ops
from ._launch import check_runnable, next_pow2
from .gated import silu_mul_block
from .reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

OP = "quantize_fp8_per_token"


@triton.jit
def fp8_row_scale(amax, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr):
    """A row's scale from its largest magnitude: amax / 448, at least the smallest scale."""
    return tl.maximum(amax / FP8_MAX_C, MIN_SCALE_C)


@triton.jit
def fp8_clamped(v, inv_scale, FP8_MAX_C: tl.constexpr):
    """v / scale (times the reciprocal, as the reference does) within e4m3's range, in float32."""
    return tl.minimum(tl.maximum(v * inv_scale, -FP8_MAX_C), FP8_MAX_C)


@triton.jit
def _row_values(x_row, offs, num_cols, GATED: tl.constexpr):
    """A block of the row to quantize, in float32: x itself, or (GATED) silu(gate) * up of
    x = cat(gate, up) rounded as silu_and_mul rounds it (kernels/activation.py)."""
    if GATED:
        v = silu_mul_block(x_row, offs, num_cols)
    else:
        v = tl.load(x_row + offs, mask=offs < num_cols, other=0.0).to(tl.float32)
    return v


@triton.jit  # (also silu_and_mul_quant_fp8's, in kernels/activation.py, with GATED)
def quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, num_cols, stride_x, stride_q,
                         FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr, BLOCK: tl.constexpr,
                         GATED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, num_cols, BLOCK):
        amax = tl.maximum(amax, tl.abs(_row_values(x_row, c0 + tl.arange(0, BLOCK), num_cols, GATED)))
    scale = fp8_row_scale(tl.max(amax, 0), FP8_MAX_C, MIN_SCALE_C)
    tl.store(scale_ptr + row, scale)
    inv = 1.0 / scale
    for c0 in range(0, num_cols, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        q = fp8_clamped(_row_values(x_row, offs, num_cols, GATED), inv, FP8_MAX_C)
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=offs < num_cols)


def quantize_fp8_per_token(x: torch.Tensor, *, block: int = 2048,
                           num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (16-bit or float32) -> (q [T, K] float8_e4m3fn, scale [T, 1] float32) with
    x ~= q * scale."""
    validation_ops.check_quantize(OP, x, validation.HALF_AND_FLOAT)
    check_runnable(OP, x)
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    quantize_rows_kernel[(rows,)](x, q, scale, cols, x.stride(0), q.stride(0),
                                  FP8_MAX_C=FP8_MAX, MIN_SCALE_C=FP8_MIN_SCALE,
                                  BLOCK=min(block, next_pow2(cols)), GATED=False, num_warps=num_warps)
    return q, scale
