"""Model registry: Hugging Face `architectures` name -> model class (one file per family)."""
from __future__ import annotations

from ..engine_config import ModelLimits
from ..layers.rotary import rope_type
from .gemma2 import Gemma2ForCausalLM
from .gemma3 import Gemma3ForCausalLM
from .interface import CausalLM
from .llama import LlamaForCausalLM
from .mixtral import MixtralForCausalLM
from .phi3 import Phi3ForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen2_moe import Qwen2MoeForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

# Every architecture class (models/interface.py says what one provides).
MODEL_CLASSES: tuple[type[CausalLM], ...] = (
    LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM,
    MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM)
MODEL_REGISTRY = {arch: cls for cls in MODEL_CLASSES for arch in cls.architectures}


def get_model_class(hf_config: dict) -> type[CausalLM]:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    model_type = hf_config.get("model_type")
    for cls in MODEL_CLASSES:
        if model_type in cls.model_types:
            return cls
    raise ValueError(f"model: architecture {archs or model_type!r} is not supported; "
                     f"supported: {', '.join(MODEL_REGISTRY)}")


def model_limits(hf_config: dict) -> ModelLimits:
    """The architecture's limits on the sequence lengths it serves (EngineArgs.create_model_config).
    Sliding windows set none: the attention kernels apply them, so such models serve their whole
    max_position_embeddings."""
    return ModelLimits(None, longrope_original_length(hf_config))


def longrope_original_length(hf_config: dict) -> int | None:
    """A LongRoPE model's original_max_position_embeddings (Phi-3.5-mini, Phi-4-mini, Phi-3-128k),
    else None. Up to it transformers rotates with the short factors; past it with the long ones.
    The engine picks one set for its whole life, as vLLM does (switching mid-sequence would leave
    the cached keys rotated the other way): the long factors when max_model_len passes this
    length, so max_model_len defaults to it."""
    # (an unsupported architecture says so first; longrope: with its lengths filled in)
    rope = get_model_class(hf_config).read_config(hf_config).rope_scaling
    if rope_type(rope) != "longrope":
        return None
    return int(rope["original_max_position_embeddings"])
