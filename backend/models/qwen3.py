"""Qwen3 (dense): an RMSNorm over each query and key head before rotary, no q/k/v bias."""
from __future__ import annotations

from .decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)
    config_defaults = {"qk_norm": True}
