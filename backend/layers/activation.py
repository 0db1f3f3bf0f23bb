from __future__ import annotations

import torch
from torch import nn

from tritium import kernels


class SiluAndMul(nn.Module):
    """x = cat(gate, up) -> silu(gate) * up (the SwiGLU MLP's activation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """x = cat(gate, up) -> gelu_tanh(gate) * up (Gemma's GeGLU, hidden_activation
    gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
