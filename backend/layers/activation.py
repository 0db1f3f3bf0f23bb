from __future__ import annotations

import torch
from torch import nn

from tritium import kernels

from .fp8_activation import Fp8Activation
from .split_k_partials import SplitKPartials


class SiluAndMul(nn.Module):
    """x = cat(gate, up) -> silu(gate) * up (the SwiGLU MLP's activation); with `quantize_fp8`,
    quantized per token for an FP8 projection (an Fp8Activation) in the same launch. x may be
    the gate/up projection's split-K slices (SplitKPartials, without quantize_fp8), which the
    same launch adds first."""

    quantizes_fp8 = True  # takes quantize_fp8
    takes_partials = True  # takes SplitKPartials

    def forward(self, x: torch.Tensor | SplitKPartials, quantize_fp8: bool = False) -> torch.Tensor | Fp8Activation:
        if isinstance(x, SplitKPartials):
            out = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype, device=x.slices.device)
            return kernels.silu_and_mul(x.slices, out)
        if quantize_fp8:
            return Fp8Activation(*kernels.silu_and_mul_quant_fp8(x), x.dtype)
        return kernels.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """x = cat(gate, up) -> gelu_tanh(gate) * up (Gemma's GeGLU, hidden_activation
    gelu_pytorch_tanh)."""

    quantizes_fp8 = False
    takes_partials = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
