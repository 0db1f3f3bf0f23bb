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


def check_rms_norm(op: str, x, weight, residual, dtypes: tuple[torch.dtype, ...]) -> None:
    check_tensor(op, "x", x, "[T, H]", dtypes)
    check_last_dim_contiguous(op, "x", x)
    check_tensor(op, "weight", weight, "[H]", dtypes)
    check_shape(op, "weight", weight, (x.shape[1],), "[H]")
    check_contiguous(op, "weight", weight)
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        check_tensor(op, "residual", residual, "[T, H]", dtypes)
        check_shape(op, "residual", residual, tuple(x.shape), "x.shape")
        check_same_dtype(op, "residual", residual, "x", x)
        check_last_dim_contiguous(op, "residual", residual)
        tensors["residual"] = residual
    check_same_device(op, tensors)


def check_rotary(op: str, query, key, positions, cos_sin_cache, head_size: int | None,
                 dtypes: tuple[torch.dtype, ...]) -> tuple[int, int, int, int]:
    """Returns (head_size, rotary_dim, Hq, Hkv) after checking [T, H*D] or [T, H, D] inputs."""
    if not isinstance(query, torch.Tensor) or query.dim() not in (2, 3):
        shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        fail(op, f"query must be [T, Hq*D] or [T, Hq, D], got {shape}")
    layout = "[T, Hq, D]" if query.dim() == 3 else "[T, Hq*D]"
    check_tensor(op, "query", query, layout, dtypes)
    check_tensor(op, "key", key, layout.replace("Hq", "Hkv"), dtypes)
    check_same_dtype(op, "key", key, "query", query)
    check_last_dim_contiguous(op, "query", query)
    check_last_dim_contiguous(op, "key", key)
    num_tokens = query.shape[0]
    if key.shape[0] != num_tokens:
        fail(op, f"key has {key.shape[0]} tokens but query has {num_tokens}")
    check_tensor(op, "positions", positions, "[T]", INDEX_DTYPES)
    check_shape(op, "positions", positions, (num_tokens,), "[T]")
    check_contiguous(op, "positions", positions)
    check_tensor(op, "cos_sin_cache", cos_sin_cache, "[max_position, rotary_dim]", (torch.float32,))
    check_contiguous(op, "cos_sin_cache", cos_sin_cache)
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2:
        fail(op, f"rotary_dim (cos_sin_cache.shape[1]) must be even, got {rotary_dim}")
    if query.dim() == 3:
        if key.shape[2] != query.shape[2]:
            fail(op, f"key head size {key.shape[2]} does not match query head size {query.shape[2]}")
        if head_size is not None and head_size != query.shape[2]:
            fail(op, f"head_size={head_size} does not match query.shape[2]={query.shape[2]}")
        head_size = query.shape[2]
        num_heads, num_kv_heads = query.shape[1], key.shape[1]
    else:
        head_size = rotary_dim if head_size is None else head_size
        if query.shape[1] % head_size or key.shape[1] % head_size:
            fail(op, f"query width {query.shape[1]} and key width {key.shape[1]} must be multiples "
                     f"of head_size {head_size}")
        num_heads, num_kv_heads = query.shape[1] // head_size, key.shape[1] // head_size
        if query.stride(0) < query.shape[1] or key.stride(0) < key.shape[1]:
            fail(op, "query and key rows must not overlap")
    if rotary_dim > head_size:
        fail(op, f"rotary_dim {rotary_dim} is larger than head_size {head_size}")
    check_same_device(op, {"query": query, "key": key, "positions": positions,
                           "cos_sin_cache": cos_sin_cache})
    return head_size, rotary_dim, num_heads, num_kv_heads


def check_head_norm(op: str, query, q_norm_weight, k_norm_weight, head_size: int, rotary_dim: int) -> bool:
    """Per-head RMSNorm weights for apply_rotary_emb: both or neither, [head_size] each, in the
    query's dtype and device, and only with a full rotary_dim. Returns whether they are given."""
    if q_norm_weight is None and k_norm_weight is None:
        return False
    if q_norm_weight is None or k_norm_weight is None:
        fail(op, "q_norm_weight and k_norm_weight must be given together")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        check_tensor(op, name, w, "[head_size]", (query.dtype,))
        check_shape(op, name, w, (head_size,), "[head_size]")
        check_contiguous(op, name, w)
    if rotary_dim != head_size:
        fail(op, f"per-head norms need rotary_dim == head_size, got {rotary_dim} and {head_size}")
    check_same_device(op, {"query": query, "q_norm_weight": q_norm_weight, "k_norm_weight": k_norm_weight})
    return True


def check_rotary_store(op: str, key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                       head_size: int, dtypes: tuple[torch.dtype, ...]) -> bool:
    """The KV cache that apply_rotary_emb may also store into: value (key's layout), k_cache,
    v_cache and slot_mapping all or none, then store_kv_cache's checks on [T, Hkv, D] views.
    Returns whether they are given."""
    given = {"value": value, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    if all(t is None for t in given.values()):
        return False
    missing = [name for name, t in given.items() if t is None]
    if missing:
        fail(op, f"value, k_cache, v_cache and slot_mapping must be given together (missing: "
                 f"{', '.join(missing)})")
    layout = "[T, Hkv, D]" if key.dim() == 3 else "[T, Hkv*D]"
    check_tensor(op, "value", value, layout, dtypes)
    check_shape(op, "value", value, tuple(key.shape), "key.shape")
    check_last_dim_contiguous(op, "value", value)
    num_tokens = key.shape[0]
    heads = key.shape[1] if key.dim() == 3 else key.shape[1] // head_size
    check_store_kv(op, key.view(num_tokens, heads, head_size), value.view(num_tokens, heads, head_size),
                   k_cache, v_cache, slot_mapping, dtypes)
    check_kv_scales(op, k_scale, v_scale)
    return True


def check_silu_and_mul(op: str, x, out, dtypes: tuple[torch.dtype, ...]) -> int:
    check_tensor(op, "x", x, "[T, 2*I]", dtypes)
    check_last_dim_contiguous(op, "x", x)
    if x.shape[1] % 2:
        fail(op, f"x last dimension must be even (cat(gate, up)), got {x.shape[1]}")
    inter = x.shape[1] // 2
    if out is not None:
        check_tensor(op, "out", out, "[T, I]", (x.dtype,))
        check_shape(op, "out", out, (x.shape[0], inter), "[T, I]")
        check_last_dim_contiguous(op, "out", out)
        check_same_device(op, {"x": x, "out": out})
    return inter


def check_quantize(op: str, x, dtypes: tuple[torch.dtype, ...]) -> None:
    check_tensor(op, "x", x, "[T, K]", dtypes)
    check_last_dim_contiguous(op, "x", x)


def check_greedy_sample(op: str, logits, dtypes: tuple[torch.dtype, ...]) -> None:
    check_tensor(op, "logits", logits, "[R, V]", dtypes)
    check_last_dim_contiguous(op, "logits", logits)
    if logits.shape[1] == 0:
        fail(op, f"logits must have at least one column, got shape {tuple(logits.shape)}")


def check_fp8_matmul(op: str, x_q, x_scale, weight, weight_scale, out_dtype: torch.dtype,
                     max_rows: int) -> None:
    fp8 = (torch.float8_e4m3fn,)
    check_tensor(op, "x_q", x_q, "[M, K]", fp8)
    check_last_dim_contiguous(op, "x_q", x_q)
    if x_q.shape[0] > max_rows:
        fail(op, f"x_q may have at most {max_rows} rows (torch._scaled_mm serves more), "
                 f"got {x_q.shape[0]}")
    check_tensor(op, "weight", weight, "[N, K]", fp8)
    check_last_dim_contiguous(op, "weight", weight)
    if weight.shape[1] != x_q.shape[1]:
        fail(op, f"weight [N, K] has K = {weight.shape[1]} but x_q has K = {x_q.shape[1]}")
    check_tensor(op, "x_scale", x_scale, "[M, 1]", (torch.float32,))
    check_shape(op, "x_scale", x_scale, (x_q.shape[0], 1), "[M, 1]")
    check_contiguous(op, "x_scale", x_scale)
    check_tensor(op, "weight_scale", weight_scale, "[1, N]", (torch.float32,))
    check_shape(op, "weight_scale", weight_scale, (1, weight.shape[0]), "[1, N]")
    check_contiguous(op, "weight_scale", weight_scale)
    if out_dtype not in HALF_AND_FLOAT:
        fail(op, f"out_dtype must be {_dtype_names(HALF_AND_FLOAT)}, got {out_dtype}")
    check_same_device(op, {"x_q": x_q, "x_scale": x_scale, "weight": weight,
                           "weight_scale": weight_scale})


def check_add_lora(op: str, y, x, lora_a, lora_b, slots, dtypes: tuple[torch.dtype, ...]) -> None:
    """y [T, N] += per row t with slots[t] = s >= 0: (x[t] @ lora_a[s].T) @ lora_b[s].T."""
    check_tensor(op, "x", x, "[T, K]", dtypes)
    check_tensor(op, "y", y, "[T, N]", (x.dtype,))
    check_tensor(op, "lora_a", lora_a, "[S, R, K]", (x.dtype,))
    check_tensor(op, "lora_b", lora_b, "[S, N, R]", (x.dtype,))
    check_tensor(op, "slots", slots, "[T]", INDEX_DTYPES)
    t, k = x.shape
    s, r, _ = lora_a.shape
    check_shape(op, "y", y, (t, lora_b.shape[1]), "[T, N]")
    check_shape(op, "lora_a", lora_a, (s, r, k), "[S, R, K]")
    check_shape(op, "lora_b", lora_b, (s, y.shape[1], r), "[S, N, R]")
    check_shape(op, "slots", slots, (t,), "[T]")
    for name, tensor in (("x", x), ("y", y)):
        check_last_dim_contiguous(op, name, tensor)
    for name, tensor in (("lora_a", lora_a), ("lora_b", lora_b), ("slots", slots)):
        check_contiguous(op, name, tensor)
    check_same_device(op, {"x": x, "y": y, "lora_a": lora_a, "lora_b": lora_b, "slots": slots})


def check_penalties(op: str, logits, rows, slots, output_counts, in_prompt, repetition, frequency,
                    presence) -> None:
    check_tensor(op, "logits", logits, "[R, V]", (torch.float32,))
    check_last_dim_contiguous(op, "logits", logits)
    check_tensor(op, "slots", slots, "[Q]", (torch.int64, torch.int32))
    num = slots.shape[0]
    if rows is not None:
        check_tensor(op, "rows", rows, "[Q]", (torch.int64, torch.int32))
        check_shape(op, "rows", rows, (num,), "[Q]")
    elif num != logits.shape[0]:
        fail(op, f"slots must have one entry per logits row when rows is None, got {num} for "
                 f"{logits.shape[0]} rows")
    check_tensor(op, "output_counts", output_counts, "[S, V]", (torch.int16, torch.int32))
    check_tensor(op, "in_prompt", in_prompt, "[S, V]", (torch.bool,))
    for name, t in (("output_counts", output_counts), ("in_prompt", in_prompt)):
        check_last_dim_contiguous(op, name, t)
        if t.shape[1] != logits.shape[1]:
            fail(op, f"{name} must have the logits' {logits.shape[1]} columns, got shape {tuple(t.shape)}")
    if in_prompt.shape[0] != output_counts.shape[0]:
        fail(op, f"in_prompt must have output_counts' {output_counts.shape[0]} slots, got {in_prompt.shape[0]}")
    if (frequency is None) != (presence is None):
        fail(op, "frequency and presence must be given together")
    for name, t in (("repetition", repetition), ("frequency", frequency), ("presence", presence)):
        if t is not None:
            check_tensor(op, name, t, "[Q]", (torch.float32,))
            check_shape(op, name, t, (num,), "[Q]")
    check_same_device(op, {k: t for k, t in (("logits", logits), ("rows", rows), ("slots", slots),
                                             ("output_counts", output_counts), ("in_prompt", in_prompt),
                                             ("repetition", repetition), ("frequency", frequency),
                                             ("presence", presence)) if t is not None})


def check_w4a16(op: str, x, qweight, scales, zeros, group_size: int, bits: int, perm,
                dtypes: tuple[torch.dtype, ...]) -> None:
    """The packed layout of kernels/w4a16.py: qweight [K, N * bits / 32] int32 (column n in bits
    (n % (32 / bits)) * bits of its word), scales and zeros [K / group_size, N], perm [K] or None."""
    if bits not in (4, 8):
        fail(op, f"bits must be 4 or 8, got {bits}")
    check_tensor(op, "x", x, "[M, K]", dtypes)
    check_last_dim_contiguous(op, "x", x)
    check_tensor(op, "qweight", qweight, "[K, N * bits / 32]", (torch.int32,))
    check_contiguous(op, "qweight", qweight)
    k = x.shape[1]
    if qweight.shape[0] != k:
        fail(op, f"qweight [K, N * bits / 32] has K = {qweight.shape[0]} but x has K = {k}")
    n = qweight.shape[1] * (32 // bits)
    if not isinstance(group_size, int) or group_size < 16 or group_size & (group_size - 1) and group_size != k:
        fail(op, f"group_size must be a power of two of at least 16, or K, got {group_size}")
    if k % group_size:
        fail(op, f"K = {k} is not a multiple of group_size {group_size}")
    check_tensor(op, "scales", scales, "[G, N]", HALF_AND_FLOAT)
    check_shape(op, "scales", scales, (k // group_size, n), "[K / group_size, N]")
    check_contiguous(op, "scales", scales)
    check_tensor(op, "zeros", zeros, "[G, N]", HALF_AND_FLOAT)
    check_shape(op, "zeros", zeros, (k // group_size, n), "[K / group_size, N]")
    check_contiguous(op, "zeros", zeros)
    tensors = {"x": x, "qweight": qweight, "scales": scales, "zeros": zeros}
    if perm is not None:
        check_tensor(op, "perm", perm, "[K]", (torch.int32,))
        check_shape(op, "perm", perm, (k,), "[K]")
        check_contiguous(op, "perm", perm)
        tensors["perm"] = perm
    check_same_device(op, tensors)
