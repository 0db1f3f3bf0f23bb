"""Helpers shared by the decode and prefill attention kernels: device functions (inlined by
Triton) and the host-side launch arguments that depend on the cache.

Both kernels walk a sequence's keys in tiles of BLOCK_N tokens that may span several physical
cache blocks, so each key's address comes from the block table, token by token; the cache is
never gathered into a contiguous copy.
"""

import math

import torch
import triton
import triton.language as tl

from . import validation


def cache_launch_args(op: str, query_dtype: torch.dtype, k_cache: torch.Tensor, scale: float,
                      k_scale: float, v_scale: float, fp8_compute: str, block_n: int):
    """The launch arguments both attention kernels derive from the cache: (scale_log2e, v_scale,
    constexprs). Only an FP8 cache is stored scaled (a 16-bit cache takes 1.0 whatever is
    passed); k_scale folds into the softmax scale. An FP8 cache has its values transposed per
    block, read in runs of min(BLOCK_N, block_size) tokens, and with bf16 queries runs its dots
    in float16 unless fp8_compute is "query"."""
    if fp8_compute not in ("float16", "query"):
        validation.fail(op, f"fp8_compute must be 'float16' or 'query', got {fp8_compute!r}")
    fp8 = k_cache.dtype == validation.FP8_KV_DTYPE
    if not fp8:
        k_scale = v_scale = 1.0
    constexprs = dict(SCALE_V=v_scale != 1.0, V_TRANSPOSED=fp8, V_RUN=min(block_n, k_cache.shape[1]),
                      FP16_DOTS=fp8 and query_dtype == torch.bfloat16 and fp8_compute == "float16")
    return scale * k_scale * math.log2(math.e), float(v_scale), constexprs


def window_softcap_args(window: int, softcap: float):
    """The launch arguments of the per-call options (validation.check_window_softcap's (window,
    softcap), 0 for none): (window, softcap in the kernels' log2 units, constexprs). Both are
    constexpr-guarded, so calls without them run the kernels built before they existed."""
    return window, softcap * math.log2(math.e), dict(USE_WINDOW=window > 0, SOFTCAP=softcap > 0)


@triton.jit
def window_bounds(first_row, last_row, window, BLOCK_N: tl.constexpr):
    """Key range of a tile of query rows at positions first_row..last_row (in the keys'
    coordinates) under a sliding window: (lo, start, free). A row at p sees keys k with
    p - window < k <= p (Hugging Face's sliding_window_overlay: kv_idx > q_idx - sliding_window,
    with causal_mask_function's kv_idx <= q_idx), so no row sees a key below lo; `start` is lo's
    tile, where the walk begins, and from `free` (a tile boundary) on every row sees every key
    that causality lets it see, so those tiles need no window mask."""
    lo = tl.maximum(first_row - window + 1, 0)
    free = tl.maximum(last_row - window + 1, 0)
    return lo, (lo // BLOCK_N) * BLOCK_N, ((free + BLOCK_N - 1) // BLOCK_N) * BLOCK_N


@triton.jit
def soft_cap(s, cap):
    """cap * tanh(s / cap) (Gemma 2's attention-logit soft-capping), with s and cap in the same
    units. Written with exp2, which the interpreter has (libdevice's tanh it has not); exp2 of
    -2|s| / cap cannot overflow. 2.885... is 2 * log2(e)."""
    e = tl.exp2(tl.abs(s) * (-2.8853900817779268 / cap))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(s < 0.0, -t, t) * cap


@triton.jit
def kv_row_offsets(block_table_row, tok, valid, head_offset, stride_block, stride_token,
                   BLOCK_SIZE: tl.constexpr):
    """Element offset of the first dim of token `tok` (one KV head) in a [num_blocks, block_size,
    Hkv, D] cache. Tokens where `valid` is false read block-table entry 0 of nothing: offset 0."""
    block = tl.load(block_table_row + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    # int64: num_blocks * block_size * Hkv * D passes 2**31 on a large pool.
    return block * stride_block + (tok % BLOCK_SIZE) * stride_token + head_offset


@triton.jit
def transposed_v_tile(v_cache_ptr, block_table_row, n0, end, offs_d, d_mask, head_offset,
                      stride_block, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, V_RUN: tl.constexpr, lo=0, FROM_LO: tl.constexpr = False):
    """V rows [BLOCK_N, BLOCK_D] of tokens n0.. from a cache laid out [num_blocks, Hkv, D,
    block_size] (an FP8 cache). Runs that start at or past `end` read 0; the rest of a run that
    starts before it is read as stored (the caller gives those tokens zero weight). With
    FROM_LO (a sliding window), runs that end at or before `lo` read 0 too: their blocks may
    have left the window. The tile is
    addressed as [runs, D, V_RUN]
    with V_RUN = min(BLOCK_N, block_size) tokens contiguous in memory, so Triton sees the
    contiguity and issues wide loads (addressed per token it cannot: a token's block id is a
    loaded value, and it fell back to one-byte loads); then it is permuted to [BLOCK_N, D]."""
    NUM_RUNS: tl.constexpr = BLOCK_N // V_RUN
    first = n0 + tl.arange(0, NUM_RUNS) * V_RUN
    runs = first < end
    if FROM_LO:
        runs = runs & (first + V_RUN > lo)
    block = tl.load(block_table_row + first // BLOCK_SIZE, mask=runs, other=0).to(tl.int64)
    base = block * stride_block + head_offset + first % BLOCK_SIZE
    offs_t = tl.arange(0, V_RUN)
    # Masked per run, not per token, so the mask is constant along the contiguous axis (a
    # per-token mask makes Triton load bytes, and zeroing rows after the load makes it convert
    # layouts through shared memory two bytes at a time). A run that starts before `end` lies in
    # an allocated block, so reading its tail is safe; those rows get p = 0, and they are finite
    # because the FP8 store never writes NaN (kv_store), so 0 * value stays 0.
    x = tl.load(v_cache_ptr + base[:, None, None] + offs_d[None, :, None] * BLOCK_SIZE
                + offs_t[None, None, :], mask=runs[:, None, None] & d_mask[None, :, None],
                other=0.0)
    return tl.trans(tl.reshape(tl.permute(x, (1, 0, 2)), (BLOCK_D, BLOCK_N)))


@triton.jit
def attend_tile(q, k, v, mask, m_i, l_i, acc, scale_log2e,
                APPLY_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, softcap=0.0,
                SOFTCAP: tl.constexpr = False, EMPTY_ROWS: tl.constexpr = False):
    """One online-softmax step of rows q [M, D] over keys k [N, D], values v [N, D].

    Scores are kept in log2 units (scale * log2(e) folded in) so the exponentials are exp2. The
    caller guarantees each row has at least one unmasked key in its first tile, so m_i is finite
    after it and exp2(m_i - m_new) never sees -inf - -inf; or, with EMPTY_ROWS (a sliding
    window's tiles, where a row may see none of a tile's keys), a row that has seen no key yet
    keeps m_i = -inf and adds nothing. With SOFTCAP the scores are capped (`softcap`, log2
    units: C * log2(e)) after the scale and before the mask, in Hugging Face's order (gemma2's
    eager_attention_forward).
    """
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
    if SOFTCAP:
        s = soft_cap(s, softcap)
    if APPLY_MASK:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = m_new
    if EMPTY_ROWS:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # p in the cache dtype so the second product runs on tensor cores too (as flash-attention does).
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
