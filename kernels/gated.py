"""The gated activation's value as the kernels compute it, shared by silu_and_mul
(kernels/activation.py) and its quantizing variant (kernels/quant.py's row kernel with GATED)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def silu_mul(gate, up, dt: tl.constexpr):
    """silu(gate) * up from float32 gate and up already in dtype dt's values, rounded as Hugging
    Face rounds it (silu to dt, then the product), in float32."""
    silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    return (silu * up).to(dt).to(tl.float32)


@triton.jit
def silu_mul_block(x_row, offs, inter):
    """silu(gate) * up for one block of a row of x = cat(gate, up), rounded as silu_and_mul
    rounds it (silu to x's dtype, then the product), in float32."""
    mask = offs < inter
    gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    return silu_mul(gate, up, x_row.dtype.element_ty)
