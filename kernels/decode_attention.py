"""Paged decode attention: one new query token per sequence against its whole KV history.

Decode reads every cached key and value once and does little arithmetic per byte, so the design
goal is to keep HBM busy:
  * one program serves all G query heads of one KV head (GQA), so K/V are read once per KV head,
    not once per query head; the G rows are padded to 16 so q @ k^T and p @ v are tensor-core dots;
  * the sequence is split across programs (flash-decoding) when batch x KV heads alone would
    leave SMs idle; each split writes a partial (normalised output, log-sum-exp) and a second,
    small kernel merges them. With one split the first kernel writes the output directly;
  * an FP8 cache (half the bytes) is widened to float16 after the load (a bf16 query is
    converted once; every e4m3 value is exact in float16) and both dots run in float16; k_scale
    is folded into the softmax scale and v_scale into the output. Its values are transposed
    within each block, so p @ v reads its operand along the token axis with wide loads
    (_attention_tile.transposed_v_tile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import validation
from ._attention_tile import (attend_tile, cache_launch_args, kv_row_offsets, transposed_v_tile,
                              window_softcap_args)
from ._launch import cdiv, check_runnable, dot_block, next_pow2, num_sms

OP = "paged_decode_attention"
MAX_SPLITS = 256           # partials of one head: [batch, Hq, MAX_SPLITS, D] float32 at most
MERGE_BLOCK_S = 64         # splits the merge kernel combines per iteration
DEFAULT_MAX_SPLITS = 64    # the split choice's own bound (num_splits may ask for more)
MIN_TOKENS_PER_SPLIT = 256  # below this the partial write + merge costs more than it saves
MAX_TOKENS_PER_SPLIT = 4096  # one very long sequence in a full batch must not become the tail


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters; `num_splits=None` lets `choose_num_splits` decide per call."""
    block_n: int = 64            # tokens per K/V tile (several cache blocks when block_size < 64)
    num_warps: int = 4
    num_stages: int = 3
    num_splits: int | None = None
    programs_per_sm: int = 2     # split until batch * Hkv * splits reaches this many per SM
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT  # ...but no split shorter than this
    max_splits: int = DEFAULT_MAX_SPLITS  # ...and no more splits than this
    # With an FP8 cache and bf16 queries: "float16" widens the tiles to float16 and runs both
    # dots in float16 (every e4m3 value is exact there; one conversion instruction per pair),
    # "query" widens them to the query's dtype.
    fp8_compute: str = "float16"


def default_config(dtype: torch.dtype, batch: int, num_kv_heads: int, sms: int,
                   fp8_cache: bool = False) -> DecodeConfig:
    """The fastest configs of the attention sweep at the engine's shapes
    (benchmarks/kernels/sweep_attention.py; figures in docs/kernels.md). Full batches: 64-token tiles,
    4 warps, 3 stages; an FP8 cache's half-size tiles want 2 warps.

    When batch x KV heads leaves SMs idle, the sequences are cut into as many splits as there
    are tiles, up to max_splits: single-tile splits, because the engine's decode graphs size
    the splits for their context bucket, and with longer splits a short sequence would walk
    few of them while the rest return at once. float32 (tests) keeps 2 stages of 64-token
    tiles, which fit in shared memory."""
    if dtype == torch.float32:
        return DecodeConfig(num_stages=2)
    if batch * num_kv_heads < sms:
        if fp8_cache:
            return DecodeConfig(block_n=64, num_warps=2, num_stages=2, programs_per_sm=64,
                                min_tokens_per_split=64)
        return DecodeConfig(block_n=128, num_warps=4, num_stages=2, programs_per_sm=64,
                            min_tokens_per_split=128)
    if fp8_cache:
        return DecodeConfig(block_n=64, num_warps=2, num_stages=2)
    return DecodeConfig()


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, sms: int,
                      programs_per_sm: int = 2,
                      min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT,
                      max_splits: int = DEFAULT_MAX_SPLITS) -> int:
    """Splits per sequence so that batch * Hkv * splits fills the GPU, without splits so short
    that the merge dominates. Uses only host-side sizes, so choosing needs no device sync."""
    programs = max(batch * num_kv_heads, 1)
    splits = cdiv(programs_per_sm * sms, programs)
    splits = max(splits, cdiv(max_context_len, MAX_TOKENS_PER_SPLIT))
    splits = min(splits, max(1, max_context_len // min_tokens_per_split), max_splits, MAX_SPLITS)
    return max(splits, 1)


def tokens_per_split(max_context_len: int, num_splits: int, block_n: int) -> int:
    # A multiple of block_n so every split but the last walks whole tiles.
    return max(block_n, cdiv(cdiv(max_context_len, num_splits), block_n) * block_n)


# The block table's width changes from step to step: specialising on it (1, divisible by 16)
# would compile new variants mid-serving (backend/worker/compile_watch.py).
@triton.jit(do_not_specialize=["stride_btb"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2e, v_scale, tokens_per_split, window, softcap,
    stride_qb, stride_qh, stride_cb, stride_ct, stride_ch, stride_btb, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SCALE_V: tl.constexpr, FP16_DOTS: tl.constexpr,
    V_TRANSPOSED: tl.constexpr, V_RUN: tl.constexpr, USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # KV heads on the fastest axis: a token's heads are adjacent 256-byte rows in the cache, so
    # the programs that read them run together and share DRAM pages.
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    if USE_WINDOW:
        # The query at ctx - 1 sees keys k > ctx - 1 - window (window_bounds). The splits share
        # out only the tiles from lo's on, so the keys before the window are never read.
        lo = tl.maximum(ctx - window, 0)
        start = _window_start(ctx, window, BLOCK_N) + split * tokens_per_split
    else:
        start = split * tokens_per_split
    # The last split runs to ctx even if max_context_len understated it: no token is dropped.
    end = tl.where(split == tl.num_programs(2) - 1, ctx, tl.minimum(start + tokens_per_split, ctx))
    if SPLIT:
        if start >= ctx:
            return  # the merge kernel reads only the splits that hold tokens

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if FP16_DOTS:
        q = q.to(tl.float16)  # the K/V tiles follow q's dtype below

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_btb
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        valid = tok < end
        if USE_WINDOW:
            valid = valid & (tok >= lo)
        rows = kv_row_offsets(block_table_row, tok, valid, kv_head * stride_ch, stride_cb, stride_ct,
                              BLOCK_SIZE)
        if BLOCK_D == HEAD_DIM:
            kv_mask = valid[:, None]  # no column mask: keeps 16-byte vector loads along D
        else:
            kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if V_TRANSPOSED:
            if USE_WINDOW:
                v = transposed_v_tile(v_cache_ptr, block_table_row, n0, end, offs_d, d_mask,
                                      kv_head * (HEAD_DIM * BLOCK_SIZE), stride_cb, BLOCK_SIZE,
                                      BLOCK_N, BLOCK_D, V_RUN, lo, True)
            else:
                v = transposed_v_tile(v_cache_ptr, block_table_row, n0, end, offs_d, d_mask,
                                      kv_head * (HEAD_DIM * BLOCK_SIZE), stride_cb, BLOCK_SIZE,
                                      BLOCK_N, BLOCK_D, V_RUN)
        else:
            v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        # Every row (one position) sees a key of the first tile: no EMPTY_ROWS even windowed.
        m_i, l_i, acc = attend_tile(q, k.to(q.dtype), v.to(q.dtype), valid[None, :], m_i, l_i, acc,
                                    scale_log2e, True, DOT_PRECISION, softcap, SOFTCAP)

    num_q_heads = tl.num_programs(0) * GROUP
    if SPLIT:
        part = (seq * num_q_heads + q_heads).to(tl.int64) * tl.num_programs(2) + split
        o = acc / l_i[:, None]
        if SCALE_V:
            o = o * v_scale
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=g_mask[:, None] & d_mask[None, :])
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=g_mask)
    else:
        # ctx == 0 (a padded batch slot) leaves l_i == 0: write zeros rather than NaN.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        if SCALE_V:
            o = o * v_scale
        tl.store(out_ptr + seq.to(tl.int64) * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _window_start(ctx, window, BLOCK_N: tl.constexpr):
    """The first token a sliding window's splits cover: the tile of its first visible key."""
    return (tl.maximum(ctx - window, 0) // BLOCK_N) * BLOCK_N


# One variant for every split count: the count changes with the batch and context.
@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    part_out_ptr, part_lse_ptr, context_lens_ptr, out_ptr,
    tokens_per_split, num_splits, stride_ob, stride_oh, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    USE_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Partials are combined BLOCK_S splits at a time with a running maximum, so the split count
    # is not bounded by what one program holds in registers.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + seq)
    covered = ctx
    if USE_WINDOW:
        covered = ctx - _window_start(ctx, window, BLOCK_N)  # the tokens the splits share out
    used = tl.minimum((covered + tokens_per_split - 1) // tokens_per_split, num_splits)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    base = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits
    m = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, used, BLOCK_S):
        s_mask = s0 + offs_s < used
        part = base + s0 + offs_s
        lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))  # finite: every used split holds tokens
        alpha = tl.exp2(m - m_new)
        weight = tl.where(s_mask, tl.exp2(lse - m_new), 0.0)
        o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        total = total * alpha + tl.sum(weight, 0)
        acc = acc * alpha + tl.sum(o * weight[:, None], 0)
        m = m_new
    merged = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d,
             merged.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, *, max_context_len: int | None = None,
                           config: DecodeConfig | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0, sliding_window: int | None = None,
                           logit_softcap: float | None = None) -> torch.Tensor:
    """See docs/architecture.md. `max_context_len` (optional) bounds context_lens for the split
    choice; by default the block-table width bounds it, which needs no device sync. The scales
    multiply an FP8 cache's values back (a 16-bit cache has 1.0). `sliding_window` W: the query
    at position p sees keys p - W < k <= p, and only those are read (the splits share out the
    window, so a long context with a small window reads about W keys); `logit_softcap` C caps
    the scores at C * tanh(score / C) (validation.check_window_softcap)."""
    validation.check_decode(OP, query, k_cache, v_cache, block_tables, context_lens, out,
                            validation.HALF_AND_FLOAT)
    validation.check_kv_scales(OP, k_scale, v_scale)
    window, softcap, option_constexprs = window_softcap_args(
        *validation.check_window_softcap(OP, sliding_window, logit_softcap))
    check_runnable(OP, query)
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    cfg = config or default_config(query.dtype, batch, num_kv_heads, num_sms(query.device),
                                   k_cache.dtype == validation.FP8_KV_DTYPE)
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    max_context_len = max(int(max_context_len), 1)
    if window:
        # The splits cover the window's tiles: lo's tile on, at most window + block_n - 1 tokens.
        max_context_len = min(max_context_len, window + cfg.block_n - 1)
    splits = cfg.num_splits or choose_num_splits(batch, num_kv_heads, max_context_len,
                                                 num_sms(query.device), cfg.programs_per_sm,
                                                 cfg.min_tokens_per_split, cfg.max_splits)
    per_split = tokens_per_split(max_context_len, splits, cfg.block_n)
    splits = cdiv(max_context_len, per_split)
    if splits > MAX_SPLITS:
        validation.fail(OP, f"num_splits must be at most {MAX_SPLITS}, got {splits}")
    scale_log2e, v_scale, cache_constexprs = cache_launch_args(
        OP, query.dtype, k_cache, scale, k_scale, v_scale, cfg.fp8_compute, cfg.block_n)
    if splits > 1:
        part_out = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused when SPLIT is False
    _decode_kernel[(num_kv_heads, batch, splits)](
        query, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        scale_log2e, v_scale, per_split, window, softcap,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=dot_block(group), HEAD_DIM=head_dim, BLOCK_D=dot_block(head_dim),
        BLOCK_SIZE=block_size, BLOCK_N=cfg.block_n, SPLIT=splits > 1,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", **cache_constexprs,
        **option_constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _merge_kernel[(batch, num_heads)](
            part_out, part_lse, context_lens, out, per_split, splits, out.stride(0), out.stride(1),
            window, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), BLOCK_S=MERGE_BLOCK_S,
            # BLOCK_N only places a window's first split: without one, every tile size shares a variant.
            USE_WINDOW=bool(window), BLOCK_N=cfg.block_n if window else 0, num_warps=4,
        )
    return out
