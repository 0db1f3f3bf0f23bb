"""Sliding windows and attention-logit soft-capping in both paged attention kernels and their
references, against a float64 oracle written here on contiguous K/V with an explicit mask.

Semantics (Hugging Face's): the query at position p sees the keys k with p - W < k <= p
(masking_utils.sliding_window_overlay, `kv_idx > q_idx - sliding_window`, and'ed with
causal_mask_function, `kv_idx <= q_idx`), and soft-capping turns a score s = (q . k) * scale into
C * tanh(s / C) after the scale and before the mask (gemma2's eager_attention_forward). Windows
of one key, one block (16), a block and one (17) and more than any context; contexts several
windows long. Block-table entries wholly before every query's window point at the all-NaN
block, as a cache that frees them would: a kernel that reads them writes NaN.
"""

import dataclasses
import re

import pytest
import torch
from kernel_checks import DEVICE, DTYPES, PagedKV, assert_accurate, make_paged_kv, poisoned, rel_err

from tritium import kernels
from tritium.kernels import reference

WINDOWS = [1, 16, 17, 1000]
BLOCK_SIZE = 16
SOFTCAP = 2.0  # small against the scores below, so the cap moves every output


def _oracle(q, k, v, q_positions, scale, window, softcap, dtype):
    """q [n, Hq, D] against contiguous k/v [L, Hkv, D] (key i at position i), in `dtype`."""
    group = q.shape[1] // k.shape[1]
    if k.shape[0] == 0:
        return torch.zeros(q.shape, dtype=dtype)
    k = k.to(dtype).repeat_interleave(group, dim=1)
    v = v.to(dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(dtype), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    key, p = torch.arange(k.shape[0])[None, :], q_positions[:, None]
    seen = (key <= p) & (key > p - window) if window is not None else key <= p
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _forget_blocks_before(kv: PagedKV, first_seen: list[int]) -> PagedKV:
    """The block tables with every block that lies wholly before first_seen[b] replaced by
    make_paged_kv's all-NaN block (its tables' last column)."""
    tables = kv.block_tables.clone()
    for b, first in enumerate(first_seen):
        tables[b, :first // BLOCK_SIZE] = tables[b, -1]
    return dataclasses.replace(kv, block_tables=tables)


def _decode_oracle(kv, query, ctx, scale, window, softcap, dtype):
    return torch.cat([_oracle(query[b:b + 1], kv.keys[b], kv.values[b], torch.tensor([n - 1]), scale,
                              window, softcap, dtype) for b, n in enumerate(ctx)])


def _decode_case(window, dtype, seed, ctx=(1, 17, 69, 300, 0)):
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(list(ctx), 1, 32, BLOCK_SIZE, dtype, gen)
    query = (torch.randn(len(ctx), 4, 32, generator=gen) * 3).to(dtype)
    return _forget_blocks_before(kv, [max(n - window, 0) for n in ctx]), query, list(ctx)


def _decode(kv, query, ctx, scale, cfg=None, **options):
    from tritium.kernels.decode_attention import DecodeConfig  # imports triton: only inside tests
    out = poisoned(query.shape, query.dtype)
    kernels.paged_decode_attention.triton(query.to(DEVICE), kv.k_cache, kv.v_cache, kv.block_tables,
                                   torch.tensor(ctx, dtype=torch.int32, device=DEVICE), scale, out=out,
                                   config=DecodeConfig(**cfg) if cfg else None, **options)
    return out


# One split; three (a 32-key tile spans two blocks); five of 16-key tiles (smaller than a block).
DECODE_CONFIGS = [None, {"num_splits": 3, "block_n": 32}, {"num_splits": 5, "block_n": 16}]


@pytest.mark.parametrize("cfg", DECODE_CONFIGS)
@pytest.mark.parametrize("window", WINDOWS)
def test_decode_window_matches_float64(window, cfg):
    kv, query, ctx = _decode_case(window, torch.float32, seed=window)
    out = _decode(kv, query, ctx, 0.125, cfg, sliding_window=window)
    assert rel_err(out, _decode_oracle(kv, query, ctx, 0.125, window, None, torch.float64)) < 1e-4
    if window < 300:  # the window changes the long sequence's output
        assert rel_err(out[3], _decode_oracle(kv, query, ctx, 0.125, None, None, torch.float64)[3]) > 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 17])
def test_decode_softcap_matches_float64(window, dtype):
    """Soft-capping alone and with a window, split in two, in each dtype."""
    kv, query, ctx = _decode_case(window or 10 ** 6, dtype, seed=3)
    out = _decode(kv, query, ctx, 0.125, {"num_splits": 2, "block_n": 32}, sliding_window=window,
                  logit_softcap=SOFTCAP)
    ref64 = _decode_oracle(kv, query, ctx, 0.125, window, SOFTCAP, torch.float64)
    assert_accurate(out, ref64, _decode_oracle(kv, query, ctx, 0.125, window, SOFTCAP, dtype))
    uncapped = _decode_oracle(kv, query, ctx, 0.125, window, None, torch.float64)
    assert rel_err(out, uncapped) > 1e-2


def test_decode_window_splits_cover_only_the_window(monkeypatch):
    """A 32k-token bound with a 100-token window: the split choice sees the window's tiles (at
    most W + block_n - 1 = 163 tokens: two splits of 128, where the bound alone gives 43), and
    the merge counts each sequence's splits from its window's first tile (one for the 700-token
    sequence, whose window starts in tile 576, two for the 129-token one)."""
    from tritium.kernels.decode_attention import DecodeConfig
    from tritium.kernels import decode_attention

    grids = []
    real = decode_attention._decode_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(decode_attention, "_decode_kernel", Spy())
    kv, query, ctx = _decode_case(100, torch.float32, seed=5, ctx=(700, 90, 129))
    out = poisoned(query.shape, torch.float32)
    lens = torch.tensor(ctx, dtype=torch.int32, device=query.device)
    kernels.paged_decode_attention.triton(query, kv.k_cache, kv.v_cache, kv.block_tables, lens, 0.125, out=out,
                                   max_context_len=32768, sliding_window=100,
                                   config=DecodeConfig(num_stages=2, min_tokens_per_split=64))
    assert grids == [(1, 3, 2)]
    assert rel_err(out, _decode_oracle(kv, query, ctx, 0.125, 100, None, torch.float64)) < 1e-4


def test_decode_reference_window_softcap_in_float64():
    for window in WINDOWS + [None]:
        kv, query, ctx = _decode_case(window or 10 ** 6, torch.float64, seed=7)
        for softcap in (None, SOFTCAP):
            out = reference.paged_decode_attention_ref(
                query, kv.k_cache.cpu(), kv.v_cache.cpu(), kv.block_tables.cpu(),
                torch.tensor(ctx, dtype=torch.int32), 0.125, sliding_window=window, logit_softcap=softcap)
            ref64 = _decode_oracle(kv, query, ctx, 0.125, window, softcap, torch.float64)
            assert rel_err(out, ref64) < 1e-12, (window, softcap)


# --- prefill --------------------------------------------------------------------------------------

# Pure prefill, a chunk after a prefix several windows long (earlier chunks or prefix-cache hits:
# the kernels cannot tell), one token.
Q_LENS, CTX = [33, 20, 1], [33, 90, 30]


def _prefill_case(window, dtype, seed, q_lens=Q_LENS, ctx=CTX):
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(ctx, 1, 32, BLOCK_SIZE, dtype, gen)
    query = (torch.randn(sum(q_lens), 4, 32, generator=gen) * 3).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    first_seen = [max(total - n - window + 1, 0) for n, total in zip(q_lens, ctx)]
    return _forget_blocks_before(kv, first_seen), query, cu


def _prefill_oracle(kv, query, scale, window, softcap, dtype, q_lens=Q_LENS, ctx=CTX):
    rows, start = [], 0
    for b, (n, total) in enumerate(zip(q_lens, ctx)):
        rows.append(_oracle(query[start:start + n], kv.keys[b], kv.values[b], torch.arange(total - n, total),
                            scale, window, softcap, dtype))
        start += n
    return torch.cat(rows)


def _chunk_kv(kv, q_lens=Q_LENS, ctx=CTX):
    """The chunks' own keys and values [T, Hkv, D], as the engine passes them."""
    keys = torch.cat([kv.keys[b][total - n:] for b, (n, total) in enumerate(zip(q_lens, ctx))])
    values = torch.cat([kv.values[b][total - n:] for b, (n, total) in enumerate(zip(q_lens, ctx))])
    return keys.to(DEVICE), values.to(DEVICE)


def _prefill(kv, query, cu, scale, fields=None, chunk=False, q_lens=Q_LENS, ctx=CTX, **options):
    from tritium.kernels.prefill_attention import PrefillConfig  # imports triton: only inside tests
    out = poisoned(query.shape, query.dtype)
    if chunk:
        options["key"], options["value"] = _chunk_kv(kv, q_lens, ctx)
    kernels.paged_prefill_attention.triton(
        query.to(DEVICE), kv.k_cache, kv.v_cache, kv.block_tables, cu.to(DEVICE),
        torch.tensor(ctx, dtype=torch.int32, device=DEVICE), max(q_lens), scale, out=out,
        config=PrefillConfig(**fields) if fields else None, **options)
    return out


# (PrefillConfig fields or None, chunk keys/values passed): every key through the block table with
# the default, 16 x 16 and 32 x 64 tiles; the chunk from key/value through TMA, with the prefix
# in a launch of its own, with GQA heads packed (packed through the cache: the FP8 test below).
PREFILL_PATHS = {
    "cache": (None, False),
    "cache 16x16": ({"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 2}, False),
    "cache 32x64": ({"block_m": 32, "block_n": 64, "num_warps": 4, "num_stages": 2}, False),
    "chunk tma": ({"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 2, "kv_tma": True}, True),
    "chunk, prefix split": ({"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 2,
                             "split_prefix": True}, True),
    "chunk, GQA packed": ({"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 2,
                           "pack_gqa": True}, True),
}


@pytest.mark.parametrize("window, path", [(w, path) for w in WINDOWS[:3] for path in PREFILL_PATHS]
                         + [(WINDOWS[3], "cache"), (WINDOWS[3], "chunk, prefix split")])
def test_prefill_window_matches_float64(window, path):
    fields, chunk = PREFILL_PATHS[path]
    kv, query, cu = _prefill_case(window, torch.float32, seed=window)
    out = _prefill(kv, query, cu, 0.125, fields, chunk, sliding_window=window)
    assert rel_err(out, _prefill_oracle(kv, query, 0.125, window, None, torch.float64)) < 1e-4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["cache", "chunk, prefix split"])
@pytest.mark.parametrize("window", [None, 17])
def test_prefill_softcap_matches_float64(window, path, dtype):
    """Soft-capping alone and with a window, on each way the keys are read, in each dtype."""
    fields, chunk = PREFILL_PATHS[path]
    kv, query, cu = _prefill_case(window or 10 ** 6, dtype, seed=11)
    out = _prefill(kv, query, cu, 0.125, fields, chunk, sliding_window=window, logit_softcap=SOFTCAP)
    ref64 = _prefill_oracle(kv, query, 0.125, window, SOFTCAP, torch.float64)
    assert_accurate(out, ref64, _prefill_oracle(kv, query, 0.125, window, SOFTCAP, dtype))
    assert rel_err(out, _prefill_oracle(kv, query, 0.125, window, None, torch.float64)) > 1e-2


def test_prefill_window_in_chunks_equals_one_pass():
    """A 150-token prompt with a 17-token window prefilled in chunks of 64, 64 and 22 (each
    after the previous ones' prefix) gives the rows of one 150-token pass."""
    kv, query, _ = _prefill_case(17, torch.float32, seed=13, q_lens=[150], ctx=[150])
    whole = _prefill_oracle(kv, query, 0.125, 17, SOFTCAP, torch.float64, q_lens=[150], ctx=[150])
    for start, end in ((0, 64), (64, 128), (128, 150)):
        n = end - start
        part = dataclasses.replace(kv, keys=[kv.keys[0][:end]], values=[kv.values[0][:end]])
        part = _forget_blocks_before(part, [max(start - 17 + 1, 0)])
        out = _prefill(part, query[start:end], torch.tensor([0, n], dtype=torch.int32), 0.125,
                       chunk=True, q_lens=[n], ctx=[end], sliding_window=17, logit_softcap=SOFTCAP)
        assert rel_err(out, whole[start:end]) < 1e-4, (start, end)


def test_prefill_reference_window_softcap_in_float64():
    for window in WINDOWS + [None]:
        kv, query, cu = _prefill_case(window or 10 ** 6, torch.float64, seed=17)
        for softcap in (None, SOFTCAP):
            out = reference.paged_prefill_attention_ref(
                query, kv.k_cache.cpu(), kv.v_cache.cpu(), kv.block_tables.cpu(), cu,
                torch.tensor(CTX, dtype=torch.int32), max(Q_LENS), 0.125, sliding_window=window,
                logit_softcap=softcap)
            ref64 = _prefill_oracle(kv, query, 0.125, window, softcap, torch.float64)
            assert rel_err(out, ref64) < 1e-12, (window, softcap)


# --- FP8 cache ------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["decode", "prefill", "prefill GQA packed"])
@pytest.mark.parametrize("window", [16, 17])
def test_fp8_cache_with_window_and_softcap(window, op):
    """An FP8 cache (values transposed per block, read in runs) with a window: no run of a
    forgotten block is read (it is NaN), and the scales fold in as without one."""
    from test_kernel_fp8_kv_cache import _to_fp8
    if op == "decode":
        kv, query, ctx = _decode_case(window, torch.float32, seed=19)
        kv = _to_fp8(kv, 0.05, 0.02)
        out = _decode(kv, query, ctx, 0.125, {"num_splits": 3, "block_n": 32}, k_scale=0.05, v_scale=0.02,
                      sliding_window=window, logit_softcap=SOFTCAP)
        ref64 = _decode_oracle(kv, query, ctx, 0.125, window, SOFTCAP, torch.float64)
        ref = reference.paged_decode_attention_ref(
            query.double(), kv.k_cache.cpu(), kv.v_cache.cpu(), kv.block_tables.cpu(),
            torch.tensor(ctx, dtype=torch.int32), 0.125, k_scale=0.05, v_scale=0.02,
            sliding_window=window, logit_softcap=SOFTCAP)
    else:
        kv, query, cu = _prefill_case(window, torch.float32, seed=19)
        kv = _to_fp8(kv, 0.05, 0.02)
        fields = {"block_m": 16, "block_n": 32, "num_warps": 4, "num_stages": 2, "pack_gqa": "GQA" in op}
        out = _prefill(kv, query, cu, 0.125, fields, k_scale=0.05, v_scale=0.02, sliding_window=window,
                       logit_softcap=SOFTCAP)
        ref64 = _prefill_oracle(kv, query, 0.125, window, SOFTCAP, torch.float64)
        ref = reference.paged_prefill_attention_ref(
            query.double(), kv.k_cache.cpu(), kv.v_cache.cpu(), kv.block_tables.cpu(), cu,
            torch.tensor(CTX, dtype=torch.int32), max(Q_LENS), 0.125, k_scale=0.05, v_scale=0.02,
            sliding_window=window, logit_softcap=SOFTCAP)
    assert rel_err(out, ref64) < 1e-4
    assert rel_err(ref, ref64) < 1e-12


# --- arguments ------------------------------------------------------------------------------------

WINDOW_MESSAGE = "sliding_window must be a positive int, or None or 0 for no window, got {}"
SOFTCAP_MESSAGE = "logit_softcap must be a positive finite float, or None for no cap, got {}"
BAD_OPTIONS = [
    ({"sliding_window": -1}, WINDOW_MESSAGE.format("-1")),
    ({"sliding_window": 16.0}, WINDOW_MESSAGE.format("16.0")),
    ({"sliding_window": True}, WINDOW_MESSAGE.format("True")),
    ({"logit_softcap": 0.0}, SOFTCAP_MESSAGE.format("0.0")),
    ({"logit_softcap": -30.0}, SOFTCAP_MESSAGE.format("-30.0")),
    ({"logit_softcap": float("inf")}, SOFTCAP_MESSAGE.format("inf")),
    ({"logit_softcap": float("nan")}, SOFTCAP_MESSAGE.format("nan")),
    ({"logit_softcap": "50"}, SOFTCAP_MESSAGE.format("'50'")),
]


@pytest.mark.parametrize("fn", [kernels.paged_decode_attention.triton, reference.paged_decode_attention_ref,
                                kernels.paged_prefill_attention.triton, reference.paged_prefill_attention_ref])
@pytest.mark.parametrize("options, message", BAD_OPTIONS)
def test_window_and_softcap_are_checked(fn, options, message):
    kv, query, ctx = _decode_case(16, torch.float32, seed=0, ctx=(5, 9))
    on = "cpu" if fn.__module__ == "kernels.reference" else DEVICE
    args = [query.to(on), kv.k_cache.to(on), kv.v_cache.to(on), kv.block_tables.to(on)]
    lens = torch.tensor(ctx, dtype=torch.int32, device=on)
    if "decode" in fn.__name__:
        op, args = "paged_decode_attention", args + [lens, 0.125]
    else:
        op, args = "paged_prefill_attention", args + [torch.tensor([0, 1, 2], dtype=torch.int32, device=on),
                                                      lens, 1, 0.125]
    with pytest.raises(ValueError, match=re.escape(f"{op}: {message}") + "$"):
        fn(*args, **options)


def test_no_window_is_the_plain_call():
    """None and 0 mean no window, and a window past every context reads the same keys in the
    same tiles: the plain call's output, bit for bit."""
    kv, query, ctx = _decode_case(10 ** 6, torch.float32, seed=23)
    plain = _decode(kv, query, ctx, 0.125)
    for window in (None, 0, 301):
        assert torch.equal(_decode(kv, query, ctx, 0.125, sliding_window=window), plain), window
