"""Phi-3, Phi-3.5 and Phi-4-mini: checkpoints hold q/k/v and gate/up already fused; partial
rotary; LongRoPE for the long-context variants."""
from __future__ import annotations

from dataclasses import replace

from ..layers.rotary import rope_type
from .decoder import DecoderForCausalLM
from .decoder_config import DecoderConfig


class Phi3ForCausalLM(DecoderForCausalLM):
    architectures = ("Phi3ForCausalLM",)
    model_types = ("phi3",)

    def adjust_config(self, c: DecoderConfig, max_model_len: int | None) -> DecoderConfig:
        """With LongRoPE, past original_max_position_embeddings the long factors apply at every
        position (models.longrope_original_length)."""
        rope = c.rope_scaling
        if (max_model_len is not None and rope_type(rope) == "longrope"
                and max_model_len > rope["original_max_position_embeddings"]):
            return replace(c, long_rope=True)
        return c

    def checkpoint_shards(self, param_name: str) -> list[tuple[str | int, int]] | None:
        """(shard id, rows) of the fused qkv_proj and gate_up_proj tensors' parts, in order."""
        c = self.config
        if ".qkv_proj." in param_name:
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            return [("q", q), ("k", kv), ("v", kv)]
        if ".gate_up_proj." in param_name:
            return [(0, c.intermediate_size), (1, c.intermediate_size)]
        return None
