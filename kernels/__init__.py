"""Tritium's GPU kernels (OpenAI Triton) behind the API of docs/architecture.md.

Each function checks its arguments (ValueError naming the argument) and runs a Triton kernel on
CUDA tensors, or on CPU tensors when the process imported Triton with TRITON_INTERPRET=1 (tests).
The plain-PyTorch equivalents are in `kernels.reference` (`<name>_ref`): the CPU engine uses those.

Triton is imported on the first kernel call, not here, because Triton fixes interpreter mode at
import: importing `kernels` (as backend/ does) must not decide it for the rest of the process.
Optional keyword-only arguments (`config=`, `num_warps=`, ...) are for the benchmark's sweep.
"""

from __future__ import annotations

from importlib import import_module

import torch

__all__ = ["store_kv_cache", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
           "apply_rotary_emb", "silu_and_mul", "quantize_fp8_per_token", "fp8_matmul_few_rows",
           "greedy_sample", "apply_penalties", "add_lora", "w4a16_matmul", "fused_moe",
           "moe_align_block_size", "topk_softmax"]

# fp8_matmul_few_rows serves at most this many rows (one MMA tile); more go to torch._scaled_mm.
FP8_MATMUL_MAX_ROWS = 16


def _impl(module: str, name: str):
    return getattr(import_module(f"kernels.{module}"), name)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0, **options) -> None:
    _impl("kv_store", "store_kv_cache")(key, value, k_cache, v_cache, slot_mapping, k_scale,
                                        v_scale, **options)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, *, k_scale: float = 1.0,
                           v_scale: float = 1.0, sliding_window: int | None = None,
                           logit_softcap: float | None = None, **options) -> torch.Tensor:
    """sliding_window W: the query at position p sees keys p - W < k <= p (None or 0: all);
    logit_softcap C: scores become C * tanh(scores / C) before the softmax (None: no cap)."""
    return _impl("decode_attention", "paged_decode_attention")(
        query, k_cache, v_cache, block_tables, context_lens, scale, out, k_scale=k_scale,
        v_scale=v_scale, sliding_window=sliding_window, logit_softcap=logit_softcap, **options)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, max_seqlen_q: int, scale: float,
                            out: torch.Tensor | None = None, *, k_scale: float = 1.0,
                            v_scale: float = 1.0, sliding_window: int | None = None,
                            logit_softcap: float | None = None, **options) -> torch.Tensor:
    """sliding_window and logit_softcap as in paged_decode_attention."""
    return _impl("prefill_attention", "paged_prefill_attention")(
        query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, scale, out,
        k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
        logit_softcap=logit_softcap, **options)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, **options):
    return _impl("norm", "rms_norm")(x, weight, eps, residual, **options)


def apply_rotary_emb(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int | None = None,
                     q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                     eps: float = 1e-6, *, value: torch.Tensor | None = None,
                     k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                     slot_mapping: torch.Tensor | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0, **options) -> None:
    _impl("rotary", "apply_rotary_emb")(query, key, positions, cos_sin_cache, head_size,
                                        q_norm_weight, k_norm_weight, eps, value=value,
                                        k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
                                        k_scale=k_scale, v_scale=v_scale, **options)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, **options) -> torch.Tensor:
    return _impl("activation", "silu_and_mul")(x, out, **options)


def quantize_fp8_per_token(x: torch.Tensor, **options) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl("quant", "quantize_fp8_per_token")(x, **options)


def fp8_matmul_few_rows(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                        weight_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                        **options) -> torch.Tensor:
    return _impl("fp8_matmul", "fp8_matmul_few_rows")(x_q, x_scale, weight, weight_scale, out_dtype,
                                                      **options)


def greedy_sample(logits: torch.Tensor, **options) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl("sampling", "greedy_sample")(logits, **options)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor | None, slots: torch.Tensor,
                    output_counts: torch.Tensor, in_prompt: torch.Tensor,
                    repetition: torch.Tensor | None, frequency: torch.Tensor | None,
                    presence: torch.Tensor | None, **options) -> torch.Tensor:
    return _impl("sampling", "apply_penalties")(logits, rows, slots, output_counts, in_prompt, repetition,
                                                frequency, presence, **options)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             slots: torch.Tensor, **options) -> torch.Tensor:
    return _impl("lora", "add_lora")(y, x, lora_a, lora_b, slots, **options)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, perm: torch.Tensor | None = None, *, bits: int = 4,
                 **options) -> torch.Tensor:
    return _impl("w4a16", "w4a16_matmul")(x, qweight, scales, zeros, group_size, perm, bits=bits,
                                          **options)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, **options) -> torch.Tensor:
    """Mixture-of-experts MLP: x [M, H], w13 [E, 2*I, H] (gate rows, then up), w2 [E, H, I],
    topk_weights float32 / topk_ids [M, top_k]; float8_e4m3fn weights take scales [E, N] or
    [E, N/128, K/128]. Returns [M, H] (kernels/moe.py)."""
    return _impl("moe", "fused_moe")(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale,
                                           **options)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                         use_kernel: bool | None = None):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) of kernels/moe_align.py."""
    return _impl("moe_align", "moe_align_block_size")(topk_ids, num_experts, block_m, use_kernel)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool, round_to: torch.dtype | None = None):
    """The MoE router's (weights float32, expert ids int32) [M, top_k] of logits [M, E]
    (kernels/moe_router.py)."""
    return _impl("moe_router", "topk_softmax")(logits, top_k, renormalize, round_to)
