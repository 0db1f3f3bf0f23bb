"""apply_rotary_emb with a KV cache: one pass rotates query and key in place and stores the rotated
key and the value. The result must be exactly apply_rotary_emb followed by store_kv_cache: the
same query, key, value and the same cache bytes (16-bit and FP8 caches, partial rotary, Qwen3's
head norms, strided views of a fused qkv row, skipped slots); the reference likewise."""

import pytest
import torch
from kernel_checks import DEVICE, DTYPES

from tritium import kernels
from tritium.kernels import reference

FP8 = torch.float8_e4m3fn
TOKENS, HQ, HKV, NUM_BLOCKS, BLOCK_SIZE = 9, 4, 2, 5, 16


def _case(dtype, cache_dtype, head_size, rotary_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    width = (HQ + 2 * HKV) * head_size
    # Keys large enough that the FP8 cache saturates some of them (scale 0.37 below).
    qkv = (torch.randn(TOKENS, width, generator=gen) * 60).to(dtype)
    positions = torch.randint(0, 64, (TOKENS,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:TOKENS]
    slots[[1, 5]] = -1
    if cache_dtype == FP8:  # 0x7F is e4m3's NaN; values transposed within each block
        shapes = ((NUM_BLOCKS, BLOCK_SIZE, HKV, head_size), (NUM_BLOCKS, HKV, head_size, BLOCK_SIZE))
        caches = [torch.full(s, 0x7F, dtype=torch.uint8).view(FP8) for s in shapes]
    else:
        shape = (NUM_BLOCKS, BLOCK_SIZE, HKV, head_size)
        caches = [torch.full(shape, float("nan"), dtype=cache_dtype) for _ in range(2)]
    norms = (torch.randn(head_size, generator=gen).to(dtype), torch.randn(head_size, generator=gen).to(dtype))
    return qkv, positions, cos_sin, slots, caches, norms


def _split(qkv, head_size):
    q_end, k_end = HQ * head_size, (HQ + HKV) * head_size
    return qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]


def _run(rotary, store, qkv, positions, cos_sin, slots, caches, norms, head_size, fused, use_norm,
         scales):
    """Rotates (and stores) on copies; returns qkv and the two caches' bytes."""
    qkv = qkv.clone().to(DEVICE)
    k_cache, v_cache = (c.clone().to(DEVICE) for c in caches)
    q, k, v = _split(qkv, head_size)
    args = (q, k, positions.to(DEVICE), cos_sin.to(DEVICE), head_size)
    norm_args = tuple(w.to(DEVICE) for w in norms) + (1e-6,) if use_norm else ()
    if fused:
        rotary(*args, *norm_args, value=v, k_cache=k_cache, v_cache=v_cache,
               slot_mapping=slots.to(DEVICE), k_scale=scales[0], v_scale=scales[1])
    else:
        rotary(*args, *norm_args)
        shape = (TOKENS, HKV, head_size)
        store(k.view(shape), v.view(shape), k_cache, v_cache, slots.to(DEVICE), *scales)
    as_bytes = (lambda c: c.view(torch.uint8).cpu()) if k_cache.dtype == FP8 else (lambda c: c.cpu())
    return qkv.cpu(), as_bytes(k_cache), as_bytes(v_cache)


def _assert_same(a, b):
    """Bit for bit: the same NaNs (unwritten 16-bit slots) and the same values or bytes."""
    for x, y in zip(a, b):
        if x.is_floating_point():
            assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())
        else:
            assert torch.equal(x, y)


CASES = [  # (head_size, rotary_dim, head norms)
    (64, 64, False), (64, 64, True), (64, 32, False), (96, 48, False),
]


@pytest.mark.parametrize("cache", ["16-bit", "fp8"])
@pytest.mark.parametrize("head_size, rotary_dim, use_norm", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_rotate_and_store_equals_rotate_then_store(dtype, head_size, rotary_dim, use_norm, cache):
    cache_dtype = FP8 if cache == "fp8" else dtype
    case = _case(dtype, cache_dtype, head_size, rotary_dim, seed=head_size + rotary_dim + use_norm)
    scales = (0.37, 3.0) if cache == "fp8" else (1.0, 1.0)
    fused = _run(kernels.apply_rotary_emb.triton, kernels.store_kv_cache.triton, *case, head_size, True, use_norm, scales)
    apart = _run(kernels.apply_rotary_emb.triton, kernels.store_kv_cache.triton, *case, head_size, False, use_norm, scales)
    _assert_same(fused, apart)
    # and something was stored: the kept slots hold the rotated keys, the skipped ones are untouched
    qkv, k_bytes, _ = fused
    keep = case[3] >= 0
    if cache == "16-bit":
        stored = k_bytes.view(-1, HKV, head_size)[case[3][keep]]
        assert torch.equal(stored, _split(qkv, head_size)[1].reshape(TOKENS, HKV, head_size)[keep])
        assert k_bytes.view(-1, HKV, head_size).isnan().all(-1).all(-1).sum() == NUM_BLOCKS * BLOCK_SIZE - keep.sum()


@pytest.mark.parametrize("cache", ["16-bit", "fp8"])
@pytest.mark.parametrize("head_size, rotary_dim, use_norm", CASES)
def test_reference_rotate_and_store_equals_rotate_then_store(head_size, rotary_dim, use_norm, cache):
    dtype = torch.float32
    cache_dtype = FP8 if cache == "fp8" else dtype
    case = _case(dtype, cache_dtype, head_size, rotary_dim, seed=7)
    scales = (0.37, 3.0) if cache == "fp8" else (1.0, 1.0)
    run = lambda fused: _run(lambda *a, **kw: reference.apply_rotary_emb_ref(*a, **kw),
                             reference.store_kv_cache_ref, *case, head_size, fused, use_norm, scales)
    _assert_same(run(True), run(False))


def _bad_args():
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, (HQ + 2 * HKV) * 64, generator=gen)
    q, k, v = _split(qkv, 64)
    cos_sin = torch.randn(16, 64)
    caches = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, 64) for _ in range(2)]
    return dict(query=q, key=k, positions=torch.zeros(3, dtype=torch.int64), cos_sin_cache=cos_sin,
                head_size=64, value=v, k_cache=caches[0], v_cache=caches[1],
                slot_mapping=torch.arange(3))


@pytest.mark.parametrize("fn", [kernels.apply_rotary_emb.triton, reference.apply_rotary_emb_ref])
@pytest.mark.parametrize("change, message", [
    (lambda a: a.pop("v_cache"),
     "apply_rotary_emb: value, k_cache, v_cache and slot_mapping must be given together (missing: v_cache)"),
    (lambda a: a.update(value=a["value"][:, :64]),
     "apply_rotary_emb: value must have shape key.shape = (3, 128), got (3, 64)"),
    (lambda a: a.update(slot_mapping=torch.arange(2)),
     "apply_rotary_emb: slot_mapping must have shape [T] = (3,), got (2,)"),
    (lambda a: a.update(k_scale=-1.0),
     "apply_rotary_emb: k_scale must be a positive finite number, got -1.0"),
])
def test_rotate_and_store_rejects_bad_cache_arguments(fn, change, message):
    args = _bad_args()
    change(args)
    if DEVICE == "cuda":
        args = {n: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    with pytest.raises(ValueError) as err:
        fn(**args)
    assert str(err.value) == message
