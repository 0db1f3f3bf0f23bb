"""Scatter this step's keys and values into the paged KV cache by slot_mapping (-1 = skip).

One program per token copies all KV heads of that token: a [Hkv, D] tile whose rows are the
cache's contiguous [Hkv, D] slot, so the write is one contiguous run per token. key/value may be
strided views into a fused qkv projection output.

An FP8 cache stores value / scale (per-tensor k_scale, v_scale), rounded to nearest, saturated
at +-448, NaN as 0: the attention kernels multiply the scales back in. Its values are transposed
within each block ([Hkv, D, block_size], validation.v_cache_shape), so a token's value is
strided there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import validation
from ._launch import check_runnable, next_pow2

OP = "store_kv_cache"


@triton.jit
def _to_e4m3_bits(x, inv_scale, FP8_MAX: tl.constexpr):
    """float8 e4m3fn bits (uint8) of x * inv_scale: saturated at +-FP8_MAX, rounded to nearest
    even. By hand rather than `.to(tl.float8e4nv)`, whose emulation in the interpreter (the CPU
    tests) rounds some values a whole binade off (7.9 -> 4); on the GPU this costs a few integer
    ops in a kernel that is bound by memory, and both give the same bits as torch."""
    scaled = x.to(tl.float32) * inv_scale
    y = tl.clamp(scaled, -FP8_MAX, FP8_MAX)  # NaN handling of clamp is unspecified: see below
    u = y.to(tl.uint32, bitcast=True)
    sign = (u >> 31) << 7
    mag = u & 0x7FFFFFFF
    # Normal: keep 3 of fp32's 23 mantissa bits, half to even; a carry moves into the exponent.
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    normal = normal - ((127 - 7) << 3)  # rebias the exponent from fp32's 127 to e4m3's 7
    # Below 2**-6, steps of 2**-9: round |y| * 512 to an integer (adding 2**23 rounds half to
    # even in fp32). 8 steps is the smallest normal, whose bits are 8 as well.
    steps = (tl.abs(y) * 512.0 + 8388608.0) - 8388608.0
    sub = steps.to(tl.uint32)
    bits = tl.where(tl.abs(y) < 0.015625, sub, normal) | sign
    # NaN is stored as 0: the attention kernels read the unused tail of a sequence's last run of
    # values (with zero weight), and a NaN left there by an earlier owner of the block would
    # turn 0 * value into NaN for another request. The request whose K/V were NaN still has NaN
    # in its own query and scores.
    bits = tl.where(scaled != scaled, 0, bits)
    return bits.to(tl.uint8)


@triton.jit
def store_token_rows(cache_ptr, x, slot, offs_h, offs_d, mask, inv_scale,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     QUANTIZE: tl.constexpr, TRANSPOSED: tl.constexpr, FP8_MAX: tl.constexpr):
    """Writes one token's [heads, dims] tile x (rows offs_h, columns offs_d of its [Hkv, D] slot)
    into a cache. QUANTIZE: the cache is a uint8 view of FP8 and x is stored as x * inv_scale.
    TRANSPOSED: the cache keeps each block as [Hkv, D, block_size] (an FP8 value cache)."""
    if QUANTIZE:
        # Multiply by the host-computed reciprocal (not divide): the reference does the same
        # float32 product, so both round the same value.
        x = _to_e4m3_bits(x, inv_scale, FP8_MAX)
    if TRANSPOSED:
        block = slot // BLOCK_SIZE
        dst = (block * (NUM_KV_HEADS * HEAD_DIM * BLOCK_SIZE) + offs_h[:, None] * (HEAD_DIM * BLOCK_SIZE)
               + offs_d[None, :] * BLOCK_SIZE + slot % BLOCK_SIZE)
    else:
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(cache_ptr + dst, x, mask=mask)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, inv_k_scale, inv_v_scale,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANTIZE: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_SIZE: tl.constexpr,
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
    # (The caches arrive as uint8 views when QUANTIZE.) Only an FP8 value cache is transposed.
    store_token_rows(k_cache_ptr, k, slot, offs_h, offs_d, mask, inv_k_scale, NUM_KV_HEADS,
                     HEAD_DIM, BLOCK_SIZE, QUANTIZE, False, FP8_MAX)
    store_token_rows(v_cache_ptr, v, slot, offs_h, offs_d, mask, inv_v_scale, NUM_KV_HEADS,
                     HEAD_DIM, BLOCK_SIZE, QUANTIZE, QUANTIZE, FP8_MAX)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0, *, num_warps: int = 4) -> None:
    """See docs/architecture.md. Slots are not range-checked on the device (that would sync):
    the reference raises on an out-of-range slot, the kernel writes out of bounds. The scales
    apply only to an FP8 cache."""
    validation.check_store_kv(OP, key, value, k_cache, v_cache, slot_mapping,
                              validation.HALF_AND_FLOAT)
    validation.check_kv_scales(OP, k_scale, v_scale)
    check_runnable(OP, key)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    quantize = k_cache.dtype == validation.FP8_KV_DTYPE
    if quantize:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        validation.fp32_reciprocal(k_scale), validation.fp32_reciprocal(v_scale),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim), QUANTIZE=quantize,
        FP8_MAX=validation.FP8_E4M3_MAX, BLOCK_SIZE=k_cache.shape[1], num_warps=num_warps,
    )
