"""Rotary position embedding (rotate-half / NeoX layout, as Hugging Face Llama and Qwen2 use),
with Llama-3 and linear rope scaling folded into the precomputed cos/sin cache."""
from __future__ import annotations

import math

import torch
from torch import nn

from tritium import kernels


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Same arithmetic, in the same order, as transformers' llama3 rope init (token-exactness).
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rope_type(scaling: dict | None) -> str:
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    return "longrope" if kind == "su" else kind  # (LongRoPE's first name, in early Phi-3 configs)


def compute_inv_freq(rotary_dim: int, base: float, scaling: dict | None,
                     long_factors: bool = False) -> torch.Tensor:
    """long_factors: LongRoPE's long factors instead of its short ones (ignored otherwise)."""
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    kind = rope_type(scaling)
    if kind == "longrope":
        # Phi-3's LongRoPE (same arithmetic as transformers): the short factors serve up to
        # original_max_position_embeddings, the long ones a longer max_model_len.
        name = "long_factor" if long_factors else "short_factor"
        factors = torch.tensor(scaling[name], dtype=torch.float32)
        if factors.numel() != rotary_dim // 2:
            raise ValueError(f"model: longrope {name} has {factors.numel()} values, expected "
                             f"{rotary_dim // 2} (half the rotary dims)")
        return 1.0 / (factors * base ** shape)
    inv_freq = 1.0 / (base ** shape)
    if kind == "default":
        return inv_freq
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3, longrope are)")


def attention_factor(scaling: dict | None) -> float:
    """LongRoPE scales cos and sin by sqrt(1 + ln(factor) / ln(original length)), factor being
    the context's extension (max over original positions), unless the config gives it."""
    if rope_type(scaling) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """`rotary_dim` (default head_dim): only each head's first rotary_dim dims rotate.
    `long_factors`: LongRoPE's long factors at every position."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None,
                 device: torch.device | None = None, rotary_dim: int | None = None,
                 long_factors: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(rotary_dim or head_dim, base, scaling, long_factors)
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        scale = attention_factor(scaling)
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        cache = torch.cat([cos, sin], dim=-1)  # [max_position, rotary_dim] float32
        self.register_buffer("cos_sin_cache", cache.to(device) if device else cache, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                q_norm: nn.Module | None = None, k_norm: nn.Module | None = None, **kv_store):
        """Rotates query and key in place; with q_norm / k_norm (RMSNorm over one head, Qwen3)
        each head is normalised first, in the same pass. kv_store (value, k_cache, v_cache,
        slot_mapping, k_scale, v_scale; see Attention) also stores the rotated keys and the
        values in that pass."""
        if q_norm is None:
            kernels.apply_rotary_emb(query, key, positions, self.cos_sin_cache, self.head_dim, **kv_store)
        else:
            kernels.apply_rotary_emb(query, key, positions, self.cos_sin_cache, self.head_dim,
                                 q_norm.weight, k_norm.weight, q_norm.eps, **kv_store)
        return query, key
