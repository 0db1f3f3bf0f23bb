"""Where and in what precision the model runs, resolved from the engine's configuration."""
from __future__ import annotations

import logging

import torch

from ..engine_config import DeviceConfig, ModelConfig
from ..layers.int4 import INT4_METHODS

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: DeviceConfig) -> torch.device:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was requested but no CUDA device is available.")
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_dtype(model: ModelConfig, device: torch.device) -> torch.dtype:
    if model.dtype != "auto":
        return _DTYPES[model.dtype]
    if device.type == "cpu":
        return torch.float32  # CPU bf16 matmuls are slow and inexact; tests compare in float32
    hf_config = model.hf_config
    config_dtype = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16")
    return _DTYPES.get(config_dtype, torch.bfloat16) if config_dtype != "float32" else torch.bfloat16


def resolve_quantization(model: ModelConfig) -> str | None:
    """`quantization`, or what the checkpoint's config.json declares, as vLLM reads it: an FP8
    checkpoint (quant_method "fp8", or "compressed-tensors" with 8-bit float weights) is served
    in FP8, an AWQ or GPTQ one with its own packed weights. Other quantized formats are refused
    here rather than failing in the loader."""
    declared = model.hf_config.get("quantization_config")
    method = str((declared or {}).get("quant_method", "")).lower()
    if method in INT4_METHODS and model.quantization not in (None, method):
        raise ValueError(f"quantization={model.quantization!r}, but the checkpoint is quantized "
                         f"with {method!r}: leave quantization unset or set it to {method!r}")
    if model.quantization in INT4_METHODS and method != model.quantization and model.load_format != "dummy":
        raise ValueError(f"quantization={model.quantization!r} reads {model.quantization.upper()} "
                         f"checkpoints (their config.json declares it in quantization_config); "
                         f"for random weights use load_format=dummy")
    if not declared or model.quantization is not None:
        return model.quantization
    if method in INT4_METHODS:
        logger.info("The checkpoint is %s: serving its packed weights with quantization=%s",
                    method.upper(), method)
        return method
    groups = list((declared.get("config_groups") or {}).values())
    fp8_weights = all(isinstance(g, dict) and (g.get("weights") or {}).get("type") == "float"
                      and (g.get("weights") or {}).get("num_bits") == 8 for g in groups)
    if method == "fp8" or (method == "compressed-tensors" and groups and fp8_weights):
        logger.info("The checkpoint is FP8 (quant_method %r): serving it with quantization=fp8", method)
        return "fp8"
    raise ValueError(f"model: the checkpoint is quantized with {method or declared!r}, which "
                     f"Tritium does not read; FP8 (quant_method 'fp8' or FP8 compressed-tensors), "
                     f"AWQ and GPTQ checkpoints are supported")
