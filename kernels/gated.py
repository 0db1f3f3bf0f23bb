"""The gated activation's value as kernels compute it, shared by silu_and_mul's quantizing variant
(kernels/quant.py's kernel with GATED) and kept beside silu_and_mul's own rounding."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def silu_mul_block(x_row, offs, inter):
    """silu(gate) * up for one block of a row of x = cat(gate, up), rounded as silu_and_mul
    rounds it (silu to x's dtype, then the product), in float32."""
    mask = offs < inter
    gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_row.dtype.element_ty).to(tl.float32)
    return (silu * up).to(x_row.dtype.element_ty).to(tl.float32)
