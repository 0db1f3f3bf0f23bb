"""Model registry: Hugging Face `architectures` name -> model class."""
from __future__ import annotations

from ..layers.rotary import rope_type
from .llama import LlamaArgs, LlamaForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # same blocks; Qwen2 adds the qkv bias (from its config)
    "Qwen3ForCausalLM": LlamaForCausalLM,  # and Qwen3 an RMSNorm per query and key head
    "MistralForCausalLM": LlamaForCausalLM,
    # Phi-3: its checkpoints hold q/k/v and gate/up already fused; partial rotary
    "Phi3ForCausalLM": LlamaForCausalLM,
}


def get_model_class(hf_config: dict) -> type:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    model_type = hf_config.get("model_type")
    if model_type in ("llama", "qwen2", "qwen3", "mistral", "phi3"):
        return LlamaForCausalLM
    raise ValueError(f"model: architecture {archs or model_type!r} is not supported; "
                     f"supported: {', '.join(MODEL_REGISTRY)}")


def context_limit(hf_config: dict) -> tuple[int, str] | None:
    """The longest sequence served exactly when it is shorter than max_position_embeddings, and
    why: a sliding attention window (below), or LongRoPE, whose long factors apply past
    original_max_position_embeddings (only its short factors are implemented)."""
    limits = []
    window = sliding_window(hf_config)
    if window is not None:
        limits.append((window, f"the model's sliding_window={window} (attention over the whole "
                               f"context matches the model's only up to its window)"))
    get_model_class(hf_config)  # an unsupported architecture says so first
    rope = LlamaArgs.from_hf_config(hf_config).rope_scaling  # (longrope: with its lengths filled in)
    if rope_type(rope) == "longrope":
        original = int(rope["original_max_position_embeddings"])
        limits.append((original, f"the model's original_max_position_embeddings={original} "
                                 f"(past it LongRoPE switches to its long factors, which Tritium does "
                                 f"not implement)"))
    return min(limits) if limits else None


def sliding_window(hf_config: dict) -> int | None:
    """The attention window the architecture applies, or None. Mistral and Phi-3 apply
    `sliding_window` whenever it is set; Qwen2 and Qwen3 only with `use_sliding_window`. The
    kernels attend to the whole context, so the engine serves such a model up to its window,
    where the two agree (as vLLM does with disable_sliding_window)."""
    window = hf_config.get("sliding_window")
    if not window:
        return None
    if hf_config.get("model_type") in ("qwen2", "qwen3") and not hf_config.get("use_sliding_window", False):
        return None
    return int(window)
