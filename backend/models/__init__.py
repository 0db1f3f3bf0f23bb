"""Model registry: Hugging Face `architectures` name -> model class."""
from __future__ import annotations

from .llama import LlamaForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # same blocks; Qwen2 adds the qkv bias (from its config)
    "Qwen3ForCausalLM": LlamaForCausalLM,  # and Qwen3 an RMSNorm per query and key head
    "MistralForCausalLM": LlamaForCausalLM,
}


def get_model_class(hf_config: dict) -> type:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    model_type = hf_config.get("model_type")
    if model_type in ("llama", "qwen2", "qwen3", "mistral"):
        return LlamaForCausalLM
    raise ValueError(f"model: architecture {archs or model_type!r} is not supported; "
                     f"supported: {', '.join(MODEL_REGISTRY)}")
