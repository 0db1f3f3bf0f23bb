"""The decoder's self-attention block: fused q/k/v projection, rotary (after Qwen3's per-head
norms), paged attention, output projection."""
from __future__ import annotations

import torch
from torch import nn

from .attention import Attention
from .fp8_activation import Fp8Activation
from .forward_context import select_lora_rows
from .layernorm import RMSNorm
from .linear import LinearMethod, QKVParallelLinear, RowParallelLinear
from .rotary import RotaryEmbedding


class SelfAttention(nn.Module):
    def __init__(self, c, dtype: torch.dtype, linear_method: LinearMethod | None = None,
                 layer: int = 0, norm: type[nn.Module] = RMSNorm) -> None:
        """c: the model's DecoderConfig (models/decoder_config.py); `layer` picks its window and
        rotary base; `norm`: the q/k head norms' class (RMSNorm is fused into the rotary kernel,
        another runs before it)."""
        super().__init__()
        self.qkv_proj = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_attention_heads,
                                          c.num_key_value_heads, bias=c.attention_bias, dtype=dtype,
                                          linear_method=linear_method)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * c.head_dim
        self.kv_size = self.num_kv_heads * c.head_dim
        self.o_proj = RowParallelLinear(c.num_attention_heads * c.head_dim, c.hidden_size,
                                        bias=False, dtype=dtype, linear_method=linear_method)
        window = c.layer_windows[layer] if c.layer_windows else 0
        local = bool(window and c.local_rope_theta)  # Gemma 3's windowed layers: their own base, no scaling
        self.rotary_emb = RotaryEmbedding(c.head_dim, c.max_position_embeddings,
                                          c.local_rope_theta if local else c.rope_theta,
                                          None if local else c.rope_scaling,
                                          rotary_dim=c.rotary_dim or c.head_dim, long_factors=c.long_rope)
        scale = (c.query_pre_attn_scalar or c.head_dim) ** -0.5
        self.attn = Attention(self.num_heads, c.head_dim, scale, self.num_kv_heads,
                              sliding_window=window or None, logit_softcap=c.attn_logit_softcap)
        self.head_dim = c.head_dim
        if c.qk_norm:
            self.q_norm = norm(c.head_dim, c.rms_norm_eps, dtype)
            self.k_norm = norm(c.head_dim, c.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.fused_qk_norm = norm is RMSNorm

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | Fp8Activation,
                rows: torch.Tensor | None = None, keep_partials: bool = False) -> torch.Tensor:
        """`rows`: project only these rows' attention outputs (see DecoderModel.forward). `hidden`
        may come quantized for an FP8 q/k/v projection (see DecoderLayer). keep_partials: the
        output projection may return its split-K slices (see LinearBase.forward)."""
        qkv = self.qkv_proj(hidden)
        # Strided views into qkv: rotary works in place and the attention kernels take row
        # strides, so no copies.
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_norm, k_norm = self.q_norm, self.k_norm
        if q_norm is not None and not self.fused_qk_norm:  # (Gemma 3's)
            tokens = q.shape[0]
            q = q_norm(q.reshape(tokens, -1, self.head_dim)).reshape(tokens, -1)
            k = k_norm(k.reshape(tokens, -1, self.head_dim)).reshape(tokens, -1)
            q_norm = k_norm = None
        # One kernel applies rotary (after Qwen3's head norms) and stores every row's keys and
        # values; then attention.
        out = self.attn(q, k, v, positions, self.rotary_emb, q_norm, k_norm)
        if rows is not None:
            if rows.numel() == 0:
                return out.new_empty(0, self.o_proj.out_features)
            out = out[rows]
            select_lora_rows(rows)  # LoRA adapters follow the rows kept
        return self.o_proj(out, keep_partials)
