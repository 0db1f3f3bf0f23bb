"""Llama 2 / 3 and Mistral (its sliding_window applies to every layer: DecoderConfig.layer_windows)."""
from __future__ import annotations

from .decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM")
    model_types = ("llama", "mistral")
