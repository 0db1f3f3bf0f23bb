"""Llama 2 / 3 and Mistral (Mistral's sliding window: see models.sliding_window)."""
from __future__ import annotations

from .decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM")
    model_types = ("llama", "mistral")
