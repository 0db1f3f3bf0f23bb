"""Argument checks shared by the Triton wrappers and the PyTorch references.

Imports only torch, so `kernels.reference` can use it on machines without Triton. Every failed
check raises ValueError("<op>: <what is wrong>, got <what was passed>"); the tests match these
messages exactly, so change them together.
"""

from __future__ import annotations

import functools

import torch

HALF_AND_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
# References also take float64: the tests compute their ground truth with them.
REFERENCE_DTYPES = HALF_AND_FLOAT + (torch.float64,)
INDEX_DTYPES = (torch.int32, torch.int64)
# A KV cache holds either the activations' dtype or FP8 (e4m3, per-tensor scales k_scale/v_scale).
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0


def fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    names = [str(d) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_tensor(op: str, name: str, t: object, layout: str,
                 dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """Type, rank (from the layout string, e.g. "[B, Hq, D]") and dtype of one argument."""
    if not isinstance(t, torch.Tensor):
        fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    ndim = layout.count(",") + 1
    if t.dim() != ndim:
        fail(op, f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        fail(op, f"{name} must have dtype {_dtype_names(dtypes)}, got {t.dtype}")
    return t


def check_shape(op: str, name: str, t: torch.Tensor, expected: tuple[int, ...], layout: str) -> None:
    if tuple(t.shape) != tuple(expected):
        fail(op, f"{name} must have shape {layout} = {tuple(expected)}, got {tuple(t.shape)}")


def check_same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        fail(op, f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")


def check_same_device(op: str, tensors: dict[str, torch.Tensor]) -> None:
    names = list(tensors)
    first = tensors[names[0]].device
    for name in names[1:]:
        if tensors[name].device != first:
            fail(op, f"{name} is on {tensors[name].device} but {names[0]} is on {first}")


def check_last_dim_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(op, f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def check_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        fail(op, f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")


def check_out(op: str, out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor,
              layout: str) -> None:
    if out is None:
        return
    check_tensor(op, "out", out, layout, (like.dtype,))
    check_shape(op, "out", out, shape, layout)
    check_same_device(op, {"query": like, "out": out})
    check_last_dim_contiguous(op, "out", out)


# ---- one function per public op: returns the sizes the op needs -------------------------------

def _check_cache_pair(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor, ref_name: str,
                      ref: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """k_cache [num_blocks, block_size, Hkv, D] and v_cache of the same shape, contiguous, both in
    ref's dtype; or both FP8, with v_cache [num_blocks, Hkv, D, block_size] (see v_cache_shape)."""
    check_tensor(op, "k_cache", k_cache, "[num_blocks, block_size, Hkv, D]", dtypes + (FP8_KV_DTYPE,))
    if k_cache.dtype == FP8_KV_DTYPE:
        check_shape(op, "v_cache", v_cache, v_cache_shape(tuple(k_cache.shape), FP8_KV_DTYPE),
                    "[num_blocks, Hkv, D, block_size] (FP8)")
    else:
        check_shape(op, "v_cache", v_cache, tuple(k_cache.shape), "k_cache.shape")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype not in (ref.dtype, FP8_KV_DTYPE):
            fail(op, f"{name} must have the dtype of {ref_name} ({ref.dtype}) or {FP8_KV_DTYPE}, "
                     f"got {cache.dtype}")
    if v_cache.dtype != k_cache.dtype:
        fail(op, f"v_cache must have the dtype of k_cache ({k_cache.dtype}), got {v_cache.dtype}")
    check_contiguous(op, "k_cache", k_cache)
    check_contiguous(op, "v_cache", v_cache)


def v_cache_shape(k_shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...]:
    """An FP8 cache keeps each block's values transposed, [num_blocks, Hkv, D, block_size], so
    that p @ v reads its operand along the reduction (token) axis: with V token-major, Triton
    fetches 8-bit elements for that product one byte at a time. 16-bit caches keep K's layout."""
    num_blocks, block_size, num_kv_heads, head_dim = k_shape
    if dtype == FP8_KV_DTYPE:
        return (num_blocks, num_kv_heads, head_dim, block_size)
    return tuple(k_shape)


@functools.lru_cache(maxsize=64)
def fp32_reciprocal(scale: float) -> float:
    """1 / scale as the float32 that a kernel argument and a float32 tensor op both use (cached:
    the store asks for it twice per layer in every eager step, with the same few scales)."""
    return float(torch.tensor(1.0 / float(scale), dtype=torch.float32))


def check_kv_scales(op: str, k_scale: object, v_scale: object) -> None:
    """Per-tensor scales of an FP8 cache (stored = value / scale): positive finite numbers."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
                0.0 < float(scale) < float("inf")):
            fail(op, f"{name} must be a positive finite number, got {scale!r}")


def check_window_softcap(op: str, sliding_window: object, logit_softcap: object) -> tuple[int, float]:
    """Per-call attention options, as (window, softcap) with 0 for none: `sliding_window` a
    positive int (None or 0: every earlier key), `logit_softcap` a positive finite number (None:
    no cap)."""
    if sliding_window is None:
        sliding_window = 0
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 0:
        fail(op, f"sliding_window must be a positive int, or None or 0 for no window, got {sliding_window!r}")
    if logit_softcap is None:
        return sliding_window, 0.0
    if isinstance(logit_softcap, bool) or not isinstance(logit_softcap, (int, float)) or not (
            0.0 < float(logit_softcap) < float("inf")):
        fail(op, f"logit_softcap must be a positive finite float, or None for no cap, got {logit_softcap!r}")
    return sliding_window, float(logit_softcap)


def check_kv_cache(op: str, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   dtypes: tuple[torch.dtype, ...]) -> tuple[int, int, int]:
    """Caches [num_blocks, block_size, Hkv, D] matching query [..., Hq, D]; returns (block_size, Hkv, D)."""
    _check_cache_pair(op, k_cache, v_cache, "query", query, dtypes)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size & (block_size - 1) or block_size == 0:
        fail(op, f"block_size (k_cache.shape[1]) must be a power of two, got {block_size}")
    if query.shape[-1] != head_dim:
        fail(op, f"query head dim {query.shape[-1]} does not match k_cache head dim {head_dim}")
    num_heads = query.shape[-2]
    if num_heads % num_kv_heads:
        fail(op, f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    return block_size, num_kv_heads, head_dim


def check_decode(op: str, query, k_cache, v_cache, block_tables, context_lens, out,
                 dtypes: tuple[torch.dtype, ...]) -> None:
    check_tensor(op, "query", query, "[B, Hq, D]", dtypes)
    check_last_dim_contiguous(op, "query", query)
    check_kv_cache(op, query, k_cache, v_cache, dtypes)
    batch = query.shape[0]
    check_tensor(op, "block_tables", block_tables, "[B, max_blocks]", (torch.int32,))
    if block_tables.shape[0] != batch:
        fail(op, f"block_tables has {block_tables.shape[0]} rows but query has batch {batch}")
    check_last_dim_contiguous(op, "block_tables", block_tables)
    check_tensor(op, "context_lens", context_lens, "[B]", (torch.int32,))
    check_shape(op, "context_lens", context_lens, (batch,), "[B]")
    check_contiguous(op, "context_lens", context_lens)
    check_out(op, out, tuple(query.shape), query, "[B, Hq, D]")
    check_same_device(op, {"query": query, "k_cache": k_cache, "v_cache": v_cache,
                           "block_tables": block_tables, "context_lens": context_lens})


def check_prefill(op: str, query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                  max_seqlen_q, out, dtypes: tuple[torch.dtype, ...]) -> None:
    check_tensor(op, "query", query, "[T, Hq, D]", dtypes)
    check_last_dim_contiguous(op, "query", query)
    check_kv_cache(op, query, k_cache, v_cache, dtypes)
    check_tensor(op, "block_tables", block_tables, "[B, max_blocks]", (torch.int32,))
    check_last_dim_contiguous(op, "block_tables", block_tables)
    batch = block_tables.shape[0]
    check_tensor(op, "cu_seqlens_q", cu_seqlens_q, "[B+1]", (torch.int32,))
    check_shape(op, "cu_seqlens_q", cu_seqlens_q, (batch + 1,), "[B+1]")
    check_contiguous(op, "cu_seqlens_q", cu_seqlens_q)
    check_tensor(op, "context_lens", context_lens, "[B]", (torch.int32,))
    check_shape(op, "context_lens", context_lens, (batch,), "[B]")
    check_contiguous(op, "context_lens", context_lens)
    if not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        fail(op, f"max_seqlen_q must be a non-negative int, got {max_seqlen_q!r}")
    check_out(op, out, tuple(query.shape), query, "[T, Hq, D]")
    check_same_device(op, {"query": query, "k_cache": k_cache, "v_cache": v_cache,
                           "block_tables": block_tables, "cu_seqlens_q": cu_seqlens_q,
                           "context_lens": context_lens})


def check_chunk_kv(op: str, key, value, query: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Optional chunk keys / values of prefill attention: both or neither, [T, Hkv, D] with the
    query's token count and dtype, on its device."""
    if key is None and value is None:
        return
    if key is None or value is None:
        fail(op, "key and value must be given together")
    expected = (query.shape[0], k_cache.shape[2], query.shape[2])
    for name, t in (("key", key), ("value", value)):
        check_tensor(op, name, t, "[T, Hkv, D]", (query.dtype,))
        check_shape(op, name, t, expected, "[T, Hkv, D]")
        check_last_dim_contiguous(op, name, t)
    check_same_device(op, {"query": query, "key": key, "value": value})


def check_store_kv(op: str, key, value, k_cache, v_cache, slot_mapping,
                   dtypes: tuple[torch.dtype, ...]) -> None:
    check_tensor(op, "key", key, "[T, Hkv, D]", dtypes)
    check_shape(op, "value", value, tuple(key.shape), "key.shape")
    check_same_dtype(op, "value", value, "key", key)
    check_last_dim_contiguous(op, "key", key)
    check_last_dim_contiguous(op, "value", value)
    _check_cache_pair(op, k_cache, v_cache, "key", key, dtypes)
    if tuple(key.shape[1:]) != tuple(k_cache.shape[2:]):
        fail(op, f"key [T, Hkv, D] has (Hkv, D) = {tuple(key.shape[1:])} but k_cache has "
                 f"{tuple(k_cache.shape[2:])}")
    check_tensor(op, "slot_mapping", slot_mapping, "[T]", INDEX_DTYPES)
    check_shape(op, "slot_mapping", slot_mapping, (key.shape[0],), "[T]")
    check_contiguous(op, "slot_mapping", slot_mapping)
    check_same_device(op, {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache,
                           "slot_mapping": slot_mapping})
