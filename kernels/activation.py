"""SiLU-and-mul: out = silu(gate) * up for x = cat(gate, up), the Llama MLP's activation.

Fusing reads x once and writes out once (PyTorch eager makes an intermediate for silu(gate)).
Rounding follows Hugging Face (silu rounded to x.dtype, then the product), so GPU and CPU agree.

`silu_and_mul_quant_fp8` quantizes the product per token for an FP8 down projection (the bytes
kernels/quant.py would write from silu_and_mul's output), in one launch instead of two: one
program per row, a first pass for the row's largest magnitude, a second that recomputes the
product and writes it quantized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import validation, validation_ops
from ._launch import cdiv, check_runnable
from .gated import silu_mul
from .quant import quantize_rows_kernel
from .reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

OP = "silu_and_mul"
OP_FP8 = "silu_and_mul_quant_fp8"


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_s, stride_x, stride_o, inter, split,
                         SLICED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    dt = out_ptr.dtype.element_ty
    if SLICED:
        # A split-K gate/up projection's slices, added in slice order and rounded to the output's
        # dtype as split_k.finish would have written them.
        gate = tl.zeros([BLOCK], dtype=tl.float32)
        up = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(split):
            gate += tl.load(x_ptr + s * stride_s + row * stride_x + offs, mask=mask, other=0.0)
            up += tl.load(x_ptr + s * stride_s + row * stride_x + inter + offs, mask=mask, other=0.0)
        gate = gate.to(dt).to(tl.float32)
        up = up.to(dt).to(tl.float32)
    else:
        gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, silu_mul(gate, up, dt).to(dt), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, *, block: int = 1024,
                 num_warps: int = 4) -> torch.Tensor:
    """x [T, 2*I] -> out [T, I]. x may also be a split-K matmul's float32 slices [S, T, 2*I], given
    `out` (x is their sum rounded to out's dtype: the sum's own launch saved)."""
    inter = validation_ops.check_silu_and_mul(OP, x, out, validation.HALF_AND_FLOAT)
    check_runnable(OP, x)
    sliced = x.dim() == 3
    rows = x.shape[-2]
    if out is None:
        out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    if rows == 0 or inter == 0:
        return out
    _silu_and_mul_kernel[(rows, cdiv(inter, block))](
        x, out, x.stride(0) if sliced else 0, x.stride(-2), out.stride(0), inter, x.shape[0] if sliced else 1,
        SLICED=sliced, BLOCK=block, num_warps=num_warps)
    return out


def silu_and_mul_quant_fp8(x: torch.Tensor, *, block: int = 2048,
                           num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2*I] -> (q [T, I] float8_e4m3fn, scale [T, 1] float32), q * scale ~= silu_and_mul(x)."""
    inter = validation_ops.check_silu_and_mul(OP_FP8, x, None, validation.HALF_AND_FLOAT)
    check_runnable(OP_FP8, x)
    q = torch.empty(x.shape[0], inter, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    if x.shape[0] == 0 or inter == 0:
        return q, scale
    # kernels/quant.py's two passes over the row, its values computed from gate and up.
    quantize_rows_kernel[(x.shape[0],)](
        x, q, scale, inter, x.stride(0), q.stride(0), FP8_MAX_C=FP8_MAX, MIN_SCALE_C=FP8_MIN_SCALE,
        BLOCK=min(block, triton.next_power_of_2(inter)), GATED=True, num_warps=num_warps)
    return q, scale
