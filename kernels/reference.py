"""PyTorch references of every kernel: same signatures, `_ref` suffix.

These run for real: the CPU engine calls them instead of the Triton kernels, and must stay
token-exact with Hugging Face there. So the math is plain and in float32 (float64 when given
float64, which is how the tests build ground truth), with Hugging Face's operation order and
rounding points (scores = (q @ k^T) * scale, softmax in float32, RMSNorm rounds the normalised
value to the input dtype before the weight multiply). Attention is vectorised over the batch
(decode) or over heads (prefill) so a small model runs quickly. Imports only torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import validation as v
from . import validation_moe as vm
from . import validation_ops as vo
# The FP8 references and constants live in reference_fp8.py; re-exported for the ops and the engine.
from .reference_fp8 import (FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE, fp8_matmul_few_rows_ref,  # noqa: F401
                            quantize_fp8_per_token_ref)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _cache_rows(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, scale: float,
                values: bool) -> torch.Tensor:
    """Rows `slots` (any shape) of a cache -> [*slots.shape, Hkv, D] in `dtype`. Key caches and
    16-bit value caches are [num_blocks, block_size, Hkv, D]; an FP8 value cache is
    [num_blocks, Hkv, D, block_size] (validation.v_cache_shape). FP8 rows are multiplied by
    their scale."""
    if cache.dtype != v.FP8_KV_DTYPE:
        _, _, num_kv_heads, head_dim = cache.shape
        return cache.view(-1, num_kv_heads, head_dim)[slots].to(dtype)
    # Indexing is not implemented for float8 on every device: gather the bytes, then reinterpret.
    raw = cache.view(torch.uint8)
    if values:
        block_size = raw.shape[3]
        rows = raw[slots // block_size, :, :, slots % block_size]
    else:
        _, _, num_kv_heads, head_dim = raw.shape
        rows = raw.view(-1, num_kv_heads, head_dim)[slots]
    return rows.view(v.FP8_KV_DTYPE).to(dtype) * scale


def quantize_kv_ref(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 cache stores for x: x * (1 / scale) in float32, saturated, rounded to nearest;
    NaN as 0 (see kernels/kv_store.py)."""
    scaled = (x.to(torch.float32) * v.fp32_reciprocal(scale)).nan_to_num(nan=0.0)
    return scaled.clamp(-v.FP8_E4M3_MAX, v.FP8_E4M3_MAX).to(v.FP8_KV_DTYPE)


def store_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> None:
    op = "store_kv_cache"
    v.check_store_kv(op, key, value, k_cache, v_cache, slot_mapping, v.REFERENCE_DTYPES)
    v.check_kv_scales(op, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    _, _, num_kv_heads, head_dim = k_cache.shape
    if k_cache.dtype != v.FP8_KV_DTYPE:
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = key[keep]
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = value[keep]
        return
    k_cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)[slots] = (
        quantize_kv_ref(key[keep], k_scale).view(torch.uint8))
    block_size = k_cache.shape[1]  # the value cache is [num_blocks, Hkv, D, block_size]
    v_cache.view(torch.uint8)[slots // block_size, :, :, slots % block_size] = (
        quantize_kv_ref(value[keep], v_scale).view(torch.uint8))


def paged_decode_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               out: torch.Tensor | None = None, *, k_scale: float = 1.0,
                               v_scale: float = 1.0, sliding_window: int | None = None,
                               logit_softcap: float | None = None, **_options) -> torch.Tensor:
    """`sliding_window` W: the query at position p = ctx - 1 sees keys p - W < k <= p (Hugging
    Face's sliding_window_overlay), and only those are gathered. `logit_softcap` C: scores
    become C * tanh(scores / C) after the scale, before the mask (gemma2's eager attention)."""
    op = "paged_decode_attention"
    v.check_decode(op, query, k_cache, v_cache, block_tables, context_lens, out, v.REFERENCE_DTYPES)
    v.check_kv_scales(op, k_scale, v_scale)
    window, softcap = v.check_window_softcap(op, sliding_window, logit_softcap)
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    compute = _compute_dtype(query.dtype)
    ctx = context_lens.long()
    max_len = int(ctx.max()) if batch else 0
    if max_len > block_tables.shape[1] * block_size:
        v.fail(op, f"context_lens.max() = {max_len} exceeds the block tables' "
                   f"{block_tables.shape[1]} blocks of {block_size}")
    result = torch.zeros(batch, num_heads, head_dim, dtype=compute, device=query.device)
    if max_len > 0:
        lo = (ctx - window).clamp(min=0) if window else torch.zeros_like(ctx)
        span = int((ctx - lo).max()) if window else max_len
        pos = lo[:, None] + torch.arange(span, device=query.device)[None, :]  # [B, L]
        valid = pos < ctx[:, None]
        pos = torch.where(valid, pos, 0)
        blocks = block_tables.long().gather(1, pos // block_size)
        slots = torch.where(valid, blocks * block_size + pos % block_size, 0)  # padding reads slot 0
        k = _cache_rows(k_cache, slots, compute, k_scale, values=False)
        k = k.permute(0, 2, 3, 1)  # [B, Hkv, D, L]
        # Padding positions read slot 0, which may hold anything: 0 * NaN would leak through p @ v.
        # Zero those rows in place (the gather made a fresh tensor); 2x cheaper than masked_fill.
        vals = _cache_rows(v_cache, slots, compute, v_scale, values=True)
        vals[~valid] = 0.0
        vals = vals.permute(0, 2, 1, 3)                                        # [B, Hkv, L, D]
        q = query.to(compute).view(batch, num_kv_heads, group, head_dim)
        scores = torch.matmul(q, k) * scale                                    # [B, Hkv, G, L]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        attn = torch.matmul(probs, vals).view(batch, num_heads, head_dim)
        result = torch.where((ctx > 0)[:, None, None], attn, result)  # empty context -> zeros
    if out is None:
        return result.to(query.dtype)
    out.copy_(result)
    return out


def paged_prefill_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                context_lens: torch.Tensor, max_seqlen_q: int, scale: float,
                                out: torch.Tensor | None = None, *, k_scale: float = 1.0,
                                v_scale: float = 1.0, key: torch.Tensor | None = None,
                                value: torch.Tensor | None = None, sliding_window: int | None = None,
                                logit_softcap: float | None = None, **_options) -> torch.Tensor:
    """`key` / `value` (the chunk's, as stored) are checked and not read: the cache holds them.
    `sliding_window` and `logit_softcap` as in paged_decode_attention_ref: the query at
    position p sees keys p - W < k <= p, and keys before the chunk's first window are not
    gathered."""
    op = "paged_prefill_attention"
    v.check_prefill(op, query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                    max_seqlen_q, out, v.REFERENCE_DTYPES)
    v.check_kv_scales(op, k_scale, v_scale)
    window, softcap = v.check_window_softcap(op, sliding_window, logit_softcap)
    v.check_chunk_kv(op, key, value, query, k_cache)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    compute = _compute_dtype(query.dtype)
    cu = cu_seqlens_q.tolist()
    ctx_lens = context_lens.tolist()
    # Rows past cu_seqlens_q[-1] are padding (a CUDA graph's fixed token count): not read, not written.
    if cu[0] != 0 or cu[-1] > num_tokens or any(a > b for a, b in zip(cu, cu[1:])):
        v.fail(op, f"cu_seqlens_q must rise from 0 to at most T = {num_tokens}, got {cu}")
    if out is None:
        out = torch.empty_like(query)
    for b, ctx in enumerate(ctx_lens):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len < 0 or q_len > max_seqlen_q or q_len > ctx:
            v.fail(op, f"sequence {b} has {q_len} query tokens, context {ctx} and "
                       f"max_seqlen_q {max_seqlen_q}: need 0 <= q_len <= min(max_seqlen_q, context)")
        if q_len == 0:
            continue
        if ctx > block_tables.shape[1] * block_size:
            v.fail(op, f"context_lens[{b}] = {ctx} exceeds the block tables' "
                       f"{block_tables.shape[1]} blocks of {block_size}")
        first = max(ctx - q_len - window + 1, 0) if window else 0  # the first query's window
        pos = torch.arange(first, ctx, device=query.device)
        slots = block_tables[b].long()[pos // block_size] * block_size + pos % block_size
        k = _cache_rows(k_cache, slots, compute, k_scale, values=False)
        k = k.permute(1, 2, 0)[:, None]  # [Hkv, 1, D, L]
        vals = _cache_rows(v_cache, slots, compute, v_scale, values=True)
        vals = vals.permute(1, 0, 2)[:, None]  # [Hkv, 1, L, D]
        q = query[start:end].to(compute).view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.matmul(q, k) * scale                                     # [Hkv, G, q, L]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = ctx - q_len + torch.arange(q_len, device=query.device)
        hidden = pos[None, :] > q_pos[:, None]
        if window:
            hidden = hidden | (pos[None, :] <= q_pos[:, None] - window)
        scores = scores.masked_fill(hidden, float("-inf"))
        attn = torch.matmul(torch.softmax(scores, dim=-1), vals)                # [Hkv, G, q, D]
        out[start:end] = attn.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(out.dtype)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    vo.check_rms_norm("rms_norm", x, weight, residual, v.REFERENCE_DTYPES)
    if x.dim() == 3:  # a split-K matmul's float32 slices: their sum, rounded as split_k.finish rounds it
        x = x.sum(0).to(residual.dtype)
    if residual is not None:
        x = x + residual  # rounded to x.dtype, as Hugging Face's residual stream is
    h = x.to(_compute_dtype(x.dtype))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight * h.to(x.dtype)).to(x.dtype)
    return out if residual is None else (out, x)


def apply_rotary_emb_ref(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor, head_size: int | None = None,
                         q_norm_weight: torch.Tensor | None = None,
                         k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                         value: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                         v_cache: torch.Tensor | None = None,
                         slot_mapping: torch.Tensor | None = None, k_scale: float = 1.0,
                         v_scale: float = 1.0) -> None:
    """In place, neox / rotate-half style: the first rotary_dim dims of each head rotate. With
    the norm weights, each head is first RMS-normalised (rms_norm_ref over head_size). With the
    cache arguments, the rotated keys and the values are then stored (store_kv_cache_ref)."""
    head_size, rotary_dim, num_heads, num_kv_heads = vo.check_rotary(
        "apply_rotary_emb", query, key, positions, cos_sin_cache, head_size, v.REFERENCE_DTYPES)
    store = vo.check_rotary_store("apply_rotary_emb", key, value, k_cache, v_cache, slot_mapping,
                                 k_scale, v_scale, head_size, v.REFERENCE_DTYPES)
    num_tokens = query.shape[0]
    if vo.check_head_norm("apply_rotary_emb", query, q_norm_weight, k_norm_weight, head_size, rotary_dim):
        for x, heads, weight in ((query, num_heads, q_norm_weight), (key, num_kv_heads, k_norm_weight)):
            view = x.view(num_tokens, heads, head_size)
            view.copy_(rms_norm_ref(view.reshape(-1, head_size), weight, eps).view(view.shape))
    compute = _compute_dtype(query.dtype)
    cos, sin = cos_sin_cache[positions.long()].to(compute).chunk(2, dim=-1)  # [T, rotary_dim/2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = rotary_dim // 2
    for x, heads in ((query, num_heads), (key, num_kv_heads)):
        rot = x.view(num_tokens, heads, head_size)[..., :rotary_dim]
        x1, x2 = rot[..., :half].to(compute), rot[..., half:].to(compute)
        rot.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
    if store:
        shape = (num_tokens, num_kv_heads, head_size)
        store_kv_cache_ref(key.view(shape), value.view(shape), k_cache, v_cache, slot_mapping,
                           k_scale, v_scale)


def silu_and_mul_ref(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    inter = vo.check_silu_and_mul("silu_and_mul", x, out, v.REFERENCE_DTYPES)
    if x.dim() == 3:  # a split-K matmul's slices: their sum, rounded as split_k.finish rounds it
        x = x.sum(0).to(out.dtype)
    result = F.silu(x[:, :inter]) * x[:, inter:]
    if out is None:
        return result
    out.copy_(result)
    return out


def rms_norm_quant_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                           residual: torch.Tensor | None = None):
    """rms_norm_ref's output quantized per token: (q, scale) or, with residual, (q, scale, x + residual)."""
    vo.check_rms_norm("rms_norm_quant_fp8", x, weight, residual, v.REFERENCE_DTYPES)
    normed = rms_norm_ref(x, weight, eps, residual)
    if residual is None:
        return quantize_fp8_per_token_ref(normed)
    return (*quantize_fp8_per_token_ref(normed[0]), normed[1])


def silu_and_mul_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul_ref's output quantized per token: (q, scale)."""
    vo.check_silu_and_mul("silu_and_mul_quant_fp8", x, None, v.REFERENCE_DTYPES)
    return quantize_fp8_per_token_ref(silu_and_mul_ref(x))


def greedy_sample_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (first argmax per row int64 [R], its log-softmax value [R], float32;
    float64 for float64 logits)."""
    vo.check_greedy_sample("greedy_sample", logits, v.REFERENCE_DTYPES)
    lf = logits.to(_compute_dtype(logits.dtype))
    token_ids = lf.argmax(dim=-1)
    logprobs = torch.log_softmax(lf, dim=-1).gather(1, token_ids[:, None]).squeeze(1)
    return token_ids, logprobs


def apply_penalties_ref(logits: torch.Tensor, rows: torch.Tensor | None, slots: torch.Tensor,
                        output_counts: torch.Tensor, in_prompt: torch.Tensor,
                        repetition: torch.Tensor | None, frequency: torch.Tensor | None,
                        presence: torch.Tensor | None) -> torch.Tensor:
    """kernels.apply_penalties in PyTorch ops (dense over the rows that have penalties)."""
    vo.check_penalties("apply_penalties", logits, rows, slots, output_counts, in_prompt, repetition,
                      frequency, presence)
    if slots.shape[0] == 0 or (repetition is None and frequency is None):
        return logits
    x = logits if rows is None else logits[rows]  # (a copy when some rows only)
    counts = output_counts[slots]
    if repetition is not None:
        rep = repetition[:, None]
        seen = (counts > 0) | in_prompt[slots]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if frequency is not None:
        x = x - (frequency[:, None] * counts + presence[:, None] * (counts > 0))
    if rows is None:
        logits.copy_(x)
    else:
        logits[rows] = x
    return logits


def add_lora_ref(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
    """LoRA deltas of a batch whose rows use different adapters, added to y in place: each row t
    with slots[t] = s >= 0 gets (x[t] @ lora_a[s].T) @ lora_b[s].T; rows with -1 are left alone.
    Rounding as kernels/lora.py: the shrink in float32, rounded to x.dtype, the expand in float32
    added to y in float32, then rounded once."""
    vo.check_add_lora("add_lora", y, x, lora_a, lora_b, slots, v.REFERENCE_DTYPES)
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    for s in range(lora_a.shape[0]):
        rows = (slots == s).nonzero().flatten()
        if rows.numel() == 0:
            continue
        u = (x[rows].to(f) @ lora_a[s].to(f).t()).to(x.dtype)
        y[rows] = (y[rows].to(f) + u.to(f) @ lora_b[s].to(f).t()).to(y.dtype)
    return y


def w4a16_dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         group_size: int, perm: torch.Tensor | None = None, *, bits: int = 4,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight that kernels/w4a16.py's layout holds, columns in the activations' order
    (perm undone), in `dtype`: (q - zero) * scale, exact in float32 for fp16 scales."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    q = (qweight[:, :, None] >> shifts) & ((1 << bits) - 1)          # [K, N / P, P]
    q = q.reshape(qweight.shape[0], qweight.shape[1] * per_word)      # [K, N]
    return w4a16_dequantize_values(q, scales, zeros, group_size, perm, dtype)


def w4a16_dequantize_values(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                       perm: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Values [K, N] (row k multiplies x[:, perm[k]]) -> the [N, K] weight in the activations'
    order, in `dtype`: (q - zero) * scale, exact in float32 for fp16 scales."""
    groups = torch.arange(q.shape[0], device=q.device) // group_size
    compute = _compute_dtype(dtype)
    w = (q.to(compute) - zeros.to(compute)[groups]) * scales.to(compute)[groups]
    if perm is not None:
        w = torch.empty_like(w).index_copy_(0, perm.long(), w)
    return w.t().to(dtype).contiguous()  # F.linear's operand as a checkpoint's [N, K] weight


def w4a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor, group_size: int, perm: torch.Tensor | None = None, *,
                     bits: int = 4, reduce: bool = True, **_options) -> torch.Tensor:
    """x @ W^T with W dequantized in float32 (float64 for float64 x) in the activations' order:
    the same matrix, and so the same sums, as F.linear on a dequantized checkpoint (whole: see
    fp8_matmul_few_rows_ref on `reduce`)."""
    vo.check_w4a16("w4a16_matmul", x, qweight, scales, zeros, group_size, bits, perm,
                  v.REFERENCE_DTYPES)
    compute = _compute_dtype(x.dtype)
    w = w4a16_dequantize_ref(qweight, scales, zeros, group_size, perm, bits=bits, dtype=compute)
    return F.linear(x.to(compute), w).to(x.dtype)


def w4a16_fragment_linear_ref(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                              group_size: int, perm: torch.Tensor | None = None, *, reduce: bool = True,
                              **_options) -> torch.Tensor:
    """w4a16_matmul_ref for words in kernels/w4a16_fragment.py's order."""
    from .w4a16_fragment_layout import FragmentConfig, check_arguments, unpack_fragment
    check_arguments(x, words, scales, zeros, group_size, perm, FragmentConfig(), v.REFERENCE_DTYPES)
    compute = _compute_dtype(x.dtype)
    w = w4a16_dequantize_values(unpack_fragment(words), scales, zeros, group_size, perm, compute)
    return F.linear(x.to(compute), w).to(x.dtype)


def _moe_weight(w: torch.Tensor, scale: torch.Tensor | None, kind: int, e: int, compute: torch.dtype,
                dtype: torch.dtype) -> torch.Tensor:
    """Expert e's [N, K] weight in `compute`: 16/32-bit as stored; FP8 widened to the activations'
    dtype (exact), times its per-channel or 128 x 128 block scales."""
    if kind == 0:
        return w[e].to(compute)
    we = w[e].to(dtype).to(compute)
    if kind == 1:
        return we * scale[e].to(compute)[:, None]
    n, k = we.shape
    block = vm.FP8_BLOCK
    s = scale[e].to(compute).repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return we * s


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, **_options) -> torch.Tensor:
    """Mixture of experts, one expert at a time: for each expert, the (token, k) pairs routed to
    it (an expert without pairs is skipped), gate and up rounded to x.dtype, silu rounded, their
    product rounded (Hugging Face's rounding points), the down projection in float32 (float64 for
    float64 x) times the routing weight, summed over k in float32 and rounded once, as
    kernels/moe.py does."""
    k13, k2 = vm.check_fused_moe("fused_moe", x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale,
                                 v.REFERENCE_DTYPES)
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if topk_ids.numel() and not bool(((topk_ids >= 0) & (topk_ids < num_experts)).all()):
        v.fail("fused_moe", f"topk_ids must lie in [0, {num_experts}), got values from "
                            f"{int(topk_ids.min())} to {int(topk_ids.max())}")
    compute = _compute_dtype(x.dtype)
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1).to(compute)
    acc = torch.zeros(x.shape[0], x.shape[1], dtype=compute, device=x.device)
    for e in range(num_experts):
        pairs = (flat == e).nonzero().flatten()
        if pairs.numel() == 0:
            continue
        tokens = pairs // top_k
        xe = x[tokens].to(compute)
        gate_up = xe @ _moe_weight(w13, w13_scale, k13, e, compute, x.dtype).t()
        gate = F.silu(gate_up[:, :inter].to(x.dtype).to(compute)).to(x.dtype)
        h = (gate.to(compute) * gate_up[:, inter:].to(x.dtype).to(compute)).to(x.dtype)
        down = h.to(compute) @ _moe_weight(w2, w2_scale, k2, e, compute, x.dtype).t()
        acc.index_add_(0, tokens, down * weights[pairs][:, None])
    return acc.to(x.dtype)


def topk_softmax_ref(logits: torch.Tensor, top_k: int, renormalize: bool,
                     round_to: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's selection as Hugging Face's MoE blocks compute it: softmax in float32, top k,
    renormalised if asked, rounded to `round_to` if given; (weights float32, ids int32)."""
    vm.check_topk_softmax("topk_softmax", logits, top_k, round_to)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_to is not None:
        weights = weights.to(round_to)
    return weights.float(), ids.to(torch.int32)
