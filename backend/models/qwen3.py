"""Qwen3 (dense): an RMSNorm over each query and key head before rotary, no q/k/v bias."""
from __future__ import annotations

from .decoder import DecoderForCausalLM
from .decoder_config import qwen_windowed_layers


class Qwen3ForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)
    config_defaults = {"qk_norm": True, "windowed_layers": qwen_windowed_layers}
