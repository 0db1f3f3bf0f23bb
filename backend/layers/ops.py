"""Dispatch to the Triton kernels on CUDA and to their PyTorch references elsewhere."""
from __future__ import annotations

import torch

import kernels
from kernels import reference


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda


def store_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    fn = kernels.store_kv_cache if _on_gpu(key) else reference.store_kv_cache_ref
    fn(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, out=None,
                           max_context_len=None, k_scale=1.0, v_scale=1.0, sliding_window=None,
                           logit_softcap=None):
    """sliding_window / logit_softcap: None for full-context, uncapped attention."""
    if _on_gpu(query):
        return kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens,
                                              scale, out=out, max_context_len=max_context_len,
                                              k_scale=k_scale, v_scale=v_scale,
                                              sliding_window=sliding_window, logit_softcap=logit_softcap)
    return reference.paged_decode_attention_ref(query, k_cache, v_cache, block_tables,
                                                context_lens, scale, out=out, k_scale=k_scale,
                                                v_scale=v_scale, sliding_window=sliding_window,
                                                logit_softcap=logit_softcap)


def paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                            max_seqlen_q, scale, out=None, k_scale=1.0, v_scale=1.0, key=None,
                            value=None, sliding_window=None, logit_softcap=None):
    fn = kernels.paged_prefill_attention if _on_gpu(query) else reference.paged_prefill_attention_ref
    return fn(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
              scale, out=out, k_scale=k_scale, v_scale=v_scale, key=key, value=value,
              sliding_window=sliding_window, logit_softcap=logit_softcap)


def rms_norm(x, weight, eps, residual=None):
    fn = kernels.rms_norm if _on_gpu(x) else reference.rms_norm_ref
    return fn(x, weight, eps, residual)


def apply_rotary_emb(query, key, positions, cos_sin_cache, head_size=None, q_norm_weight=None,
                     k_norm_weight=None, eps=1e-6, **kv_store) -> None:
    """kv_store: value, k_cache, v_cache, slot_mapping, k_scale, v_scale (rotate and store in one
    pass), or nothing."""
    fn = kernels.apply_rotary_emb if _on_gpu(query) else reference.apply_rotary_emb_ref
    fn(query, key, positions, cos_sin_cache, head_size, q_norm_weight, k_norm_weight, eps, **kv_store)


def silu_and_mul(x):
    fn = kernels.silu_and_mul if _on_gpu(x) else reference.silu_and_mul_ref
    return fn(x)


def quantize_fp8_per_token(x):
    fn = kernels.quantize_fp8_per_token if _on_gpu(x) else reference.quantize_fp8_per_token_ref
    return fn(x)


def greedy_sample(logits):
    fn = kernels.greedy_sample if _on_gpu(logits) else reference.greedy_sample_ref
    return fn(logits)


def apply_penalties(logits, rows, slots, output_counts, in_prompt, repetition, frequency, presence):
    fn = kernels.apply_penalties if _on_gpu(logits) else reference.apply_penalties_ref
    return fn(logits, rows, slots, output_counts, in_prompt, repetition, frequency, presence)


def add_lora(y, x, lora_a, lora_b, slots):
    fn = kernels.add_lora if _on_gpu(x) else reference.add_lora_ref
    return fn(y, x, lora_a, lora_b, slots)


def fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None):
    fn = kernels.fused_moe if _on_gpu(x) else reference.fused_moe_ref
    return fn(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)


def topk_softmax(logits, top_k, renormalize, round_to=None):
    fn = kernels.topk_softmax if _on_gpu(logits) else reference.topk_softmax_ref
    return fn(logits, top_k, renormalize, round_to)
