"""Scatter this step's keys and values into the paged KV cache by slot_mapping (-1 = skip).

One program per token copies all KV heads of that token: a [Hkv, D] tile whose rows are the
cache's contiguous [Hkv, D] slot, so the write is one contiguous run per token. key/value may be
strided views into a fused qkv projection output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import validation
from ._launch import check_runnable, next_pow2

OP = "store_kv_cache"


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return  # padding token (e.g. a CUDA-graph slot): nothing to store
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src = tok.to(tl.int64)
    k = tl.load(key_ptr + src * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + src * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, *, num_warps: int = 4) -> None:
    """See docs/architecture.md. Slots are not range-checked on the device (that would sync):
    the reference raises on an out-of-range slot, the kernel writes out of bounds."""
    validation.check_store_kv(OP, key, value, k_cache, v_cache, slot_mapping,
                              validation.HALF_AND_FLOAT)
    check_runnable(OP, key)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim), num_warps=num_warps,
    )
