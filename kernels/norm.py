"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

One program per token row: the row is read once, summed in float32, normalised and written,
instead of the three to five passes of the unfused PyTorch ops. Rounding follows Hugging Face so
GPU and CPU engines agree: x + residual is rounded to x.dtype (that sum is the new residual and is
what gets normalised), and the normalised value is rounded to x.dtype before the weight multiply.

`rms_norm_quant_fp8` ends with the per-token FP8 quantization an FP8 projection applies to its
input (kernels/quant.py's, on the output rounded to x.dtype, so the bytes are the same as the two
ops in turn): the row is in registers already, and a decode step saves a launch per norm.

Both take, in place of x, the float32 K slices of a split-K matmul ([S, T, H], with a residual):
a row-parallel projection before a norm then needs no launch of its own to sum them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import validation, validation_ops
from ._launch import check_runnable, next_pow2
from .quant import fp8_clamped, fp8_row_scale
from .reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

OP = "rms_norm"
OP_FP8 = "rms_norm_quant_fp8"


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, scale_ptr, eps,
    stride_s, stride_x, stride_r, stride_o, stride_nr, hidden, split,
    HAS_RESIDUAL: tl.constexpr, SLICED: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
    FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    if SLICED:
        # A split-K matmul's partial sums, added in slice order and rounded to the residual's dtype
        # as split_k.finish would have done in a launch of its own.
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(split):
            acc += tl.load(x_ptr + s * stride_s + row * stride_x + offs, mask=mask, other=0.0)
        x = acc.to(residual_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * stride_nr + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, 0) / hidden + eps)
    normed = (h * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(x.dtype)
    if QUANT:
        # kernels/quant.py's arithmetic on the rounded output (masked columns are zeros)
        yf = y.to(tl.float32)
        scale = fp8_row_scale(tl.max(tl.abs(yf), 0), FP8_MAX_C, MIN_SCALE_C)
        tl.store(scale_ptr + row, scale)
        q = fp8_clamped(yf, 1.0 / scale, FP8_MAX_C)
        tl.store(out_ptr + row * stride_o + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def _launch(op: str, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
            quant: bool, num_warps: int | None):
    """(out, scale or None, new residual or None); out is FP8 when quant."""
    validation_ops.check_rms_norm(op, x, weight, residual, validation.HALF_AND_FLOAT)
    check_runnable(op, x)
    sliced = x.dim() == 3
    num_tokens, hidden = x.shape[-2:]
    dtype = residual.dtype if sliced else x.dtype
    out = torch.empty(num_tokens, hidden, dtype=FP8_DTYPE if quant else dtype, device=x.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device) if quant else None
    new_residual = torch.empty(num_tokens, hidden, dtype=dtype, device=x.device) if residual is not None else None
    if num_tokens == 0:
        return out, scale, new_residual
    block = next_pow2(hidden)
    # About 16 elements per thread (two 16-byte loads of bf16): 4096 wide -> 8 warps.
    warps = num_warps or min(max(block // 512, 1), 16)
    _rms_norm_kernel[(num_tokens,)](
        x, residual if residual is not None else x, weight, out, new_residual if residual is not None else out,
        scale if quant else x, float(eps),
        x.stride(0) if sliced else 0, x.stride(-2), residual.stride(0) if residual is not None else 0, out.stride(0),
        new_residual.stride(0) if residual is not None else 0, hidden, x.shape[0] if sliced else 1,
        HAS_RESIDUAL=residual is not None, SLICED=sliced, BLOCK=block, QUANT=quant, FP8_MAX_C=FP8_MAX,
        MIN_SCALE_C=FP8_MIN_SCALE,
        num_warps=warps,
    )
    return out, scale, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, num_warps: int | None = None):
    """out = rmsnorm(x) * weight, or with residual: (rmsnorm(x + residual) * weight, x + residual).
    With residual, x may be a split-K matmul's float32 slices [S, T, H] (x is their sum, rounded
    to the residual's dtype: the sum's launch saved). Returns new tensors; x and residual are not
    modified."""
    out, _, new_residual = _launch(OP, x, weight, eps, residual, False, num_warps)
    return out if residual is None else (out, new_residual)


def rms_norm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None, *, num_warps: int | None = None):
    """rms_norm's output quantized per token: (q [T, H] float8_e4m3fn, scale [T, 1] float32), with
    residual (q, scale, x + residual); q * scale ~= rms_norm(x, weight, eps, residual)'s output."""
    out, scale, new_residual = _launch(OP_FP8, x, weight, eps, residual, True, num_warps)
    return (out, scale) if residual is None else (out, scale, new_residual)
