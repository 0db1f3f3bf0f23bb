"""The pieces of paged prefill attention's kernel (kernels/prefill_attention.py): the loop over
the cached prefix through the block table, the loop over the chunk's own keys and values, and the
tile loads they share. Kept apart so that each file stays small."""

from __future__ import annotations

import triton
import triton.language as tl

from ._attention_tile import attend_tile, kv_row_offsets, transposed_v_tile, window_bounds


@triton.jit
def _attend_through_cache(q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_row,
                          head_offset, v_head_offset, prefix, p_lo, p_hi, scale_log2e, stride_cb,
                          stride_ct, offs_n, offs_d, d_mask, window, softcap, HEAD_DIM: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          V_TRANSPOSED: tl.constexpr, V_RUN: tl.constexpr,
                          USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """Every key, prefix and chunk alike, read through the block table. The tile's rows are at
    chunk positions p_lo..p_hi-1."""
    # Keys at positions <= prefix + p_lo are visible to every row of this tile: no mask at all.
    full_end = ((prefix + p_lo + 1) // BLOCK_N) * BLOCK_N
    free = 0
    if USE_WINDOW:
        # Tiles before lo's are skipped; up to `free` a row may be outside some keys' window.
        lo, start, free = window_bounds(prefix + p_lo, prefix + p_hi - 1, window, BLOCK_N)
        free = tl.minimum(free, full_end)
        for n0 in range(start, free, BLOCK_N):
            tok = n0 + offs_n
            valid = tok >= lo
            rows = kv_row_offsets(block_table_row, tok, valid, head_offset, stride_cb, stride_ct,
                                  BLOCK_SIZE)
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if V_TRANSPOSED:
                v = transposed_v_tile(v_cache_ptr, block_table_row, n0, free, offs_d, d_mask,
                                      v_head_offset, stride_cb, BLOCK_SIZE, BLOCK_N, BLOCK_D, V_RUN,
                                      lo, True)
            else:
                v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            seen = tok[None, :] > q_pos[:, None] - window
            m_i, l_i, acc = attend_tile(q, k.to(q.dtype), v.to(q.dtype), seen, m_i, l_i, acc,
                                        scale_log2e, True, DOT_PRECISION, softcap, SOFTCAP, True)
    for n0 in range(free, full_end, BLOCK_N):
        tok = n0 + offs_n
        rows = kv_row_offsets(block_table_row, tok, tok < full_end, head_offset, stride_cb,
                              stride_ct, BLOCK_SIZE)
        if BLOCK_D == HEAD_DIM:
            k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :])
        else:
            k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        if V_TRANSPOSED:
            v = transposed_v_tile(v_cache_ptr, block_table_row, n0, full_end, offs_d, d_mask,
                                  v_head_offset, stride_cb, BLOCK_SIZE, BLOCK_N, BLOCK_D, V_RUN)
        elif BLOCK_D == HEAD_DIM:
            v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :])
        else:
            v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        m_i, l_i, acc = attend_tile(q, k.to(q.dtype), v.to(q.dtype), 0, m_i, l_i, acc, scale_log2e,
                                    False, DOT_PRECISION, softcap, SOFTCAP)

    # Diagonal tiles: causal mask. The first one holds position prefix + p_lo, which every row
    # sees, so no row is fully masked on its first tile (attend_tile relies on that; with a
    # window, which may hide it from later rows, EMPTY_ROWS covers them).
    kv_end = prefix + p_hi
    for n0 in range(full_end, kv_end, BLOCK_N):
        tok = n0 + offs_n
        valid = tok < kv_end
        if USE_WINDOW:
            valid = valid & (tok >= lo)
        rows = kv_row_offsets(block_table_row, tok, valid, head_offset, stride_cb, stride_ct,
                              BLOCK_SIZE)
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if V_TRANSPOSED:
            if USE_WINDOW:
                v = transposed_v_tile(v_cache_ptr, block_table_row, n0, kv_end, offs_d, d_mask,
                                      v_head_offset, stride_cb, BLOCK_SIZE, BLOCK_N, BLOCK_D, V_RUN,
                                      lo, True)
            else:
                v = transposed_v_tile(v_cache_ptr, block_table_row, n0, kv_end, offs_d, d_mask,
                                      v_head_offset, stride_cb, BLOCK_SIZE, BLOCK_N, BLOCK_D, V_RUN)
        else:
            v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        causal = (tok[None, :] <= q_pos[:, None]) & valid[None, :]
        if USE_WINDOW:
            causal = causal & (tok[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = attend_tile(q, k.to(q.dtype), v.to(q.dtype), causal, m_i, l_i, acc,
                                    scale_log2e, True, DOT_PRECISION, softcap, SOFTCAP, USE_WINDOW)
    return m_i, l_i, acc


@triton.jit
def _chunk_kv_tile(key, value, row0, offs_n, valid, kv_head, stride_kt, stride_kh, stride_vt,
                   stride_vh, offs_d, d_mask, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   MASKED: tl.constexpr, KV_TMA: tl.constexpr):
    """K and V rows row0.. of the chunk's own [T, Hkv, D] tensors (descriptors when KV_TMA).
    With MASKED, rows that are not `valid` read as 0 (past the chunk lie other sequences' rows)."""
    if KV_TMA:
        k = key.load([row0, kv_head * HEAD_DIM])
        v = value.load([row0, kv_head * HEAD_DIM])
        if MASKED:
            v = tl.where(valid[:, None], v, 0.0)
    else:
        rows = (row0 + offs_n).to(tl.int64)
        k_ptrs = key + rows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        v_ptrs = value + rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
        if MASKED:
            mask = valid[:, None] & d_mask[None, :]
            k = tl.load(k_ptrs, mask=mask, other=0.0)
            v = tl.load(v_ptrs, mask=mask, other=0.0)
        elif BLOCK_D == HEAD_DIM:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    return k, v


@triton.jit
def _cache_kv_tile(k_cache_ptr, v_cache_ptr, rows, valid, offs_d, d_mask, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, MASKED: tl.constexpr):
    """K and V of the tokens at element offsets `rows` of a 16-bit cache (kv_row_offsets). With
    MASKED, tokens that are not `valid` read as 0."""
    ptrs = rows[:, None] + offs_d[None, :]
    if MASKED:
        mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + ptrs, mask=mask, other=0.0)
        v = tl.load(v_cache_ptr + ptrs, mask=mask, other=0.0)
    elif BLOCK_D == HEAD_DIM:
        k = tl.load(k_cache_ptr + ptrs)
        v = tl.load(v_cache_ptr + ptrs)
    else:
        k = tl.load(k_cache_ptr + ptrs, mask=d_mask[None, :], other=0.0)
        v = tl.load(v_cache_ptr + ptrs, mask=d_mask[None, :], other=0.0)
    return k, v


@triton.jit
def _attend_prefix(q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_row, head_offset,
                   prefix, p_lo, p_hi, scale_log2e, stride_cb, stride_ct, offs_n, offs_d, d_mask,
                   window, softcap, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   PREFIX_STAGES: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """The cached prefix (earlier chunks, prefix-cache hits) through the block table."""
    # The prefix is visible to every row: whole tiles need no mask, only a partial last one does.
    # Whichever tile comes first holds token 0, so no row is fully masked on its first tile
    # (attend_tile relies on that). A window hides the prefix's start from some rows: its tiles
    # before `free` are masked (EMPTY_ROWS), those before lo's skipped.
    full_prefix = (prefix // BLOCK_N) * BLOCK_N
    free = 0
    if USE_WINDOW:
        lo, start, free = window_bounds(prefix + p_lo, prefix + p_hi - 1, window, BLOCK_N)
        for n0 in tl.range(start, tl.minimum(free, prefix), BLOCK_N, num_stages=PREFIX_STAGES):
            tok = n0 + offs_n
            valid = (tok >= lo) & (tok < prefix)
            rows = kv_row_offsets(block_table_row, tok, valid, head_offset, stride_cb, stride_ct,
                                  BLOCK_SIZE)
            k, v = _cache_kv_tile(k_cache_ptr, v_cache_ptr, rows, valid, offs_d, d_mask, HEAD_DIM,
                                  BLOCK_D, True)
            seen = valid[None, :] & (tok[None, :] > q_pos[:, None] - window)
            m_i, l_i, acc = attend_tile(q, k, v, seen, m_i, l_i, acc, scale_log2e, True,
                                        DOT_PRECISION, softcap, SOFTCAP, True)
    for n0 in tl.range(free, full_prefix, BLOCK_N, num_stages=PREFIX_STAGES):
        whole = offs_n >= 0
        rows = kv_row_offsets(block_table_row, n0 + offs_n, whole, head_offset, stride_cb,
                              stride_ct, BLOCK_SIZE)
        k, v = _cache_kv_tile(k_cache_ptr, v_cache_ptr, rows, whole, offs_d, d_mask, HEAD_DIM,
                              BLOCK_D, False)
        m_i, l_i, acc = attend_tile(q, k, v, 0, m_i, l_i, acc, scale_log2e, False, DOT_PRECISION,
                                    softcap, SOFTCAP)
    if USE_WINDOW:
        # `free` is a tile boundary: past full_prefix, the masked loop above took the last tile.
        tail = (full_prefix < prefix) & (free <= full_prefix)
    else:
        tail = full_prefix < prefix
    if tail:
        tok = full_prefix + offs_n
        valid = tok < prefix
        rows = kv_row_offsets(block_table_row, tok, valid, head_offset, stride_cb, stride_ct,
                              BLOCK_SIZE)
        k, v = _cache_kv_tile(k_cache_ptr, v_cache_ptr, rows, valid, offs_d, d_mask, HEAD_DIM,
                              BLOCK_D, True)
        m_i, l_i, acc = attend_tile(q, k, v, valid[None, :], m_i, l_i, acc, scale_log2e, True,
                                    DOT_PRECISION, softcap, SOFTCAP)
    return m_i, l_i, acc


@triton.jit
def _attend_chunk(q, m_i, l_i, acc, key, value, q_start, q_len, p_lo, p_hi, kv_head, scale_log2e,
                  stride_kt, stride_kh, stride_vt, stride_vh, offs_m, offs_n, offs_d, d_mask,
                  window, softcap, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_TMA: tl.constexpr,
                  USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """The chunk's own keys from `key` / `value` (descriptors when KV_TMA). The tile's rows are
    at chunk positions `offs_m`, within p_lo..p_hi-1."""
    # Chunk keys j <= p_lo (relative to the chunk) are visible to every row of this tile.
    full_end = ((p_lo + 1) // BLOCK_N) * BLOCK_N
    free = 0
    if USE_WINDOW:
        # As in _attend_through_cache, in the chunk's positions (the tiles read lie in the chunk).
        lo, start, free = window_bounds(p_lo, p_hi - 1, window, BLOCK_N)
        free = tl.minimum(free, full_end)
        for j0 in range(start, free, BLOCK_N):
            k, v = _chunk_kv_tile(key, value, q_start + j0, offs_n, offs_n >= 0, kv_head, stride_kt,
                                  stride_kh, stride_vt, stride_vh, offs_d, d_mask, HEAD_DIM, BLOCK_D,
                                  False, KV_TMA)
            seen = (j0 + offs_n)[None, :] > offs_m[:, None] - window
            m_i, l_i, acc = attend_tile(q, k, v, seen, m_i, l_i, acc, scale_log2e, True,
                                        DOT_PRECISION, softcap, SOFTCAP, True)
    for j0 in range(free, full_end, BLOCK_N):
        k, v = _chunk_kv_tile(key, value, q_start + j0, offs_n, offs_n >= 0, kv_head, stride_kt,
                              stride_kh, stride_vt, stride_vh, offs_d, d_mask, HEAD_DIM, BLOCK_D,
                              False, KV_TMA)
        m_i, l_i, acc = attend_tile(q, k, v, 0, m_i, l_i, acc, scale_log2e, False, DOT_PRECISION,
                                    softcap, SOFTCAP)

    # Diagonal tiles: causal within the chunk; the first holds key p_lo (or key 0 when the tile
    # is the chunk's first), which every row sees.
    for j0 in range(full_end, p_hi, BLOCK_N):
        j = j0 + offs_n
        valid = j < q_len
        k, v = _chunk_kv_tile(key, value, q_start + j0, offs_n, valid, kv_head, stride_kt,
                              stride_kh, stride_vt, stride_vh, offs_d, d_mask, HEAD_DIM, BLOCK_D,
                              True, KV_TMA)
        causal = (j[None, :] <= offs_m[:, None]) & valid[None, :]
        if USE_WINDOW:
            causal = causal & (j[None, :] > offs_m[:, None] - window)
        m_i, l_i, acc = attend_tile(q, k, v, causal, m_i, l_i, acc, scale_log2e, True,
                                    DOT_PRECISION, softcap, SOFTCAP, USE_WINDOW)
    return m_i, l_i, acc


# The block table's width changes from step to step (see decode_attention._decode_kernel).
