"""The mixture-of-experts router's selection in one kernel: per token, softmax over the experts'
logits in float32, the top k (highest first), renormalised to sum to one if asked, rounded to the
model dtype where the family's reference rounds them. PyTorch takes five to seven launches for
this (softmax, topk's two kernels, sum, divide, casts): at decode sizes, launches cost more than
the arithmetic, in every MoE layer of every step.

One program per BLOCK_T tokens; the k winners are found by k rounds of max-then-lowest-index
(ties go to the lower expert id), each round masking its winner out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import check_runnable
from .validation_moe import check_topk_softmax

OP = "topk_softmax"


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_lm,
                         TOP_K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr,
                         BLOCK_T: tl.constexpr, RENORMALIZE: tl.constexpr, ROUND: tl.constexpr,
                         ROUND_DTYPE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_POW2)
    row_ok = rows < num_tokens
    live = row_ok[:, None] & (cols[None, :] < num_experts)
    x = tl.load(logits_ptr + rows[:, None] * stride_lm + cols[None, :], mask=live, other=float("-inf"))
    x = x.to(tl.float32)
    x = x - tl.where(row_ok, tl.max(x, axis=1), 0.0)[:, None]  # (rows past the end: no NaN)
    p = tl.where(live, tl.exp(x), 0.0)
    p = p / tl.where(row_ok, tl.sum(p, axis=1), 1.0)[:, None]
    # NaN or infinite logits (a broken model, a warm-up on garbage) give NaN probabilities, which
    # match no maximum: as zeros they still give valid expert ids (never past the experts).
    p = tl.where(p == p, p, 0.0)
    slots = tl.arange(0, K_POW2)
    top_w = tl.zeros([BLOCK_T, K_POW2], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_T, K_POW2], dtype=tl.int32)
    left = tl.where(live, p, -1.0)  # probabilities are >= 0: -1 marks taken or absent experts
    for k in tl.static_range(TOP_K):
        best = tl.max(left, axis=1)
        idx = tl.min(tl.where(left == best[:, None], cols[None, :], E_POW2), axis=1)
        top_w = tl.where(slots[None, :] == k, best[:, None], top_w)
        top_i = tl.where(slots[None, :] == k, idx[:, None], top_i)
        left = tl.where(cols[None, :] == idx[:, None], -1.0, left)
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(slots[None, :] < TOP_K, top_w, 0.0), axis=1)[:, None]
    if ROUND:
        top_w = top_w.to(ROUND_DTYPE).to(tl.float32)
    out = row_ok[:, None] & (slots[None, :] < TOP_K)
    offs = rows[:, None] * TOP_K + slots[None, :]
    tl.store(weights_ptr + offs, top_w, mask=out)
    tl.store(ids_ptr + offs, top_i, mask=out)


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool,
                 round_to: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [M, E] -> (weights [M, top_k] float32, expert ids [M, top_k] int32)."""
    check_topk_softmax(OP, logits, top_k, round_to)
    check_runnable(OP, logits)
    m, experts = logits.shape
    weights = torch.empty(m, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(m, top_k, dtype=torch.int32, device=logits.device)
    if m == 0:
        return weights, ids
    e_pow2 = triton.next_power_of_2(experts)
    block_t = max(1, min(16, 2048 // e_pow2))  # a few thousand logits a program
    _topk_softmax_kernel[(triton.cdiv(m, block_t),)](
        logits, weights, ids, m, experts, logits.stride(0), TOP_K=top_k,
        K_POW2=triton.next_power_of_2(top_k), E_POW2=e_pow2, BLOCK_T=block_t,
        RENORMALIZE=bool(renormalize), ROUND=round_to is not None,
        ROUND_DTYPE=_TL_DTYPES[round_to or torch.float32], num_warps=4)
    return weights, ids
