"""SiLU-and-mul: out = silu(gate) * up for x = cat(gate, up), the Llama MLP's activation.

Fusing reads x once and writes out once (PyTorch eager makes an intermediate for silu(gate)).
Rounding follows Hugging Face (silu rounded to x.dtype, then the product), so GPU and CPU agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import validation, validation_ops
from ._launch import cdiv, check_runnable

OP = "silu_and_mul"


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, *, block: int = 1024,
                 num_warps: int = 4) -> torch.Tensor:
    """x [T, 2*I] -> out [T, I]."""
    inter = validation_ops.check_silu_and_mul(OP, x, out, validation.HALF_AND_FLOAT)
    check_runnable(OP, x)
    if out is None:
        out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or inter == 0:
        return out
    _silu_and_mul_kernel[(x.shape[0], cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=num_warps)
    return out
