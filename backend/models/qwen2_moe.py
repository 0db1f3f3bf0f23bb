"""Qwen1.5-MoE and Qwen2-MoE: Qwen2's attention (q/k/v bias); sparse layers route each token to
its top-k experts (renormalised only if norm_topk_prob) and add a shared expert scaled by a
sigmoid gate; mlp_only_layers and decoder_sparse_step keep some layers dense."""
from __future__ import annotations

from .decoder import DecoderForCausalLM
from .decoder_config import qwen_windowed_layers


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen2MoeForCausalLM",)
    model_types = ("qwen2_moe",)
    config_defaults = {"attention_bias": True, "windowed_layers": qwen_windowed_layers}
