"""Paged attention over the KV cache: stores this step's keys and values, then runs decode
attention for the one-token sequences and prefill attention for the chunks."""
from __future__ import annotations

import torch
from torch import nn

from tritium import kernels

from .forward_context import get_attention_metadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        """sliding_window W: a query at position p sees the keys p - W < k <= p (None: all);
        logit_softcap C: scores become C * tanh(scores / C) (Gemma 2)."""
        super().__init__()
        self.sliding_window = sliding_window or None
        self.logit_softcap = logit_softcap or None
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # Views into the model runner's pool, [num_blocks, block_size, num_kv_heads, head_dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # An FP8 cache stores k / k_scale and v / v_scale (vLLM's per-tensor scales; 1.0 unless
        # the model runner sets them). Plain floats: CUDA graphs capture them as constants.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor | None = None, rotary_emb: nn.Module | None = None,
                q_norm: nn.Module | None = None, k_norm: nn.Module | None = None) -> torch.Tensor:
        """With rotary_emb (and positions), q and k arrive unrotated: one kernel rotates them in
        place (after Qwen3's q_norm / k_norm) and stores the rotated keys and the values, which
        saves a kernel per layer. Without it, q and k are taken as rotated and only stored."""
        md = get_attention_metadata()
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if md is None or self.k_cache is None:
            raise RuntimeError("Attention needs a KV cache and attention metadata (ModelRunner sets both)")
        if rotary_emb is not None:
            rotary_emb(positions, q, k, q_norm, k_norm, value=v, k_cache=self.k_cache,
                       v_cache=self.v_cache, slot_mapping=md.slot_mapping, k_scale=self.k_scale,
                       v_scale=self.v_scale)
        else:
            kernels.store_kv_cache(k, v, self.k_cache, self.v_cache, md.slot_mapping, self.k_scale,
                               self.v_scale)
        out = torch.empty_like(q)
        nd = md.num_decode_tokens
        if nd:
            kernels.paged_decode_attention(q[:nd], self.k_cache, self.v_cache, md.decode_block_tables,
                                       md.decode_context_lens, self.scale, out=out[:nd],
                                       max_context_len=md.decode_max_context_len,
                                       k_scale=self.k_scale, v_scale=self.v_scale,
                                       sliding_window=self.sliding_window, logit_softcap=self.logit_softcap)
        if md.num_prefill_tokens:
            end = nd + md.num_prefill_tokens
            kernels.paged_prefill_attention(q[nd:end], self.k_cache, self.v_cache,
                                        md.prefill_block_tables, md.prefill_cu_seqlens_q,
                                        md.prefill_context_lens, md.prefill_max_seqlen_q,
                                        self.scale, out=out[nd:end], k_scale=self.k_scale,
                                        v_scale=self.v_scale, key=k[nd:end], value=v[nd:end],
                                        sliding_window=self.sliding_window, logit_softcap=self.logit_softcap)
        return out.view(num_tokens, self.num_heads * self.head_dim)
