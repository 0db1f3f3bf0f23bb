"""The last step of a split-K matmul: the K slices' float32 partial sums [S, M, N] added in slice
order and cast to the output dtype in one kernel, where PyTorch takes two (the sum, then the
cast) and writes the float32 sum in between. The order is fixed, so the result does not depend
on timing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv

BLOCK = 1024


@triton.jit
def _sum_slices_kernel(ws_ptr, out_ptr, total, split, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(split):
        acc += tl.load(ws_ptr + s * total + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_slices(ws: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ws [S, M, N] float32, contiguous -> [M, N] in dtype."""
    split, m, n = ws.shape
    out = torch.empty(m, n, dtype=dtype, device=ws.device)
    if m * n:
        _sum_slices_kernel[(cdiv(m * n, BLOCK),)](ws, out, m * n, split, BLOCK=BLOCK, num_warps=4)
    return out
