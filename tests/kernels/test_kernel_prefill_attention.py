"""paged_prefill_attention against a float64 oracle: chunks with and without a cached prefix,
one-token chunks, shuffled physical blocks, GQA 1/4/7, block sizes 16/32, head dims 64/128, key
tiles smaller and larger than a cache block."""

import itertools
import re

import pytest
import torch
from kernel_checks import (DEVICE, DTYPES, attention_oracle, assert_accurate, make_paged_kv, poisoned,
                           rel_err)

from tritium import kernels
from tritium.kernels import reference

# (q_lens, context_lens, Hkv, group, head_dim, block_size, PrefillConfig fields or None)
CASES = [
    ([5, 40, 1, 17], [5, 70, 33, 17], 2, 1, 64, 16, None),   # pure prefill, chunk+prefix, 1-token
    ([23, 9], [23, 75], 1, 4, 128, 32, (16, 16, 4, 2)),      # key tile smaller than a block
    ([50, 3], [81, 3], 1, 7, 64, 16, (32, 64, 4, 2)),        # key tile spans 4 blocks
    ([64, 20], [100, 20], 2, 4, 128, 16, None),              # default tiles for the dtype
    # GQA heads packed into the tile's rows (row r: position r // group, head r % group)
    ([5, 5, 1, 3], [70, 5, 33, 40], 2, 4, 64, 16, (16, 16, 4, 2, "float16", False, True)),  # 20 rows: 2 tiles
    ([5, 2], [40, 2], 1, 7, 64, 16, (32, 64, 4, 2, "float16", False, True)),  # a position split over tiles
    ([40, 9], [90, 9], 2, 7, 128, 32, (32, 32, 4, 2, "float16", False, True)),  # long chunk, diagonal tiles
    ([5, 17, 1], [60, 17, 20], 2, 4, 64, 16, None),  # default: chunks of <= 17 pack (16 + 1 rows)
]


def _config(fields):
    if fields is None:
        return None
    from tritium.kernels.prefill_attention import PrefillConfig  # imports triton: only inside tests
    return PrefillConfig(*fields)


def _prefill_inputs(q_lens, ctx, hkv, group, head_dim, block_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(ctx, hkv, head_dim, block_size, dtype, gen)
    query = torch.randn(sum(q_lens), hkv * group, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return kv, query, cu


def _oracle(kv, query, q_lens, ctx, scale, dtype):
    rows, start = [], 0
    for b, (n, total) in enumerate(zip(q_lens, ctx)):
        positions = torch.arange(total - n, total)
        rows.append(attention_oracle(query[start:start + n], kv.keys[b], kv.values[b], positions, scale, dtype))
        start += n
    return torch.cat(rows)


def _run(kv, query, cu, q_lens, ctx, scale, out=None, config=None):
    return kernels.paged_prefill_attention.triton(
        query.to(DEVICE), kv.k_cache, kv.v_cache, kv.block_tables, cu.to(DEVICE),
        torch.tensor(ctx, dtype=torch.int32, device=DEVICE), max(q_lens), scale, out=out, config=config)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_prefill_matches_float64(case, dtype):
    q_lens, ctx, hkv, group, head_dim, block_size, fields = CASES[case]
    kv, query, cu = _prefill_inputs(q_lens, ctx, hkv, group, head_dim, block_size, dtype, seed=case)
    scale = head_dim ** -0.5
    out = poisoned(query.shape, dtype)
    _run(kv, query, cu, q_lens, ctx, scale, out=out, config=_config(fields))
    ref64 = _oracle(kv, query, q_lens, ctx, scale, torch.float64)
    assert_accurate(out, ref64, _oracle(kv, query, q_lens, ctx, scale, dtype))


@pytest.mark.parametrize("fn", ["kernel", "reference"])
def test_prefill_leaves_padding_rows_and_empty_sequences_alone(fn):
    """A CUDA graph runs a fixed token count over a fixed number of sequences: the unused
    sequences have no tokens (and context 0) and the rows past cu_seqlens_q[-1] are padding.
    Real rows must match the oracle; padding rows must keep what was in `out`."""
    q_lens, ctx = [7, 0, 12, 0], [7, 0, 30, 0]
    padding = 5
    kv, query, cu = _prefill_inputs([7, 12], [7, 30], 1, 4, 64, 16, torch.float32, seed=3)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)  # 0, 7, 7, 19, 19
    tables = torch.cat([kv.block_tables[:1], kv.block_tables[:1], kv.block_tables[1:], kv.block_tables[1:]])
    query = torch.cat([query, torch.randn(padding, 4, 64)])
    out = poisoned(query.shape, torch.float32)
    out[19:] = 7.0
    if fn == "kernel":
        k_cache, v_cache, device = kv.k_cache, kv.v_cache, DEVICE
        call = kernels.paged_prefill_attention
    else:
        k_cache, v_cache, device = kv.k_cache.cpu(), kv.v_cache.cpu(), "cpu"
        out, call = out.cpu(), reference.paged_prefill_attention_ref
    call(query.to(device), k_cache, v_cache, tables.to(device), cu.to(device),
         torch.tensor(ctx, dtype=torch.int32, device=device), 24, 0.125, out=out)
    ref64 = _oracle(kv, query[:19], [7, 12], [7, 30], 0.125, torch.float64)
    assert rel_err(out[:19], ref64) < 1e-4
    assert bool((out[19:] == 7.0).all())


def test_prefill_reference_rejects_falling_cu_seqlens():
    kv, query, _ = _prefill_inputs([2, 3], [4, 3], 1, 1, 16, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match=re.escape(
            "paged_prefill_attention: cu_seqlens_q must rise from 0 to at most T = 5, got [0, 3, 2]") + "$"):
        reference.paged_prefill_attention_ref(query, kv.k_cache.cpu(), kv.v_cache.cpu(),
                                              kv.block_tables.cpu(), torch.tensor([0, 3, 2], dtype=torch.int32),
                                              torch.tensor([4, 3], dtype=torch.int32), 3, 0.25)


def _chunk_views(q_lens, ctx, hkv, group, head_dim, kv, dtype):
    """The chunks' keys and values as the engine passes them: strided views into one fused
    [T, (Hq + 2 Hkv) * D] projection output."""
    hq, t = hkv * group, sum(q_lens)
    qkv = poisoned((t, (hq + 2 * hkv) * head_dim), dtype)
    key = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(t, hkv, head_dim)
    value = qkv[:, (hq + hkv) * head_dim:].view(t, hkv, head_dim)
    start = 0
    for b, (n, total) in enumerate(zip(q_lens, ctx)):
        key[start:start + n] = kv.keys[b][total - n:].to(DEVICE)
        value[start:start + n] = kv.values[b][total - n:].to(DEVICE)
        start += n
    return key, value


def _poison_chunk_slots(kv, q_lens, ctx, block_size):
    """NaN in the cache where the chunks' keys and values were stored: only the prefix is real."""
    for cache in (kv.k_cache, kv.v_cache):
        flat = cache.view(-1, cache.shape[2], cache.shape[3])
        for b, (n, total) in enumerate(zip(q_lens, ctx)):
            pos = torch.arange(total - n, total)
            slots = kv.block_tables[b].cpu().long()[pos // block_size] * block_size + pos % block_size
            flat[slots.to(DEVICE)] = float("nan")


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("fields", [None, (16, 32, 4, 2), (32, 16, 4, 2), (32, 16, 4, 2, "float16", False, True),
                                    (32, 16, 4, 2, "float16", False, False, 3),
                                    (32, 16, 4, 2, "float16", False, False, 0, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_reads_the_chunk_from_key_and_value(dtype, fields, tma):
    """Given the chunk's keys and values, a 16-bit cache is read only for the prefix (prefixes
    of 30 and 49 tokens, none for the others; key tiles that cross the prefix's end), plain or
    through TMA descriptors, with GQA heads packed or not, the prefix walked in the same launch
    or in a launch of its own (split_prefix: sequences without a prefix leave no state).
    Without them the same call reads the poisoned slots: NaN."""
    q_lens, ctx, hkv, group, head_dim, block_size = [40, 5, 23, 1], [70, 5, 23, 50], 2, 4, 64, 16
    kv, query, cu = _prefill_inputs(q_lens, ctx, hkv, group, head_dim, block_size, dtype, seed=11)
    query = query * 3  # peaky scores: a tile read twice or skipped moves the output
    ref64 = _oracle(kv, query, q_lens, ctx, 0.125, torch.float64)
    key, value = _chunk_views(q_lens, ctx, hkv, group, head_dim, kv, dtype)
    _poison_chunk_slots(kv, q_lens, ctx, block_size)
    from tritium.kernels.prefill_attention import PrefillConfig
    fields = fields or (64, 32 if dtype == torch.float32 else 64, 4, 2)
    config = PrefillConfig(**{**PrefillConfig(*fields).__dict__, "kv_tma": tma})
    out = kernels.paged_prefill_attention.triton(
        query.to(DEVICE), kv.k_cache, kv.v_cache, kv.block_tables, cu.to(DEVICE),
        torch.tensor(ctx, dtype=torch.int32, device=DEVICE), max(q_lens), 0.125, config=config,
        key=key, value=value)
    assert_accurate(out, ref64, _oracle(kv, query, q_lens, ctx, 0.125, dtype))
    blind = _run(kv, query, cu, q_lens, ctx, 0.125, config=config)
    assert bool(blind.isnan().any(dim=(1, 2)).all())


def test_chunk_tma_needs_whole_aligned_heads():
    """TMA boxes are taken only where they fit: the engine's qkv views qualify; a head dim
    padded to the tile (80 -> 128) or a row start off 16 bytes falls back to plain loads."""
    from tritium.kernels.prefill_attention import _tma_ready
    qkv = torch.empty(8, 48 * 128, dtype=torch.float16)
    key, value = qkv[:, 4096:5120].view(8, 8, 128), qkv[:, 5120:].view(8, 8, 128)
    assert _tma_ready(key, value, 128)
    odd = torch.empty(8, 8 * 80 + 1, dtype=torch.float16)[:, 1:].view(8, 8, 80)
    assert not _tma_ready(odd, odd, 128)
    shifted = torch.empty(8 * 1024 + 1, dtype=torch.float16)[1:].view(8, 8, 128)
    assert not _tma_ready(shifted, shifted, 128)


def test_prefill_default_config_by_chunk_length_and_path():
    """128-query tiles only for long chunks read through TMA (they lose through the cache)."""
    from tritium.kernels.prefill_attention import PrefillConfig, default_config
    assert default_config(torch.bfloat16, 128, 4096, True) == PrefillConfig(128, 64, 4, 2, kv_tma=True,
                                                                            split_prefix=True)
    assert default_config(torch.bfloat16, 128, 4096, False) == PrefillConfig(64, 64, 4, 2, kv_tma=True)
    assert default_config(torch.bfloat16, 128, 512, True) == PrefillConfig(64, 64, 4, 2, kv_tma=True)
    assert default_config(torch.float16, 128, 20, True) == PrefillConfig(32, 64, 4, 2, kv_tma=True)
    # Verification-length chunks pack GQA heads: 5 positions x 4 heads = 20 rows in a 32-row tile
    assert default_config(torch.bfloat16, 128, 5, True, group=4) == PrefillConfig(
        32, 64, 4, 2, kv_tma=True, pack_gqa=True)
    assert default_config(torch.bfloat16, 128, 17, True, group=4).pack_gqa
    assert not default_config(torch.bfloat16, 128, 18, True, group=4).pack_gqa
    assert not default_config(torch.bfloat16, 128, 5, True, group=1).pack_gqa  # nothing to share
    # float32 (tests) and heads over 128 keep their 32-key tiles when packed
    assert default_config(torch.float32, 128, 5, True, group=4) == PrefillConfig(
        32, 32, 4, 2, kv_tma=True, pack_gqa=True)
    assert default_config(torch.bfloat16, 256, 5, True, group=4).block_n == 32


def test_prefill_long_chunk_uses_unmasked_tiles():
    """A chunk far past its prefix walks whole mask-free key tiles before the diagonal ones;
    peaky scores make a wrong running max visible."""
    q_lens, ctx = [70], [200]
    kv, query, cu = _prefill_inputs(q_lens, ctx, 1, 2, 64, 16, torch.float32, seed=5)
    query = query * 6
    ref64 = _oracle(kv, query, q_lens, ctx, 0.125, torch.float64)
    for fields in [(16, 32, 4, 2), (64, 16, 4, 2)]:
        out = _run(kv, query, cu, q_lens, ctx, 0.125, config=_config(fields))
        assert rel_err(out, ref64) < 1e-4, fields


def test_prefill_reference_matches_oracle_in_float64():
    q_lens, ctx = [5, 40, 1], [5, 70, 33]
    kv, query, cu = _prefill_inputs(q_lens, ctx, 2, 7, 32, 16, torch.float64, seed=9)
    out = reference.paged_prefill_attention_ref(query, kv.k_cache.cpu(), kv.v_cache.cpu(),
                                                kv.block_tables.cpu(), cu,
                                                torch.tensor(ctx, dtype=torch.int32), 40, 0.2)
    assert rel_err(out, _oracle(kv, query, q_lens, ctx, 0.2, torch.float64)) < 1e-12


def test_prefill_reference_rejects_chunk_longer_than_max_seqlen_q():
    q_lens, ctx = [5, 9], [5, 20]
    kv, query, cu = _prefill_inputs(q_lens, ctx, 1, 1, 16, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match=re.escape(
            "paged_prefill_attention: sequence 1 has 9 query tokens, context 20 and max_seqlen_q 8: "
            "need 0 <= q_len <= min(max_seqlen_q, context)") + "$"):
        reference.paged_prefill_attention_ref(query, kv.k_cache.cpu(), kv.v_cache.cpu(),
                                              kv.block_tables.cpu(), cu,
                                              torch.tensor(ctx, dtype=torch.int32), 8, 0.25)


@pytest.mark.parametrize("fn", [kernels.paged_prefill_attention.triton, reference.paged_prefill_attention_ref])
@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:2]),
     "paged_prefill_attention: cu_seqlens_q must have shape [B+1] = (3,), got (2,)"),
    (lambda a: a.update(query=a["query"].half()),
     "paged_prefill_attention: k_cache must have the dtype of query (torch.float16) or "
     "torch.float8_e4m3fn, got torch.float32"),
    (lambda a: a.update(query=a["query"][0]),
     "paged_prefill_attention: query must be 3-D [T, Hq, D], got shape (4, 64)"),
    (lambda a: a.update(max_seqlen_q=5.0),
     "paged_prefill_attention: max_seqlen_q must be a non-negative int, got 5.0"),
    (lambda a: a.update(block_tables=a["block_tables"].long()),
     "paged_prefill_attention: block_tables must have dtype torch.int32, got torch.int64"),
    (lambda a: a.update(key=torch.zeros(5, 2, 64, device=DEVICE)),
     "paged_prefill_attention: key and value must be given together"),
    (lambda a: a.update(key=torch.zeros(4, 2, 64, device=DEVICE), value=torch.zeros(4, 2, 64, device=DEVICE)),
     "paged_prefill_attention: key must have shape [T, Hkv, D] = (5, 2, 64), got (4, 2, 64)"),
    (lambda a: a.update(key=torch.zeros(5, 2, 64, device=DEVICE),
                        value=torch.zeros(5, 2, 64, device=DEVICE, dtype=torch.float16)),
     "paged_prefill_attention: value must have dtype torch.float32, got torch.float16"),
])
def test_prefill_rejects_bad_arguments(fn, change, message):
    kv, query, cu = _prefill_inputs([2, 3], [4, 3], 2, 2, 64, 16, torch.float32, seed=0)
    args = dict(query=query.to(DEVICE), k_cache=kv.k_cache, v_cache=kv.v_cache,
                block_tables=kv.block_tables, cu_seqlens_q=cu.to(DEVICE),
                context_lens=torch.tensor([4, 3], dtype=torch.int32, device=DEVICE), max_seqlen_q=3,
                scale=0.125)
    change(args)
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        fn(**args)
