"""The fused MoE layer's first step: the (token, k) pairs sorted by expert, each expert's group
padded to a multiple of BLOCK_M, so that every BLOCK_M-row tile of the grouped GEMMs belongs to
one expert (the idea of vLLM's / SGLang's `moe_align_block_size`; this is our own code).

Plain PyTorch on the tensors' device, and no device-to-host copy (the sizes come from M, top_k
and E only), so a step that runs it can be captured in a CUDA graph. Imports only torch.
"""

from __future__ import annotations

import torch

from .validation_moe import check_align

OP = "moe_align_block_size"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the sorted list can need: every expert that gets a pair adds at most block_m - 1
    padding rows, and at most min(pairs, E) experts get one; rounded up to whole tiles."""
    bound = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return _cdiv(bound, block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [M, top_k] -> (sorted_token_ids, expert_ids, num_tokens_post_padded):

    - sorted_token_ids [P] int32, P = max_padded_rows(M * top_k, E, block_m): the flat pair
      indices m * top_k + k grouped by expert (experts in increasing order, pairs in increasing
      order within one), each group padded with the sentinel M * top_k to a multiple of
      block_m; the entries past the last group hold the sentinel too.
    - expert_ids [P / block_m] int32: the expert of each tile, -1 for tiles past the end.
    - num_tokens_post_padded [1] int32: the padded length actually used (a multiple of block_m).

    An expert with no pair gets no tile. Ids must lie in [0, E) (not checked: that would need a
    device sync; kernels.reference.fused_moe_ref checks)."""
    check_align(OP, topk_ids, num_experts, block_m)
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
