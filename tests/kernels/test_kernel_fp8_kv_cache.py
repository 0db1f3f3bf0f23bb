"""FP8 (e4m3) KV cache: store_kv_cache writes torch's exact float8 bits of value / scale, and both
attention kernels read such a cache back to the float64 oracle's result on the dequantized
values, with per-tensor scales folded in; a 16-bit cache ignores the scales."""

import re

import pytest
import torch
from kernel_checks import (DEVICE, DTYPES, PagedKV, assert_accurate, attention_oracle,
                           make_paged_kv, poisoned, rel_err)

from tritium import kernels
from tritium.kernels import reference

FP8 = torch.float8_e4m3fn
# Values where rounding to e4m3 is easy to get wrong: carries into the next binade (7.9 -> 8),
# ties (1.0625 -> 1.0 and 1.1875 -> 1.25, to even), subnormals (steps of 2**-9), underflow,
# saturation at +-448, signed zero.
EDGE_VALUES = [7.9, -7.979, 15.9, 1.0625, 1.1875, 0.00535, 0.00267, 0.0009, 0.0029296875, 447.0,
               460.0, -1000.0, 240.0, 0.0, -0.0, 1.0, -0.015625, 0.0146, 3.99, 0.5]


def _fp8_bits(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What the cache must hold, from torch's own conversion (round to nearest even); NaN is
    stored as 0 (a stale NaN would poison other requests' attention)."""
    scaled = x.float() * torch.tensor(1.0 / scale, dtype=torch.float32)
    return scaled.nan_to_num(nan=0.0).clamp(-448.0, 448.0).to(FP8).view(torch.uint8)


def _store_case(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_tokens, hkv, head_dim, num_blocks, block_size = 12, 2, 64, 4, 16
    key = (torch.randn(num_tokens, hkv, head_dim, generator=gen) * 40).to(dtype)
    value = torch.randn(num_tokens, hkv, head_dim, generator=gen).to(dtype)
    key.view(-1)[:len(EDGE_VALUES)] = torch.tensor(EDGE_VALUES).to(dtype)
    key.view(-1)[len(EDGE_VALUES)] = float("nan")
    value.view(-1)[-len(EDGE_VALUES):] = torch.tensor(EDGE_VALUES).to(dtype) * 2
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[4] = -1
    # 0x7F is e4m3's NaN: slots the kernel must not write stay NaN. Values are transposed per block.
    caches = [torch.full(shape, 0x7F, dtype=torch.uint8).view(FP8) for shape in
              ((num_blocks, block_size, hkv, head_dim), (num_blocks, hkv, head_dim, block_size))]
    return key, value, [c.to(DEVICE) for c in caches], slots


def _value_rows(v_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks * block_size, Hkv, D] bytes of a transposed FP8 value cache, by slot."""
    raw = v_cache.view(torch.uint8).cpu()
    return raw.permute(0, 3, 1, 2).reshape(-1, raw.shape[1], raw.shape[2])


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 3.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_writes_torchs_fp8_bits(dtype, scales):
    key, value, (k_cache, v_cache), slots = _store_case(dtype, seed=1)
    k_scale, v_scale = scales
    kernels.store_kv_cache.triton(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE),
                           k_scale, v_scale)
    keep = slots >= 0
    flat_k = k_cache.view(torch.uint8).view(-1, *k_cache.shape[2:]).cpu()
    flat_v = _value_rows(v_cache)
    assert torch.equal(flat_k[slots[keep]], _fp8_bits(key[keep], k_scale))
    assert torch.equal(flat_v[slots[keep]], _fp8_bits(value[keep], v_scale))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert (flat_k[untouched] == 0x7F).all() and (flat_v[untouched] == 0x7F).all()


def test_store_reference_writes_the_same_bits():
    key, value, (k_cache, v_cache), slots = _store_case(torch.float32, seed=2)
    k_ref, v_ref = k_cache.cpu().clone(), v_cache.cpu().clone()
    kernels.store_kv_cache.triton(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE), 0.5, 2.0)
    reference.store_kv_cache_ref(key, value, k_ref, v_ref, slots, 0.5, 2.0)
    assert torch.equal(k_cache.view(torch.uint8).cpu(), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8).cpu(), v_ref.view(torch.uint8))


def _to_fp8(kv: PagedKV, k_scale: float, v_scale: float) -> PagedKV:
    """The same paged cache in FP8, values transposed per block; keys/values become the
    dequantized values the kernels must attend to, in float64. The store never writes NaN, and
    the kernels read the unused tail of a sequence's last run of values (with zero weight), so
    unused slots of allocated blocks hold 448 (finite, and loud if attended to); the padding
    block, which must never be read, stays NaN (0x7F)."""
    padding_block = int(kv.block_tables[0, -1])  # make_paged_kv's all-NaN block

    def quantize(cache, scale, transpose=False):
        cache = cache.cpu()
        q = reference.quantize_kv_ref(cache, scale).view(torch.uint8)
        q[cache.isnan()] = 0x7E  # 448
        q[padding_block] = 0x7F  # NaN
        if transpose:
            q = q.permute(0, 2, 3, 1).contiguous()
        return q.view(FP8).to(DEVICE)

    def dequantize(rows, scale):
        return reference.quantize_kv_ref(rows, scale).double() * scale

    return PagedKV(quantize(kv.k_cache, k_scale), quantize(kv.v_cache, v_scale, True), kv.block_tables,
                   [dequantize(k, k_scale) for k in kv.keys], [dequantize(v, v_scale) for v in kv.values])


def _decode_oracle(kv, query, ctx, scale, dtype):
    return torch.cat([attention_oracle(query[b:b + 1], kv.keys[b], kv.values[b], torch.tensor([n - 1]),
                                       scale, dtype) for b, n in enumerate(ctx)])


# (context_lens, Hkv, group, head_dim, block_size, num_splits or None)
DECODE_CASES = [([1, 17, 69, 150], 2, 4, 64, 16, None), ([600, 35, 0, 260], 1, 7, 128, 16, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_decode_reads_fp8_cache(case, dtype):
    ctx, hkv, group, head_dim, block_size, splits = DECODE_CASES[case]
    gen = torch.Generator().manual_seed(case)
    kv = _to_fp8(make_paged_kv(ctx, hkv, head_dim, block_size, torch.float32, gen), 0.05, 0.02)
    query = torch.randn(len(ctx), hkv * group, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    config = None
    if splits:
        from tritium.kernels.decode_attention import DecodeConfig  # imports triton: only inside tests
        config = DecodeConfig(num_splits=splits)
    out = poisoned(query.shape, dtype)
    kernels.paged_decode_attention.triton(query.to(DEVICE), kv.k_cache, kv.v_cache, kv.block_tables,
                                   torch.tensor(ctx, dtype=torch.int32, device=DEVICE), scale, out=out,
                                   config=config, k_scale=0.05, v_scale=0.02)
    ref64 = _decode_oracle(kv, query, ctx, scale, torch.float64)
    assert_accurate(out, ref64, _decode_oracle(kv, query, ctx, scale, dtype))
    ref = reference.paged_decode_attention_ref(query.double(), kv.k_cache.cpu(), kv.v_cache.cpu(),
                                               kv.block_tables.cpu(), torch.tensor(ctx, dtype=torch.int32), scale,
                                               k_scale=0.05, v_scale=0.02)
    assert rel_err(ref, ref64) < 1e-12


@pytest.mark.parametrize("q_lens, ctx", [([5, 40, 1, 17], [5, 70, 33, 17]),
                                         ([5, 5, 2], [70, 5, 40])])  # short chunks: GQA heads packed
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_reads_fp8_cache(dtype, q_lens, ctx):
    gen = torch.Generator().manual_seed(5)
    kv = _to_fp8(make_paged_kv(ctx, 2, 64, 16, torch.float32, gen), 0.05, 0.02)
    query = torch.randn(sum(q_lens), 8, 64, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)

    def oracle(dt):
        rows, start = [], 0
        for b, (n, total) in enumerate(zip(q_lens, ctx)):
            rows.append(attention_oracle(query[start:start + n], kv.keys[b], kv.values[b],
                                         torch.arange(total - n, total), 0.125, dt))
            start += n
        return torch.cat(rows)

    args = (kv.k_cache, kv.v_cache, kv.block_tables, cu.to(DEVICE),
            torch.tensor(ctx, dtype=torch.int32, device=DEVICE), max(q_lens), 0.125)
    out = poisoned(query.shape, dtype)
    # The chunk's own keys and values, when passed, are not read from an FP8 cache's caller
    # (decode will read the quantized ones): NaN here must not reach the output.
    chunk = poisoned((sum(q_lens), 2, 64), dtype)
    kernels.paged_prefill_attention.triton(query.to(DEVICE), *args, out=out, k_scale=0.05, v_scale=0.02,
                                    key=chunk, value=chunk)
    ref64 = oracle(torch.float64)
    assert_accurate(out, ref64, oracle(dtype))
    ref = reference.paged_prefill_attention_ref(query.double(), *[a.cpu() if torch.is_tensor(a) else a
                                                                  for a in args],
                                                k_scale=0.05, v_scale=0.02)
    assert rel_err(ref, ref64) < 1e-12


def test_scales_do_not_apply_to_a_16_bit_cache():
    ctx = [40, 9]
    gen = torch.Generator().manual_seed(3)
    kv = make_paged_kv(ctx, 1, 64, 16, torch.float32, gen)
    query = torch.randn(2, 4, 64, generator=gen).to(DEVICE)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    plain = kernels.paged_decode_attention.triton(query, kv.k_cache, kv.v_cache, kv.block_tables, lens, 0.125)
    scaled = kernels.paged_decode_attention.triton(query, kv.k_cache, kv.v_cache, kv.block_tables, lens, 0.125,
                                            k_scale=4.0, v_scale=0.5)
    assert torch.equal(plain, scaled)


@pytest.mark.parametrize("fn", [kernels.store_kv_cache.triton, reference.store_kv_cache_ref])
@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(k_scale=0.0), "store_kv_cache: k_scale must be a positive finite number, got 0.0"),
    (lambda a: a.update(v_scale=float("inf")),
     "store_kv_cache: v_scale must be a positive finite number, got inf"),
    (lambda a: a.update(k_scale=True), "store_kv_cache: k_scale must be a positive finite number, got True"),
    (lambda a: a.update(v_cache=torch.zeros(a["v_cache"].shape, dtype=torch.float32, device=DEVICE)),
     "store_kv_cache: v_cache must have the dtype of k_cache (torch.float8_e4m3fn), got torch.float32"),
    (lambda a: a.update(v_cache=a["v_cache"].view(4, 16, 2, 64)),
     "store_kv_cache: v_cache must have shape [num_blocks, Hkv, D, block_size] (FP8) = (4, 2, 64, 16), "
     "got (4, 16, 2, 64)"),
    (lambda a: a.update(k_cache=a["k_cache"].view(torch.uint8), v_cache=a["v_cache"].view(torch.uint8)),
     "store_kv_cache: k_cache must have dtype torch.float16, torch.bfloat16, torch.float32 or "
     "torch.float8_e4m3fn, got torch.uint8"),
])
def test_fp8_cache_arguments_are_checked(fn, change, message):
    key, value, (k_cache, v_cache), slots = _store_case(torch.float32, seed=0)
    args = dict(key=key.to(DEVICE), value=value.to(DEVICE), k_cache=k_cache, v_cache=v_cache,
                slot_mapping=slots.to(DEVICE), k_scale=1.0, v_scale=1.0)
    if fn is reference.store_kv_cache_ref:
        args = {k: v.cpu() if torch.is_tensor(v) else v for k, v in args.items()}
    change(args)
    message = message.replace("torch.float16, torch.bfloat16, torch.float32 or",
                              "torch.float16, torch.bfloat16, torch.float32, torch.float64 or"
                              ) if fn is reference.store_kv_cache_ref else message
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        fn(**args)


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_fp8_compute_choice_is_checked(op):
    kv = _to_fp8(make_paged_kv([20], 1, 64, 16, torch.float32, torch.Generator().manual_seed(0)), 1.0, 1.0)
    query = torch.randn(1, 4, 64).to(DEVICE)
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    if op == "decode":
        from tritium.kernels.decode_attention import DecodeConfig  # imports triton: only inside tests
        call = lambda: kernels.paged_decode_attention.triton(  # noqa: E731
            query, kv.k_cache, kv.v_cache, kv.block_tables, lens, 0.125, config=DecodeConfig(fp8_compute="bf16"))
    else:
        from tritium.kernels.prefill_attention import PrefillConfig
        cu = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
        call = lambda: kernels.paged_prefill_attention.triton(  # noqa: E731
            query, kv.k_cache, kv.v_cache, kv.block_tables, cu, lens, 1, 0.125,
            config=PrefillConfig(fp8_compute="bf16"))
    with pytest.raises(ValueError, match=rf"^paged_{op}_attention: fp8_compute must be 'float16' or "
                                         r"'query', got 'bf16'$"):
        call()
