"""Argument checks of the element-wise, norm, rotary, sampling, quantization and LoRA
kernels (the attention and KV-cache checks, and the shared helpers, are in validation.py).
Every failed check raises ValueError("<op>: <what is wrong>, got <what was passed>")."""

from __future__ import annotations

import torch

from .validation import (HALF_AND_FLOAT, INDEX_DTYPES, check_store_kv, _dtype_names, check_contiguous, check_kv_scales,
                         check_last_dim_contiguous, check_same_device, check_same_dtype, check_shape,
                         check_tensor, fail)


def _check_x_or_slices(op: str, x, width: str, dtypes: tuple[torch.dtype, ...], other: str, given) -> bool:
    """x [T, width] in dtypes, or a split-K matmul's float32 slices [S, T, width], which need
    `other` (whose dtype the sum is rounded to) given; True for slices."""
    sliced = isinstance(x, torch.Tensor) and x.dim() == 3
    if sliced:
        check_tensor(op, "x", x, f"[S, T, {width}]", (torch.float32,))
        if given is None:
            name = other.removeprefix("the ")
            fail(op, f"x as [S, T, {width}] slices needs {other} (its dtype is the sum's), got {name}=None")
    else:
        check_tensor(op, "x", x, f"[T, {width}]", dtypes)
    check_last_dim_contiguous(op, "x", x)
    return sliced


def check_rms_norm(op: str, x, weight, residual, dtypes: tuple[torch.dtype, ...]) -> None:
    """x [T, H], or a split-K matmul's float32 slices [S, T, H] (their sum is x; then residual,
    whose dtype the sum is rounded to, must be given)."""
    sliced = _check_x_or_slices(op, x, "H", dtypes, "the residual", residual)
    check_tensor(op, "weight", weight, "[H]", dtypes)
    check_shape(op, "weight", weight, (x.shape[-1],), "[H]")
    check_contiguous(op, "weight", weight)
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        check_tensor(op, "residual", residual, "[T, H]", dtypes)
        check_shape(op, "residual", residual, tuple(x.shape[-2:]), "x.shape[1:]" if sliced else "x.shape")
        if not sliced:
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
    """x [T, 2*I], or a split-K matmul's float32 slices [S, T, 2*I] with `out` given (its dtype
    is the sum's); returns I."""
    sliced = _check_x_or_slices(op, x, "2*I", dtypes, "out", out)
    if x.shape[-1] % 2:
        fail(op, f"x last dimension must be even (cat(gate, up)), got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    if out is not None:
        check_tensor(op, "out", out, "[T, I]", dtypes if sliced else (x.dtype,))
        check_shape(op, "out", out, (x.shape[-2], inter), "[T, I]")
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

