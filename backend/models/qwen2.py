"""Qwen2 and Qwen2.5: Llama's blocks with a bias on the q/k/v projection."""
from __future__ import annotations

from .decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)
    config_defaults = {"attention_bias": True}  # Qwen2's config has no attention_bias key
