"""The typed hand-over between a kernel that quantizes its own output and the FP8 projection after
it (backend/layers/quantization.py's Fp8LinearMethod)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Activation:
    """An FP8 projection's input quantized per token by the kernel that produced it (RMSNorm's or
    SiLU-and-mul's fused variant): q [T, K] float8_e4m3fn, scale [T, 1] float32, and the dtype
    the unquantized activation had (the projection's output dtype)."""
    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
