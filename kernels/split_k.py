"""The last step of a split-K matmul: the K slices' float32 partial sums [S, M, N] added and cast
to the output dtype in one kernel, where PyTorch takes two (the sum, then the cast) and writes the
float32 sum in between. A program loads a block of slices at once (a loop over the slices one at a
time keeps one load in flight and, with few output columns, few programs: a one-row GEMV's many
slices then cost more than the matmul). The order of the additions is fixed, so the result does
not depend on timing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv

BLOCK = 128  # outputs a program: a one-row projection still spreads over dozens of SMs
MAX_BLOCK_S = 32  # slices loaded at once


@triton.jit
def _sum_slices_kernel(ws_ptr, out_ptr, total, split, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s0 in range(0, split, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        tile = tl.load(ws_ptr + s[:, None].to(tl.int64) * total + offs[None, :],
                       mask=(s[:, None] < split) & mask[None, :], other=0.0)
        acc += tl.sum(tile, axis=0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_slices(ws: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ws [S, M, N] float32, contiguous -> [M, N] in dtype."""
    split, m, n = ws.shape
    out = torch.empty(m, n, dtype=dtype, device=ws.device)
    if m * n:
        block_s = min(triton.next_power_of_2(split), MAX_BLOCK_S)
        _sum_slices_kernel[(cdiv(m * n, BLOCK),)](ws, out, m * n, split, BLOCK_S=block_s, BLOCK=BLOCK,
                                                 num_warps=4)
    return out


def slices_or_output(split: int, m: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where a split-K launch writes: [1, M, N] in the output dtype when K is not split, else the
    slices' float32 partial sums [S, M, N]."""
    return torch.empty(split, m, n, dtype=dtype if split == 1 else torch.float32, device=device)


def finish(out: torch.Tensor, dtype: torch.dtype, reduce: bool = True) -> torch.Tensor:
    """[M, N] from what slices_or_output gave the launch; with reduce=False, several slices stay
    [S, M, N] float32 for the kernel after the matmul to add (kernels/norm.py does)."""
    if out.shape[0] == 1:
        return out[0]
    return sum_slices(out, dtype) if reduce else out
