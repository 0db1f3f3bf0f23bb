"""The fused MoE layer's first step: the (token, k) pairs sorted by expert, each expert's group
padded to a multiple of BLOCK_M, so that every BLOCK_M-row tile of the grouped GEMMs belongs to
one expert (the idea of vLLM's / SGLang's `moe_align_block_size`; this is our own code).

No device-to-host copy (the sizes come from M, top_k and E only), so a step that runs it can be
captured in a CUDA graph. Up to ALIGN_KERNEL_MAX_PAIRS pairs (decode and small prefills) one
Triton program does it all in one launch (`_align_kernel`): a chain of a dozen PyTorch ops costs
more than the grouped GEMMs of a decode step. More pairs take the PyTorch ops (`_align_torch`),
whose cost is small beside those GEMMs and which spread over the whole GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .validation_moe import check_align

OP = "moe_align_block_size"
# One program walks the pairs three times; past this many a single program is slower than torch's
# sort spread over the GPU.
ALIGN_KERNEL_MAX_PAIRS = 4096


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the sorted list can need: every expert that gets a pair adds at most block_m - 1
    padding rows, and at most min(pairs, E) experts get one; rounded up to whole tiles."""
    bound = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return _cdiv(bound, block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                         use_kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [M, top_k] -> (sorted_token_ids, expert_ids, num_tokens_post_padded):

    - sorted_token_ids [P] int32, P = max_padded_rows(M * top_k, E, block_m): the flat pair
      indices m * top_k + k grouped by expert (experts in increasing order, pairs in increasing
      order within one), each group padded with the sentinel M * top_k to a multiple of
      block_m; the entries past the last group hold the sentinel too.
    - expert_ids [P / block_m] int32: the expert of each tile, -1 for tiles past the end.
    - num_tokens_post_padded [1] int32: the padded length actually used (a multiple of block_m).

    An expert with no pair gets no tile. Ids must lie in [0, E) (not checked: that would need a
    device sync; kernels.reference.fused_moe_ref checks). `use_kernel`: None picks by size (the
    kernel needs a device Triton runs on); True or False forces one way (tests)."""
    check_align(OP, topk_ids, num_experts, block_m)
    if use_kernel is None:
        from ._launch import INTERPRETED
        runnable = topk_ids.is_cuda or (INTERPRETED and topk_ids.device.type == "cpu")
        use_kernel = runnable and topk_ids.numel() <= ALIGN_KERNEL_MAX_PAIRS
    return (_align_with_kernel if use_kernel else _align_torch)(topk_ids, num_experts, block_m)


def _align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    padded_len = max_padded_rows(pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)                     # padded group ends
    firsts = torch.cumsum(counts, 0) - counts          # group starts in the unpadded sorted order
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    dest = (ends - padded)[experts] + torch.arange(pairs, device=device) - firsts[experts]
    sorted_ids = torch.full((padded_len,), pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    tile_starts = torch.arange(0, padded_len, block_m, device=device)
    expert_ids = torch.searchsorted(ends, tile_starts, right=True).to(torch.int32)
    total = ends[-1:]
    expert_ids = torch.where(tile_starts < total, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, total.to(torch.int32)


@triton.jit
def _chunk_counts(e, valid, experts, E_POW2: tl.constexpr):
    """Pairs of each expert among a chunk's valid lanes (invalid lanes count as expert 0, then
    come off again: no histogram mask needed)."""
    invalid = tl.sum((valid == 0).to(tl.int32), axis=0)
    return tl.histogram(tl.where(valid, e, 0), E_POW2) - tl.where(experts == 0, invalid, 0)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, post_ptr, cursor_ptr, num_pairs, padded_len,
                  num_tiles, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                  FILL: tl.constexpr):
    """One program: count each expert's pairs (histograms), lay the padded groups out (exclusive
    cumsum), write each tile's expert, fill every slot with the sentinel, then walk the pairs in
    order and place each at its expert's cursor plus its rank among the chunk's earlier pairs of
    that expert (a [BLOCK, BLOCK] comparison), so groups keep increasing pair order. The cursors
    live in global scratch so lanes can gather them; barriers order the CTA's writes."""
    experts = tl.arange(0, E_POW2)
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for start in range(0, num_pairs, FILL):
        offs = start + tl.arange(0, FILL)
        valid = offs < num_pairs
        counts += _chunk_counts(tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32), valid, experts, E_POW2)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(post_ptr, tl.sum(padded, axis=0))
    for start in range(0, num_tiles, BLOCK):
        tile = start + tl.arange(0, BLOCK)
        first = tile[:, None] * BLOCK_M
        inside = (first >= starts[None, :]) & (first < ends[None, :])   # at most one expert per tile
        expert = tl.sum(tl.where(inside, experts[None, :], 0), axis=1)
        owned = tl.sum(inside.to(tl.int32), axis=1) > 0
        tl.store(expert_ids_ptr + tile, tl.where(owned, expert, -1), mask=tile < num_tiles)
    for start in range(0, padded_len, FILL):
        slot = start + tl.arange(0, FILL)
        tl.store(sorted_ptr + slot, tl.zeros([FILL], dtype=tl.int32) + num_pairs, mask=slot < padded_len)
    cursor = starts
    tl.store(cursor_ptr + experts, cursor)
    tl.debug_barrier()
    lane = tl.arange(0, BLOCK)
    earlier = lane[None, :] < lane[:, None]  # [i, j]: lane j comes before lane i
    for start in range(0, num_pairs, BLOCK):
        offs = start + lane
        valid = offs < num_pairs
        e = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
        base = tl.load(cursor_ptr + e, mask=valid, other=0)
        rank = tl.sum(((e[:, None] == e[None, :]) & earlier).to(tl.int32), axis=1)
        tl.store(sorted_ptr + base + rank, offs.to(tl.int32), mask=valid)
        tl.debug_barrier()  # every lane has read the cursors before they move
        cursor += _chunk_counts(e, valid, experts, E_POW2)
        tl.store(cursor_ptr + experts, cursor)
        tl.debug_barrier()


def _align_with_kernel(topk_ids: torch.Tensor, num_experts: int, block_m: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pairs = topk_ids.numel()
    padded_len = max_padded_rows(pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(padded_len, dtype=torch.int32, device=device)
    expert_ids = torch.empty(padded_len // block_m, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    e_pow2 = triton.next_power_of_2(num_experts)
    cursors = torch.empty(e_pow2, dtype=torch.int32, device=device)
    _align_kernel[(1,)](topk_ids.reshape(-1), sorted_ids, expert_ids, total, cursors, pairs, padded_len,
                        expert_ids.numel(), E_POW2=e_pow2, BLOCK_M=block_m, BLOCK=64, FILL=1024,
                        num_warps=4)
    return sorted_ids, expert_ids, total
