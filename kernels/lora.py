"""Multi-LoRA: the low-rank deltas of a batch whose rows use different adapters (punica's
shrink and expand), added to a linear layer's output in place.

Every adapter's A and B are stacked ([S, R, K] and [S, N, R]) and each row names its adapter
(`slots[t]`, -1: none). The shrink is one GEMM against every adapter's A at once (cuBLAS:
[T, K] x [K, S*R]; a Triton shrink per row block ran on a handful of programs at decode sizes
and cost more than the projections' own GEMMs, docs/kernels.md). The expand is ours: a
program takes a block of rows and of outputs, goes through the adapters its rows use (each
row reads its own adapter's R columns of the shrink), and reads and writes the output tile
once. The grid depends only on the batch size: the same launch serves every mix, and a CUDA
graph captured once replays for any assignment of adapters to rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import validation, validation_ops
from ._launch import cdiv, check_runnable

OP = "add_lora"


# T (the step's token count) is not specialized on: a new divisibility of T would compile a
# variant in the middle of serving (~1 s); the CUDA graphs compile the rest at start-up.
@triton.jit(do_not_specialize=["T"])
def _expand_kernel(u_ptr, b_ptr, slots_ptr, y_ptr, T, N, R, S, stride_u, stride_bs, stride_y,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   IEEE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_slots = tl.load(slots_ptr + rows, mask=rows < T, other=-1)
    some = row_slots >= 0
    if tl.max(some.to(tl.int32), axis=0) > 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ranks = tl.arange(0, BLOCK_R)
        delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for slot in range(0, S):
            mine = row_slots == slot
            if tl.max(mine.to(tl.int32), axis=0) > 0:
                # Rows of other adapters load zeros: their products add nothing here.
                u = tl.load(u_ptr + rows.to(tl.int64)[:, None] * stride_u + slot * R + ranks[None, :],
                            mask=mine[:, None] & (ranks < R)[None, :], other=0.0)
                b = tl.load(b_ptr + slot * stride_bs + cols[None, :] * R + ranks[:, None],
                            mask=(cols < N)[None, :] & (ranks < R)[:, None], other=0.0)
                if IEEE:
                    delta += tl.dot(u, b, input_precision="ieee")
                else:
                    delta += tl.dot(u, b)
        y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
        mask = some[:, None] & (cols < N)[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             slots: torch.Tensor, *, block_m: int = 64, block_n: int | None = None,
             num_warps: int = 4) -> torch.Tensor:
    """y [T, N] += for each row t with slots[t] = s >= 0: (x[t] @ lora_a[s].T) @ lora_b[s].T,
    in place. x [T, K]; lora_a [S, R, K]; lora_b [S, N, R]; slots [T] int32/int64, -1: no
    adapter. Matches kernels.reference.add_lora_ref's rounding."""
    validation_ops.check_add_lora(OP, y, x, lora_a, lora_b, slots, validation.HALF_AND_FLOAT)
    check_runnable(OP, x)
    t, k = x.shape
    s, r, _ = lora_a.shape
    n = y.shape[1]
    if t == 0 or s == 0 or r == 0 or n == 0:
        return y
    block_r = max(16, triton.next_power_of_2(r))
    if block_n is None:  # 64x64 tiles up to 512 tokens, 64x128 beyond: the sweeps in docs/kernels.md
        block_n = 64 if t <= 512 else 128
    ieee = x.dtype == torch.float32  # fp32 models (tests) must not round through TF32
    # The shrink for every adapter at once, one GEMM: x @ [A_0; ...; A_S-1]^T, rounded to x's
    # dtype as the unfused x @ A.T is. Each row then reads its own adapter's R columns.
    u = torch.matmul(x, lora_a.view(s * r, k).t())
    _expand_kernel[(cdiv(t, block_m), cdiv(n, block_n))](
        u, lora_b, slots, y, t, n, r, s, u.stride(0), lora_b.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, IEEE=ieee, num_warps=num_warps)
    return y
