"""Rotary position embedding, in place on query and key (neox / rotate-half style, as HF Llama).

The caller builds cos_sin_cache [max_position, rotary_dim] = cat(cos, sin) in float32, so Llama-3
scaled RoPE or any other frequency scheme is just a different cache. One program per token rotates
all query heads and then all key heads: the token's cos/sin row is loaded once for both. Only the
first rotary_dim dims of each head rotate (partial rotary); the rest are left untouched.

With q_norm_weight / k_norm_weight (Qwen3), each head is first RMS-normalised over head_size with
its weight, rounded as kernels/norm.py rounds (normalised value to the dtype, then the weight
product to the dtype), all in the same pass: no gather and write-back of the heads beforehand.

Given a KV cache (value, k_cache, v_cache, slot_mapping), the same program also stores the
token's rotated key and its value there, as kernels/kv_store.py would (FP8 included): a decode
step then runs one small kernel per layer instead of two, and a prefill step reads the keys once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import validation, validation_ops
from ._launch import check_runnable, next_pow2
from .kv_store import store_token_rows

OP = "apply_rotary_emb"


@triton.jit
def _norm_half(x, inv_rms, w_ptr, offs_r, HALF: tl.constexpr, dtype: tl.constexpr):
    """One half of each head, normalised and weighted with kernels/norm.py's roundings."""
    w = tl.load(w_ptr + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)
    normed = (x * inv_rms[:, None]).to(dtype).to(tl.float32)
    return (normed * w[None, :]).to(dtype).to(tl.float32)


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, tok, cos, sin, num_heads, w_ptr, eps,
                  BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  HAS_NORM: tl.constexpr):
    """Rotates (and with HAS_NORM first normalises) one token's heads in place; returns the two
    rotated halves as stored, in x's dtype."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < num_heads)[:, None] & (offs_r < HALF)[None, :]
    first = x_ptr + tok * stride_t + offs_h[:, None] * stride_h + offs_r[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # (only with rotary_dim == head_size: the two halves are the whole head)
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        x1 = _norm_half(x1, inv_rms, w_ptr, offs_r, HALF, x_ptr.dtype.element_ty)
        x2 = _norm_half(x2, inv_rms, w_ptr + HALF, offs_r, HALF, x_ptr.dtype.element_ty)
    r1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty)
    r2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty)
    tl.store(first, r1, mask=mask)
    tl.store(first + HALF, r2, mask=mask)
    return r1, r2


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, num_heads, num_kv_heads,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_vt, stride_vh, inv_k_scale, inv_v_scale,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_STORE: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_TAIL: tl.constexpr, QUANTIZE: tl.constexpr, FP8_MAX: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + pos * (2 * HALF)
    cos = tl.load(row + offs_r, mask=offs_r < HALF, other=0.0)
    sin = tl.load(row + HALF + offs_r, mask=offs_r < HALF, other=0.0)
    _rotate_heads(q_ptr, stride_qt, stride_qh, tok, cos, sin, num_heads, q_norm_ptr, eps,
                  BLOCK_HQ, HALF, BLOCK_HALF, HAS_NORM)
    k1, k2 = _rotate_heads(k_ptr, stride_kt, stride_kh, tok, cos, sin, num_kv_heads, k_norm_ptr, eps,
                           BLOCK_HK, HALF, BLOCK_HALF, HAS_NORM)
    if HAS_STORE:
        slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
        if slot >= 0:  # (-1: a padding token, nothing to store)
            offs_h = tl.arange(0, BLOCK_HK)
            rows = offs_h < KV_HEADS
            # The rotated halves straight from registers, then any dims that do not rotate.
            half_mask = rows[:, None] & (offs_r < HALF)[None, :]
            store_token_rows(k_cache_ptr, k1, slot, offs_h, offs_r, half_mask, inv_k_scale,
                             KV_HEADS, HEAD_DIM, BLOCK_SIZE, QUANTIZE, False, FP8_MAX)
            store_token_rows(k_cache_ptr, k2, slot, offs_h, HALF + offs_r, half_mask, inv_k_scale,
                             KV_HEADS, HEAD_DIM, BLOCK_SIZE, QUANTIZE, False, FP8_MAX)
            if BLOCK_TAIL > 0:
                offs_t = 2 * HALF + tl.arange(0, BLOCK_TAIL)
                tail_mask = rows[:, None] & (offs_t < HEAD_DIM)[None, :]
                tail = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_t[None, :],
                               mask=tail_mask)
                store_token_rows(k_cache_ptr, tail, slot, offs_h, offs_t, tail_mask, inv_k_scale,
                                 KV_HEADS, HEAD_DIM, BLOCK_SIZE, QUANTIZE, False, FP8_MAX)
            offs_d = tl.arange(0, BLOCK_D)
            v_mask = rows[:, None] & (offs_d < HEAD_DIM)[None, :]
            v = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=v_mask)
            # Only an FP8 value cache is transposed within its blocks.
            store_token_rows(v_cache_ptr, v, slot, offs_h, offs_d, v_mask, inv_v_scale,
                             KV_HEADS, HEAD_DIM, BLOCK_SIZE, QUANTIZE, QUANTIZE, FP8_MAX)


def apply_rotary_emb(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int | None = None,
                     q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                     eps: float = 1e-6, *, value: torch.Tensor | None = None,
                     k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                     slot_mapping: torch.Tensor | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0, num_warps: int = 4) -> None:
    """query [T, Hq*D] or [T, Hq, D], key likewise with Hkv; both rotated in place. For the 2-D
    form, head_size defaults to rotary_dim. Positions are not range-checked on the device. With
    the norm weights ([D] each), every head is RMS-normalised (eps) before it rotates. With value
    (key's layout), k_cache, v_cache and slot_mapping, the rotated key and the value are also
    stored as store_kv_cache stores them (slot -1: skipped; slots not range-checked)."""
    head_size, rotary_dim, num_heads, num_kv_heads = validation_ops.check_rotary(
        OP, query, key, positions, cos_sin_cache, head_size, validation.HALF_AND_FLOAT)
    has_norm = validation_ops.check_head_norm(OP, query, q_norm_weight, k_norm_weight, head_size, rotary_dim)
    store = validation_ops.check_rotary_store(OP, key, value, k_cache, v_cache, slot_mapping, k_scale,
                                          v_scale, head_size, validation.HALF_AND_FLOAT)
    check_runnable(OP, query)
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return
    # Head stride: D for the flat [T, H*D] form, the real stride for [T, H, D] views.
    stride_qh = query.stride(1) if query.dim() == 3 else head_size
    stride_kh = key.stride(1) if key.dim() == 3 else head_size
    half = rotary_dim // 2
    quantize = store and k_cache.dtype == validation.FP8_KV_DTYPE
    if quantize:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    unused = cos_sin_cache  # any tensor, for the pointers a variant does not read
    _rotary_kernel[(num_tokens,)](
        query, key, positions, cos_sin_cache,
        q_norm_weight if has_norm else unused, k_norm_weight if has_norm else unused,
        float(eps), query.stride(0), stride_qh, key.stride(0), stride_kh, num_heads, num_kv_heads,
        value if store else unused, k_cache if store else unused, v_cache if store else unused,
        slot_mapping if store else positions, value.stride(0) if store else 0,
        (value.stride(1) if value.dim() == 3 else head_size) if store else 0,
        validation.fp32_reciprocal(k_scale), validation.fp32_reciprocal(v_scale),
        HALF=half, BLOCK_HALF=next_pow2(half), BLOCK_HQ=next_pow2(num_heads),
        BLOCK_HK=next_pow2(num_kv_heads), HAS_NORM=has_norm, HAS_STORE=store,
        KV_HEADS=num_kv_heads, HEAD_DIM=head_size, BLOCK_D=next_pow2(head_size),
        BLOCK_TAIL=next_pow2(head_size - rotary_dim) if head_size > rotary_dim else 0,
        QUANTIZE=quantize, FP8_MAX=validation.FP8_E4M3_MAX,
        BLOCK_SIZE=k_cache.shape[1] if store else 1, num_warps=num_warps,
    )
