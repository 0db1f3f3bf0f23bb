"""Both attention kernels at long context against the float64 oracle, with the tolerances of
the other kernel tests (kernel_checks.assert_accurate).

In Triton's interpreter (every machine): decode over 32,768 cached tokens with small heads, one
split, eight, and the defaults for a decode graph's 32k bucket (the merge kernel's split counts
are checked), a float32 needle that one split must carry through the merge, and prefill of the
last chunk of a 32k prompt (chunk from key/value as the engine passes it, or all through the
cache) and of a whole 2,048-token prompt. On a GPU: the benchmark models' head shapes at 32k in
float16 and bfloat16, decode for several split counts, prefill of the last 8,192-token chunk and
of a whole 32k prompt, checked on sampled query rows (every row's scores would not fit).
"""

import dataclasses

import pytest
import torch
from kernel_checks import (DEVICE, ON_GPU, assert_accurate, attention_oracle, make_paged_kv, poisoned,
                           rel_err)
from test_kernel_decode_attention import _decode_inputs, kernels_config
from test_kernel_decode_attention import _oracle as _decode_oracle
from test_kernel_prefill_attention import _chunk_views, _poison_chunk_slots, _prefill_inputs

from tritium import kernels

LONG = 32768
GPU_ONLY = pytest.mark.skipif(not ON_GPU, reason="32k contexts at the models' head sizes need a GPU "
                                                 "(the interpreter tests here use small heads)")
# (Hkv, group, head_dim) of the benchmark's models.
MODEL_HEADS = {"llama-3-8b": (8, 4, 128), "qwen2.5-7b": (4, 7, 128), "qwen2.5-1.5b": (2, 6, 128)}
HALF = [torch.float16, torch.bfloat16]


@pytest.fixture
def merge_splits(monkeypatch):
    """The split counts the decode wrapper hands the merge kernel, one per merged call: proof
    that a call split the sequence and merged the partials."""
    from tritium.kernels import decode_attention

    calls: list[int] = []
    real = decode_attention._merge_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append(int(args[5]))  # (part_out, part_lse, context_lens, out, per_split, splits)
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(decode_attention, "_merge_kernel", Spy())
    return calls


def _on(kv, device):
    """The oracle's inputs on `device`: a GPU computes the 32k ground truth itself."""
    return dataclasses.replace(kv, keys=[k.to(device) for k in kv.keys], values=[v.to(device) for v in kv.values])


def _decode(kv, query, ctx, scale, splits, bound, dtype):
    out = poisoned(query.shape, dtype)
    kernels.paged_decode_attention.triton(query.to(DEVICE), kv.k_cache, kv.v_cache, kv.block_tables,
                                   torch.tensor(ctx, dtype=torch.int32, device=DEVICE), scale, out=out,
                                   max_context_len=bound, config=kernels_config(num_splits=splits) if splits else None)
    return out


# --- interpreter (and GPU): small heads, 32k contexts ------------------------------------------

# (num_splits, max_context_len): a split count asked, or the defaults' choice; the bound the
# engine passes (None: the block table's width; LONG: a decode graph's context bucket).
@pytest.mark.parametrize("splits, bound", [(1, None), (8, None), (256, LONG), (None, LONG)])
def test_decode_at_32k_context(splits, bound, merge_splits):
    """A 32k sequence beside a 5,000-token one (most splits empty) and a single token."""
    ctx = [LONG, 5000, 1]
    kv, query = _decode_inputs(ctx, 1, 4, 64, 16, torch.float16, seed=21)
    out = _decode(kv, query, ctx, 0.125, splits, bound, torch.float16)
    assert_accurate(out, _decode_oracle(kv, query, ctx, 0.125, torch.float64),
                    _decode_oracle(kv, query, ctx, 0.125, torch.float16))
    # Unsplit: no merge. A small batch's defaults cut the 32k bucket into 64 splits of 512; 256
    # splits are merged 64 at a time.
    assert merge_splits == {1: [], 8: [8], 256: [256], None: [64]}[splits]


def test_decode_merge_carries_a_far_needle(merge_splits):
    """One key, near the start of a 32k context (or in the middle), scores far above the rest
    and takes about 40% of the weight: the merge must weigh the split holding it against all
    the others by their log-sum-exps. float32, so the error bound is tight."""
    ctx, head_dim = [LONG, LONG - 3], 64
    kv, query = _decode_inputs(ctx, 1, 4, head_dim, 16, torch.float32, seed=22)
    query[:, 1:] = query[:, :1]  # the group's heads share one query: the needle is everyone's
    scale = head_dim ** -0.5
    for b, pos in enumerate((100, 17000)):
        q = query[b, 0]
        needle = q / q.norm() * (10.5 / (q.norm() * scale))  # its score: 10.5; the others' ~N(0, 1)
        kv.keys[b][pos, 0] = needle
        slot = int(kv.block_tables[b, pos // 16]) * 16 + pos % 16
        kv.k_cache.view(-1, 1, head_dim)[slot, 0] = needle.to(DEVICE)
    ref64 = _decode_oracle(kv, query, ctx, scale, torch.float64)
    for splits in (1, 64):
        out = _decode(kv, query, ctx, scale, splits, None, torch.float32)
        assert rel_err(out, ref64) < 1e-4, splits
    assert merge_splits == [57]  # 64 asked of the table's 32,784 tokens: 57 splits of 576


def _pick_rows(q_lens, per_seq, gen):
    """Per sequence, the chunk rows the oracle checks: the first and last, both sides of the
    query-tile edges, and random ones; all of them when the chunk is short."""
    picks = []
    for n in q_lens:
        if n <= per_seq:
            picks.append(torch.arange(n))
            continue
        edges = [r for e in range(128, n, 1024) for r in (e - 1, e)]
        fixed = torch.tensor([*range(8), *range(n - 8, n), *edges])
        picks.append(torch.unique(torch.cat([fixed, torch.randint(0, n, (per_seq,), generator=gen)])))
    return picks


def _prefill_oracle_rows(kv, query, q_lens, ctx, picks, scale, dtype, device="cpu"):
    """The oracle on the picked rows only (global row ids, result), on `device`."""
    rows, refs, start = [], [], 0
    for b, (n, total) in enumerate(zip(q_lens, ctx)):
        rows.append(start + picks[b])
        refs.append(attention_oracle(query[start + picks[b]].to(device), kv.keys[b].to(device),
                                     kv.values[b].to(device), total - n + picks[b], scale, dtype))
        start += n
    return torch.cat(rows), torch.cat(refs)


def _prefill(kv, query, cu, q_lens, ctx, scale, key=None, value=None):
    return kernels.paged_prefill_attention.triton(
        query.to(DEVICE), kv.k_cache, kv.v_cache, kv.block_tables, cu.to(DEVICE),
        torch.tensor(ctx, dtype=torch.int32, device=DEVICE), max(q_lens), scale, key=key, value=value)


@pytest.mark.parametrize("chunk_from", ["key_value", "cache"])
def test_prefill_last_chunk_of_a_32k_prompt(chunk_from):
    """64 new tokens after 32,704 cached ones, default configs. With the chunk's keys and
    values passed (the engine's path), their cache slots are NaN: only the prefix is read there."""
    q_lens, ctx, hkv, group, head_dim = [64], [LONG], 1, 2, 64
    kv, query, cu = _prefill_inputs(q_lens, ctx, hkv, group, head_dim, 16, torch.float16, seed=23)
    picks = [torch.arange(64)]
    _, ref64 = _prefill_oracle_rows(kv, query, q_lens, ctx, picks, 0.125, torch.float64)
    _, ref16 = _prefill_oracle_rows(kv, query, q_lens, ctx, picks, 0.125, torch.float16)
    key = value = None
    if chunk_from == "key_value":
        key, value = _chunk_views(q_lens, ctx, hkv, group, head_dim, kv, torch.float16)
        _poison_chunk_slots(kv, q_lens, ctx, 16)
    assert_accurate(_prefill(kv, query, cu, q_lens, ctx, 0.125, key, value), ref64, ref16)


def test_prefill_whole_2k_prompt_with_a_neighbour():
    """A whole 2,048-token prompt (32 query tiles, each walking mask-free tiles then the
    diagonal) beside a short chunk with a prefix, checked on picked rows as on the GPU."""
    q_lens, ctx = [2048, 40], [2048, 700]
    kv, query, cu = _prefill_inputs(q_lens, ctx, 1, 2, 32, 16, torch.float16, seed=24)
    picks = _pick_rows(q_lens, 96, torch.Generator().manual_seed(0))
    rows, ref64 = _prefill_oracle_rows(kv, query, q_lens, ctx, picks, 0.2, torch.float64)
    _, ref16 = _prefill_oracle_rows(kv, query, q_lens, ctx, picks, 0.2, torch.float16)
    out = _prefill(kv, query, cu, q_lens, ctx, 0.2)
    assert_accurate(out[rows.to(DEVICE)], ref64, ref16)


# --- GPU: the models' heads at 32k -------------------------------------------------------------

# (num_splits, max_context_len) as above; 33 leaves a short last split.
GPU_DECODE_VARIANTS = [(None, None), (None, LONG), (1, None), (2, None), (8, None), (33, None), (64, None)]


@GPU_ONLY
@pytest.mark.parametrize("ctx", [[LONG - 68], [LONG, LONG - 1, 16640, 1000, 1]], ids=["batch1", "mixed"])
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("model", MODEL_HEADS)
def test_gpu_decode_at_32k_matches_float64(model, dtype, ctx, merge_splits):
    """Workload L's decode step (one sequence near 32k) and a mixed batch, for every split
    variant; the oracle runs on the GPU."""
    hkv, group, head_dim = MODEL_HEADS[model]
    kv, query = _decode_inputs(ctx, hkv, group, head_dim, 16, dtype, seed=len(ctx))
    scale = head_dim ** -0.5
    ref64, ref = (_decode_oracle(_on(kv, DEVICE), query.to(DEVICE), ctx, scale, d) for d in (torch.float64, dtype))
    for splits, bound in GPU_DECODE_VARIANTS:
        merge_splits.clear()
        out = _decode(kv, query, ctx, scale, splits, bound, dtype)
        try:
            assert_accurate(out, ref64, ref)
        except AssertionError as e:
            raise AssertionError(f"num_splits={splits}, max_context_len={bound} "
                                 f"(merged {merge_splits or 'nothing'}): {e}") from None
        assert (splits == 1) == (merge_splits == []), (splits, merge_splits)


@GPU_ONLY
@pytest.mark.parametrize("chunk", ["last_chunk", "whole_prompt"])
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("model", ["llama-3-8b", "qwen2.5-7b"])
def test_gpu_prefill_at_32k_matches_float64(model, dtype, chunk):
    """The last 8,192-token chunk of a 32k prompt (the engine's step budget) beside a 512-token
    chunk at 20,480, or a whole 32k prompt in one chunk; default configs, the chunk read from
    key/value (the engine's path, TMA where it fits) and through the cache."""
    hkv, group, head_dim = MODEL_HEADS[model]
    q_lens, ctx = ([LONG // 4, LONG // 64], [LONG, LONG * 5 // 8]) if chunk == "last_chunk" else ([LONG], [LONG])
    kv, query, cu = _prefill_inputs(q_lens, ctx, hkv, group, head_dim, 16, dtype, seed=len(q_lens))
    picks = _pick_rows(q_lens, 192, torch.Generator().manual_seed(1))
    scale = head_dim ** -0.5
    rows, ref64 = _prefill_oracle_rows(kv, query, q_lens, ctx, picks, scale, torch.float64, DEVICE)
    _, ref = _prefill_oracle_rows(kv, query, q_lens, ctx, picks, scale, dtype, DEVICE)
    key, value = _chunk_views(q_lens, ctx, hkv, group, head_dim, kv, dtype)
    for path, kv_args in (("key_value", (key, value)), ("cache", (None, None))):
        out = _prefill(kv, query, cu, q_lens, ctx, scale, *kv_args)
        try:
            assert_accurate(out[rows.to(DEVICE)], ref64, ref)
        except AssertionError as e:
            raise AssertionError(f"chunk read from {path}: {e}") from None
