"""Gemma 2: GeGLU (tanh-approximated gelu), RMSNorm weights offset from one, norms before and
after both attention and the MLP, the embedding scaled by sqrt(hidden_size), queries scaled by
query_pre_attn_scalar, attention and final logits soft-capped, and layers alternating a sliding
window with global attention (every other one from the first, where config.json has no
layer_types)."""
from __future__ import annotations

import torch
from torch import nn

from ..layers.attention_block import SelfAttention
from ..layers.layernorm import GemmaRMSNorm
from ..layers.linear import LinearMethod
from .decoder import DecoderForCausalLM
from .decoder_config import DecoderConfig, by_layer_types


class GemmaDecoderLayer(nn.Module):
    """The residual stream is carried as (hidden, residual), summed by the next block, as
    DecoderLayer does; within the layer, each sub-block's output is normed before it is added."""

    def __init__(self, c: DecoderConfig, mlp: nn.Module, dtype: torch.dtype,
                 linear_method: LinearMethod | None = None, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = SelfAttention(c, dtype, linear_method, layer, norm=GemmaRMSNorm)
        self.mlp = mlp
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            hidden = residual + hidden
        residual = hidden
        hidden = self.self_attn(positions, self.input_layernorm(hidden), rows)
        if rows is not None:
            residual = residual[rows]
            if rows.numel() == 0:
                return hidden, residual
        residual = residual + self.post_attention_layernorm(hidden)
        hidden = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(residual)))
        return hidden, residual


def gemma2_windowed_layers(c: dict, layer: int) -> bool:
    """layer_types where given, else transformers' Gemma2Config default: even layers slide."""
    return by_layer_types(c, layer) if c.get("layer_types") else layer % 2 == 0


class Gemma2ForCausalLM(DecoderForCausalLM):
    architectures = ("Gemma2ForCausalLM",)
    model_types = ("gemma2",)
    config_defaults = {"scale_embeddings": True, "tie_word_embeddings": True,
                       "windowed_layers": gemma2_windowed_layers}
    decoder_layer = GemmaDecoderLayer
    norm = GemmaRMSNorm
