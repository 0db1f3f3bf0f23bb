"""Building a model on its device from its ModelConfig: the architecture's class, its linear
method (FP8, AWQ, GPTQ or 16-bit), its weights. The target model and a draft model are built alike."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine_config import ModelConfig
from ..layers.quantization import (check_fp8_supported, fp8_weight_block_size, get_linear_method,
                                   process_weights_after_loading)
from ..models import get_model_class
from ..models.interface import CausalLM
from ..models.loader import load_dummy, load_safetensors
from .device import resolve_quantization


@dataclass
class BuiltModel:
    model: CausalLM
    quantization: str | None  # as served: set, or read from the checkpoint
    # The checkpoint's FP8 KV-cache scales by attention block (models/loader.py), if any.
    kv_scales: dict[str, dict[str, float]]


def build_model(model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                seed: int | None = None) -> BuiltModel:
    """The model with its weights (random ones from `seed`, default the config's, with
    load_format=dummy), in eval mode, its quantized weights processed."""
    hf_config = model_config.hf_config
    quantization = resolve_quantization(model_config)
    linear_method = get_linear_method(quantization, hf_config.get("quantization_config"))
    # Block-wise FP8 checkpoints: their block size, refused here unless 128 x 128.
    weight_block_size = fp8_weight_block_size(hf_config.get("quantization_config"))
    if quantization == "fp8":
        check_fp8_supported(device)
    with torch.device(device):
        model = get_model_class(hf_config)(hf_config, dtype, linear_method,
                                           max_model_len=model_config.max_model_len)
    model.eval()
    kv_scales: dict[str, dict[str, float]] = {}
    if model_config.load_format == "dummy":
        load_dummy(model, model_config.seed if seed is None else seed)
    else:
        kv_scales = load_safetensors(model, model_config.model, weight_block_size=weight_block_size)
    process_weights_after_loading(model)
    return BuiltModel(model, quantization, kv_scales)
