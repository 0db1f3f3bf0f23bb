"""Qwen2 and Qwen2.5: Llama's blocks with a bias on the q/k/v projection."""
from __future__ import annotations

from .decoder import DecoderForCausalLM
from .decoder_config import qwen_windowed_layers


class Qwen2ForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)
    # Qwen2's config has no attention_bias key: its q/k/v always have one.
    config_defaults = {"attention_bias": True, "windowed_layers": qwen_windowed_layers}
