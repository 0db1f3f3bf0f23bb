"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k norms), sparse
layers of routed experts without a shared one."""
from __future__ import annotations

from .decoder import DecoderForCausalLM
from .decoder_config import qwen_windowed_layers


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)
    config_defaults = {"qk_norm": True, "windowed_layers": qwen_windowed_layers}
