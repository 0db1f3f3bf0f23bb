"""Mixtral 8x7B / 8x22B: Mistral's attention, every layer's MLP a mixture of experts whose
top-k routing weights are renormalised; the checkpoint names the block block_sparse_moe and an
expert's gate, down and up projections w1, w2 and w3."""
from __future__ import annotations

from .decoder import DecoderForCausalLM


class MixtralForCausalLM(DecoderForCausalLM):
    architectures = ("MixtralForCausalLM",)
    model_types = ("mixtral",)
    # Mixtral's routing weights stay float32 up to the experts' sum (Hugging Face's order).
    config_defaults = {"norm_topk_prob": True, "router_weights_in_dtype": False}
    expert_projections = {"w1": "gate", "w3": "up", "w2": "down"}
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}
