"""paged_decode_attention against a float64 oracle: mixed context lengths, partial last blocks,
shuffled physical blocks, GQA 1/4/7, block sizes 16/32, head dims 64/128, with and without
splitting the KV sequence across programs."""

import re

import pytest
import torch
from kernel_checks import (DEVICE, DTYPES, attention_oracle, assert_accurate, make_paged_kv,
                           poisoned, rel_err)

from tritium import kernels
from tritium.kernels import reference

# (context_lens, Hkv, group, head_dim, block_size, config kwargs)
CASES = [
    ([1, 17, 69, 150], 2, 1, 64, 16, {}),                              # one split
    ([33, 5, 130], 1, 4, 128, 32, {"num_splits": 3}),                 # a split per ~64 tokens
    ([96, 1, 48], 2, 7, 64, 16, {"num_splits": 4, "block_n": 32}),    # more splits than tokens
    ([70, 0, 31], 1, 4, 64, 32, {"block_n": 16}),                     # empty context; tile < block
    ([600, 35, 260], 1, 7, 128, 16, {}),                              # split count chosen: 2
]


def kernels_config(**kw):
    from tritium.kernels.decode_attention import DecodeConfig  # imports triton: only inside tests
    return DecodeConfig(**kw)


def _decode_inputs(ctx, hkv, group, head_dim, block_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(ctx, hkv, head_dim, block_size, dtype, gen)
    query = torch.randn(len(ctx), hkv * group, head_dim, generator=gen).to(dtype)
    return kv, query


def _oracle(kv, query, ctx, scale, dtype):
    rows = [attention_oracle(query[b:b + 1], kv.keys[b], kv.values[b], torch.tensor([n - 1]), scale, dtype)
            for b, n in enumerate(ctx)]
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_decode_matches_float64(case, dtype):
    ctx, hkv, group, head_dim, block_size, cfg = CASES[case]
    kv, query = _decode_inputs(ctx, hkv, group, head_dim, block_size, dtype, seed=case)
    scale = head_dim ** -0.5
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    out = poisoned(query.shape, dtype)
    config = kernels_config(**cfg) if cfg else None
    kernels.paged_decode_attention.triton(query.to(DEVICE), kv.k_cache, kv.v_cache, kv.block_tables,
                                   context_lens, scale, out=out, config=config)
    ref64 = _oracle(kv, query, ctx, scale, torch.float64)
    assert_accurate(out, ref64, _oracle(kv, query, ctx, scale, dtype))


def test_decode_split_and_unsplit_agree_on_peaky_scores():
    """Large scores make the online max and the split merge matter; both paths must agree."""
    ctx = [200, 3, 129]
    kv, query = _decode_inputs(ctx, 2, 4, 64, 16, torch.float32, seed=7)
    query = query * 8
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    ref64 = _oracle(kv, query, ctx, 0.125, torch.float64)
    for splits in (1, 5):
        out = kernels.paged_decode_attention.triton(query.to(DEVICE), kv.k_cache, kv.v_cache, kv.block_tables,
                                             context_lens, 0.125, config=kernels_config(num_splits=splits))
        assert rel_err(out, ref64) < 1e-4, splits


def test_decode_head_dim_not_power_of_two():
    ctx = [40, 9]
    kv, query = _decode_inputs(ctx, 1, 2, 80, 16, torch.float32, seed=3)
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    out = kernels.paged_decode_attention.triton(query.to(DEVICE), kv.k_cache, kv.v_cache, kv.block_tables,
                                         context_lens, 0.1, config=kernels_config(num_splits=2))
    assert rel_err(out, _oracle(kv, query, ctx, 0.1, torch.float64)) < 1e-4


def test_decode_writes_only_its_out_view():
    """The backend passes out=out[:num_decode]; rows after the view must stay untouched."""
    ctx = [20, 45]
    kv, query = _decode_inputs(ctx, 1, 4, 64, 16, torch.float32, seed=4)
    buffer = poisoned((4, 4, 64), torch.float32)
    out = kernels.paged_decode_attention.triton(query.to(DEVICE), kv.k_cache, kv.v_cache, kv.block_tables,
                                         torch.tensor(ctx, dtype=torch.int32, device=DEVICE), 0.125,
                                         out=buffer[:2])
    assert out.data_ptr() == buffer.data_ptr()
    assert torch.isnan(buffer[2:]).all()
    assert rel_err(buffer[:2], _oracle(kv, query, ctx, 0.125, torch.float64)) < 1e-4


def test_reference_matches_oracle_in_float64():
    ctx = [1, 17, 69, 0]
    kv, query = _decode_inputs(ctx, 2, 7, 64, 16, torch.float64, seed=11)
    context_lens = torch.tensor(ctx, dtype=torch.int32)
    # Put an all-NaN block at physical index 0: padding positions must not leak slot 0 into p @ v.
    nan_block = torch.full_like(kv.k_cache[:1].cpu(), float("nan"))
    out = reference.paged_decode_attention_ref(query, torch.cat([nan_block, kv.k_cache.cpu()]),
                                               torch.cat([nan_block, kv.v_cache.cpu()]),
                                               kv.block_tables.cpu() + 1, context_lens, 0.3)
    assert rel_err(out, _oracle(kv, query, ctx, 0.3, torch.float64)) < 1e-12


def test_split_choice_fills_the_h200():
    from tritium.kernels.decode_attention import choose_num_splits, tokens_per_split
    # Llama-3-8B decode shapes: 8 KV heads, 132 SMs.
    assert choose_num_splits(1, 8, 32768, 132) == 33
    assert tokens_per_split(32768, 33, 64) == 1024  # -> 32 splits of 1024 tokens, 256 programs
    assert choose_num_splits(64, 8, 4096, 132) == 1
    assert choose_num_splits(256, 8, 1024, 132) == 1
    # One long sequence in a big batch is still split so it does not become the tail.
    assert choose_num_splits(256, 8, 32768, 132) == 8
    assert choose_num_splits(4, 8, 100, 132) == 1  # too short to split



def test_small_batches_split_into_single_tiles():
    """Below one program per SM the defaults split every sequence into tiles, up to 64 splits,
    for the engine's context buckets: one 640-token request in a 2,048 bucket walks 5 of 16
    splits of 128 tokens (bf16) or 10 of 32 splits of 64 (FP8); full batches stay unsplit."""
    from tritium.kernels.decode_attention import DecodeConfig, choose_num_splits, default_config, tokens_per_split

    def splits(batch, bucket, fp8):
        cfg = default_config(torch.bfloat16, batch, 8, 132, fp8)
        n = choose_num_splits(batch, 8, bucket, 132, cfg.programs_per_sm, cfg.min_tokens_per_split)
        return n, tokens_per_split(bucket, n, cfg.block_n)

    assert splits(1, 2048, False) == (16, 128)
    assert splits(1, 2048, True) == (32, 64)
    assert splits(4, 32768, False) == (64, 512)
    assert splits(16, 2048, True) == (32, 64)
    assert splits(256, 2048, False) == (1, 2048)
    assert default_config(torch.bfloat16, 256, 8, 132, True) == DecodeConfig(block_n=64, num_warps=2, num_stages=2)


def _valid_args(dtype=torch.float32):
    kv, query = _decode_inputs([5, 9], 2, 2, 64, 16, dtype, seed=0)
    return dict(query=query.to(DEVICE), k_cache=kv.k_cache, v_cache=kv.v_cache,
                block_tables=kv.block_tables, context_lens=torch.tensor([5, 9], dtype=torch.int32, device=DEVICE),
                scale=0.125)


@pytest.mark.parametrize("fn", [kernels.paged_decode_attention.triton, reference.paged_decode_attention_ref])
@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(query=a["query"].double()),
     "paged_decode_attention: query must have dtype torch.float16, torch.bfloat16 or torch.float32, "
     "got torch.float64"),
    (lambda a: a.update(k_cache=a["k_cache"].half()),
     "paged_decode_attention: k_cache must have the dtype of query (torch.float32) or "
     "torch.float8_e4m3fn, got torch.float16"),
    (lambda a: a.update(query=a["query"][:, :3]),
     "paged_decode_attention: query heads (3) must be a multiple of KV heads (2)"),
    (lambda a: a.update(context_lens=a["context_lens"].long()),
     "paged_decode_attention: context_lens must have dtype torch.int32, got torch.int64"),
    (lambda a: a.update(block_tables=a["block_tables"][:1]),
     "paged_decode_attention: block_tables has 1 rows but query has batch 2"),
    (lambda a: a.update(v_cache=a["v_cache"][:, :8]),
     "paged_decode_attention: v_cache must have shape k_cache.shape = (4, 16, 2, 64), got (4, 8, 2, 64)"),
    (lambda a: a.update(query=a["query"][..., :32]),
     "paged_decode_attention: query head dim 32 does not match k_cache head dim 64"),
    (lambda a: a.update(query=a["query"][..., ::2]),
     "paged_decode_attention: query must be contiguous in its last dimension, got strides (256, 64, 2)"),
    (lambda a: a.update(out=torch.empty(2, 4, 64, dtype=torch.float16, device=DEVICE)),
     "paged_decode_attention: out must have dtype torch.float32, got torch.float16"),
])
def test_decode_rejects_bad_arguments(fn, change, message):
    args = _valid_args()
    if fn is reference.paged_decode_attention_ref and "float64" in message:
        pytest.skip("the reference accepts float64 (it builds the tests' ground truth)")
    change(args)
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        fn(**args)


def test_decode_rejects_non_contiguous_cache():
    args = _valid_args()
    args["k_cache"] = args["k_cache"].transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match=r"^paged_decode_attention: k_cache must be contiguous"):
        kernels.paged_decode_attention.triton(**args)
