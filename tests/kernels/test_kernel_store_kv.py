"""store_kv_cache: an exact scatter by slot_mapping; -1 skips; key/value may be strided views."""

import re

import pytest
import torch
from kernel_checks import DEVICE, DTYPES

from tritium import kernels
from tritium.kernels import reference


def _store_case(dtype, slot_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_tokens, hkv, head_dim, num_blocks, block_size = 9, 3, 64, 5, 16
    # key/value as views into one fused qkv row, as the backend passes them.
    qkv = torch.randn(num_tokens, 96 + 2 * hkv * head_dim, generator=gen).to(dtype).to(DEVICE)
    key = qkv[:, 96:96 + hkv * head_dim].view(num_tokens, hkv, head_dim)
    value = qkv[:, 96 + hkv * head_dim:].view(num_tokens, hkv, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 6]] = -1
    cache_shape = (num_blocks, block_size, hkv, head_dim)
    caches = [torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]
    return key, value, caches, slots.to(slot_dtype).to(DEVICE)


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_cache_scatters_exactly(dtype, slot_dtype):
    key, value, (k_cache, v_cache), slots = _store_case(dtype, slot_dtype)
    kernels.store_kv_cache.triton(key, value, k_cache, v_cache, slots)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep].long()], key[keep])
    assert torch.equal(flat_v[slots[keep].long()], value[keep])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[keep].long()] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


def test_store_kv_cache_matches_reference():
    key, value, (k_cache, v_cache), slots = _store_case(torch.float32, torch.int64, seed=3)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kernels.store_kv_cache.triton(key, value, k_cache, v_cache, slots)
    reference.store_kv_cache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache.nan_to_num(123.0), k_ref.nan_to_num(123.0))
    assert torch.equal(v_cache.nan_to_num(123.0), v_ref.nan_to_num(123.0))


@pytest.mark.parametrize("fn", [kernels.store_kv_cache.triton, reference.store_kv_cache_ref])
@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(slot_mapping=a["slot_mapping"].float()),
     "store_kv_cache: slot_mapping must have dtype torch.int32 or torch.int64, got torch.float32"),
    (lambda a: a.update(value=a["value"][:, :2]),
     "store_kv_cache: value must have shape key.shape = (9, 3, 64), got (9, 2, 64)"),
    (lambda a: a.update(k_cache=a["k_cache"][..., :32].contiguous(), v_cache=a["v_cache"][..., :32].contiguous()),
     "store_kv_cache: key [T, Hkv, D] has (Hkv, D) = (3, 64) but k_cache has (3, 32)"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"][:4]),
     "store_kv_cache: slot_mapping must have shape [T] = (9,), got (4,)"),
])
def test_store_kv_cache_rejects_bad_arguments(fn, change, message):
    key, value, (k_cache, v_cache), slots = _store_case(torch.float32, torch.int64)
    args = dict(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    change(args)
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        fn(**args)
