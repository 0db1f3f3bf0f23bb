"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

One program per token row: the row is read once, summed in float32, normalised and written,
instead of the three to five passes of the unfused PyTorch ops. Rounding follows Hugging Face so
GPU and CPU engines agree: x + residual is rounded to x.dtype (that sum is the new residual and is
what gets normalised), and the normalised value is rounded to x.dtype before the weight multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import validation, validation_ops
from ._launch import check_runnable, next_pow2

OP = "rms_norm"


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, eps,
    stride_x, stride_r, stride_o, stride_nr, hidden,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, 0) / hidden + eps)
    normed = (h * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, num_warps: int | None = None):
    """out = rmsnorm(x) * weight, or with residual: (rmsnorm(x + residual) * weight, x + residual).
    Returns new tensors; x and residual are not modified."""
    validation_ops.check_rms_norm(OP, x, weight, residual, validation.HALF_AND_FLOAT)
    check_runnable(OP, x)
    num_tokens, hidden = x.shape
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out) if residual is not None else out
    if num_tokens == 0:
        return out if residual is None else (out, new_residual)
    block = next_pow2(hidden)
    # About 16 elements per thread (two 16-byte loads of bf16): 4096 wide -> 8 warps.
    warps = num_warps or min(max(block // 512, 1), 16)
    _rms_norm_kernel[(num_tokens,)](
        x, residual if residual is not None else x, weight, out, new_residual, float(eps),
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        new_residual.stride(0), hidden,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps,
    )
    return out if residual is None else (out, new_residual)
