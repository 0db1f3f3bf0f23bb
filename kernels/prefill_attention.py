"""Paged prefill attention: causal attention of a chunk of new query tokens against the cached
prefix plus the chunk itself, all read through the block table (the chunk's K/V were stored first).

Flash-attention style: a program owns BLOCK_M queries of one head of one sequence and walks the
keys in tiles of BLOCK_N, keeping a running max and sum (online softmax) so scores never reach
memory. Key tiles entirely below the tile's first query position need no causal mask and run in a
mask-free loop; tiles past the last query position are never visited. An FP8 cache is widened to
float16 after the load, as in decode attention (values transposed per block, k_scale folded into
the softmax scale, v_scale into the output).

With a 16-bit cache the caller may also pass the chunk's own keys and values (`key`, `value`: the
tensors just stored, [T, Hkv, D]). Then only the cached prefix is read through the block table;
the chunk's keys, usually all of them, are read by row from those tensors: no block-table
lookups and no per-token address arithmetic, and with `kv_tma` through the tensor memory
accelerator (TMA) as [BLOCK_N, D] boxes. The values are the same, so the result is too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import validation
from ._attention_tile import cache_launch_args, window_softcap_args
from ._launch import cdiv, check_runnable, dot_block
from ._prefill_tiles import _attend_chunk, _attend_prefix, _attend_through_cache

OP = "paged_prefill_attention"
# Chunks up to this many tokens pack GQA heads (PrefillConfig.pack_gqa): speculative decoding
# verifies k + 1 positions per sequence, k = num_speculative_tokens <= 16.
PACK_GQA_MAX_LEN = 17


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    fp8_compute: str = "float16"  # as DecodeConfig.fp8_compute
    kv_tma: bool = False          # chunk keys/values (when passed) through TMA descriptors
    # A program owns one KV head and packs its GROUP query heads into the tile's rows (row r:
    # position r // GROUP, head r % GROUP), so each key and value is read once per KV head, not
    # once per query head. For short chunks (speculative decoding's verification: k + 1 rows).
    pack_gqa: bool = False
    # Pipeline depth of the loop over the cached prefix (0: num_stages). Its keys come through the
    # block table, a load that feeds the address of the next, so it may want more stages in
    # flight than the chunk's TMA loads.
    prefix_stages: int = 0
    # Walk the prefix and the chunk in two launches, the second resuming from the first's running
    # max, sum and accumulator (float32, [T, heads, D]), instead of both loops in one program:
    # compiled together the prefix loop ran far slower than on its own. Only with the chunk's
    # keys passed and GQA heads not packed.
    split_prefix: bool = False


def default_config(dtype: torch.dtype, head_dim: int, max_seqlen_q: int,
                   chunk_tma: bool = False, group: int = 1) -> PrefillConfig:
    """The fastest configs of the attention sweep at the engine's shapes
    (benchmarks/kernels/sweep_attention.py --chunk-kv cache,direct,tma; figures in docs/kernels.md and
    docs/performance_notes.md). 16-bit inputs: 64x64 tiles, 4 warps, 2 stages for packed
    512-token prompts, the chunk read through TMA. Longer chunks take 128-query tiles (4 warps,
    2 stages) through TMA; plain loads of the chunk lost to the cache path at 512 tokens, and
    128-query tiles lose to 64 when read through the cache. float32 tiles are smaller
    so they fit in shared memory and registers (float32 is for tests, not serving). Short
    chunks get short M tiles. `kv_tma` applies only where the caller passes the chunk and the
    boxes fit (`_tma_ready`). Chunks of at most PACK_GQA_MAX_LEN tokens pack the query heads
    that share a KV head into one tile (`pack_gqa`): verification steps of speculative
    decoding read each sequence's keys and values once per KV head, as decode attention does."""
    pack = group > 1 and max_seqlen_q <= PACK_GQA_MAX_LEN
    block_m = min(64, dot_block(max_seqlen_q * (group if pack else 1)))
    block_n = 32 if dtype == torch.float32 or head_dim > 128 else 64
    if pack or block_n == 32:
        return PrefillConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2, kv_tma=True,
                             pack_gqa=pack)
    if chunk_tma and max_seqlen_q > 1024:
        return PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=2, kv_tma=True,
                             split_prefix=True)
    return PrefillConfig(block_m=block_m, block_n=64, num_warps=4, num_stages=2, kv_tma=True)


@triton.jit(do_not_specialize=["stride_btb"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, out_ptr,
    key, value, state_acc_ptr, state_ml_ptr, scale_log2e, v_scale, window, softcap,
    stride_qt, stride_qh, stride_cb, stride_ct, stride_ch, stride_btb, stride_ot, stride_oh,
    stride_kt, stride_kh, stride_vt, stride_vh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SCALE_V: tl.constexpr, FP16_DOTS: tl.constexpr, V_TRANSPOSED: tl.constexpr,
    V_RUN: tl.constexpr, KV_DIRECT: tl.constexpr, KV_TMA: tl.constexpr, PACK_GQA: tl.constexpr,
    PREFIX_STAGES: tl.constexpr, PREFIX_PART: tl.constexpr, USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # Fastest axis: a query head (heads sharing a KV head run together and share L2); with
    # PACK_GQA a KV head, whose GROUP query heads are the tile's rows.
    head = tl.program_id(0)
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)  # causal: heaviest tiles start first
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    num_rows = q_len * GROUP if PACK_GQA else q_len
    m0 = m_block * BLOCK_M
    if m0 >= num_rows:
        return
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - q_len

    offs_r = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_r < num_rows
    d_mask = offs_d < HEAD_DIM
    if PACK_GQA:
        offs_m = offs_r // GROUP  # each row's position in the chunk
        kv_head = head
        q_head_offs = ((head * GROUP + offs_r % GROUP) * stride_qh)[:, None]
        o_head_offs = ((head * GROUP + offs_r % GROUP) * stride_oh)[:, None]
        p_lo = m0 // GROUP
        p_hi = tl.minimum((m0 + BLOCK_M - 1) // GROUP + 1, q_len)
    else:
        offs_m = offs_r
        kv_head = head // GROUP
        q_head_offs = head * stride_qh
        o_head_offs = head * stride_oh
        p_lo = m0
        p_hi = tl.minimum(m0 + BLOCK_M, q_len)
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + q_head_offs + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if FP16_DOTS:
        q = q.to(tl.float16)  # the K/V tiles follow q's dtype below
    q_pos = prefix + offs_m  # absolute position of each query row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_btb
    head_offset = kv_head * stride_ch
    v_head_offset = kv_head * (HEAD_DIM * BLOCK_SIZE)  # transposed (FP8) V only

    if KV_DIRECT:
        # PREFIX_PART 0: prefix and chunk in one program. 1 and 2 split them over two launches
        # (see PrefillConfig.split_prefix): 1 walks the prefix and leaves its running state,
        # 2 resumes from it over the chunk.
        # The split never packs GQA heads: one state row per query token and head, [T, heads].
        state_row = q_rows * tl.num_programs(0) + head
        if PREFIX_PART != 2:
            m_i, l_i, acc = _attend_prefix(
                q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_row, head_offset,
                prefix, p_lo, p_hi, scale_log2e, stride_cb, stride_ct, offs_n, offs_d, d_mask,
                window, softcap, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
                PREFIX_STAGES, USE_WINDOW, SOFTCAP)
        if PREFIX_PART == 2:
            if prefix > 0:
                m_i = tl.load(state_ml_ptr + state_row * 2, mask=m_mask, other=float("-inf"))
                l_i = tl.load(state_ml_ptr + state_row * 2 + 1, mask=m_mask, other=0.0)
                acc = tl.load(state_acc_ptr + state_row[:, None] * BLOCK_D + offs_d[None, :],
                              mask=m_mask[:, None], other=0.0)
        if PREFIX_PART == 1:
            if prefix > 0:
                tl.store(state_ml_ptr + state_row * 2, m_i, mask=m_mask)
                tl.store(state_ml_ptr + state_row * 2 + 1, l_i, mask=m_mask)
                tl.store(state_acc_ptr + state_row[:, None] * BLOCK_D + offs_d[None, :], acc,
                         mask=m_mask[:, None])
        else:
            m_i, l_i, acc = _attend_chunk(
                q, m_i, l_i, acc, key, value, q_start, q_len, p_lo, p_hi, kv_head, scale_log2e,
                stride_kt, stride_kh, stride_vt, stride_vh, offs_m, offs_n, offs_d, d_mask,
                window, softcap, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, KV_TMA, USE_WINDOW,
                SOFTCAP)
    else:
        m_i, l_i, acc = _attend_through_cache(
            q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_row, head_offset,
            v_head_offset, prefix, p_lo, p_hi, scale_log2e, stride_cb, stride_ct, offs_n, offs_d,
            d_mask, window, softcap, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
            V_TRANSPOSED, V_RUN, USE_WINDOW, SOFTCAP)

    if PREFIX_PART != 1:
        if USE_WINDOW:
            l_i = tl.where(l_i > 0.0, l_i, 1.0)  # a padding row past the chunk may see no key
        o = acc / l_i[:, None]
        if SCALE_V:
            o = o * v_scale
        tl.store(out_ptr + q_rows[:, None] * stride_ot + o_head_offs + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, max_seqlen_q: int, scale: float,
                            out: torch.Tensor | None = None, *,
                            config: PrefillConfig | None = None, k_scale: float = 1.0,
                            v_scale: float = 1.0, key: torch.Tensor | None = None,
                            value: torch.Tensor | None = None, sliding_window: int | None = None,
                            logit_softcap: float | None = None) -> torch.Tensor:
    """See docs/architecture.md. max_seqlen_q must bound every chunk (it sizes the grid). The
    scales multiply an FP8 cache's values back (a 16-bit cache has 1.0). `key` / `value`, the
    chunk's keys and values as stored ([T, Hkv, D], rows as query's), let a 16-bit cache's
    chunk be read from them; an FP8 cache reads them from the cache, as decode will.
    `sliding_window` W: the query at position p sees keys p - W < k <= p, and a tile of queries
    reads no key tile before its first query's window; `logit_softcap` C caps the scores at
    C * tanh(score / C) (validation.check_window_softcap)."""
    validation.check_prefill(OP, query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                             max_seqlen_q, out, validation.HALF_AND_FLOAT)
    validation.check_kv_scales(OP, k_scale, v_scale)
    window, softcap, option_constexprs = window_softcap_args(
        *validation.check_window_softcap(OP, sliding_window, logit_softcap))
    validation.check_chunk_kv(OP, key, value, query, k_cache)
    check_runnable(OP, query)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    batch = block_tables.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or batch == 0 or max_seqlen_q == 0:
        return out
    direct = key is not None and k_cache.dtype != validation.FP8_KV_DTYPE
    if not direct:
        key = value = query  # unused (KV_DIRECT is off); any pointer will do
    tma_ready = direct and _tma_ready(key, value, dot_block(head_dim))
    group = num_heads // num_kv_heads
    cfg = config or default_config(query.dtype, head_dim, max_seqlen_q, tma_ready, group)
    pack = cfg.pack_gqa and group > 1
    tma = tma_ready and cfg.kv_tma
    scale_log2e, v_scale, cache_constexprs = cache_launch_args(
        OP, query.dtype, k_cache, scale, k_scale, v_scale, cfg.fp8_compute, cfg.block_n)
    key_arg, value_arg = (_row_descriptor(key, cfg.block_n), _row_descriptor(value, cfg.block_n)) \
        if tma else (key, value)
    grid = (num_kv_heads, cdiv(max_seqlen_q * group, cfg.block_m), batch) if pack else \
        (num_heads, cdiv(max_seqlen_q, cfg.block_m), batch)
    split = cfg.split_prefix and direct and not pack
    state_acc = state_ml = out  # unused unless split
    if split:
        state_acc = torch.empty(num_tokens, num_heads, dot_block(head_dim), device=query.device,
                                dtype=torch.float32)
        state_ml = torch.empty(num_tokens, num_heads, 2, device=query.device, dtype=torch.float32)
    for part in (1, 2) if split else (0,):
        _prefill_kernel[grid](
            query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
            key_arg, value_arg, state_acc, state_ml, scale_log2e, v_scale, window, softcap,
            query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            KV_DIRECT=direct, KV_TMA=tma, PACK_GQA=pack, PREFIX_PART=part,
            PREFIX_STAGES=cfg.prefix_stages or cfg.num_stages,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=dot_block(head_dim),
            BLOCK_SIZE=block_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", **cache_constexprs,
            **option_constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out


def _tma_ready(key: torch.Tensor, value: torch.Tensor, block_d: int) -> bool:
    """TMA boxes need each head's D columns whole (no padding to BLOCK_D), the heads of a row
    adjacent, and 16-byte aligned rows; otherwise the chunk is read with plain loads."""
    for t in (key, value):
        _, _, d = t.shape
        if d != block_d or t.stride(1) != d or t.stride(2) != 1:
            return False
        if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
    return True


def _row_descriptor(t: torch.Tensor, block_n: int) -> TensorDescriptor:
    """[T, Hkv, D] as a 2-D [T, Hkv * D] descriptor with [block_n, D] boxes (one head's rows)."""
    rows = t.flatten(1)
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [block_n, t.shape[2]])
