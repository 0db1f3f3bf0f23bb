"""The gated MLP: down(act(gate(x)) * up(x)), gate and up in one projection (SwiGLU with silu,
Gemma's GeGLU with tanh-approximated gelu)."""
from __future__ import annotations

import torch
from torch import nn

from .activation import GeluTanhAndMul, SiluAndMul

# config.json's hidden_act / hidden_activation -> the gated activation
ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}
from .linear import LinearMethod, MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                 linear_method: LinearMethod | None = None, act: str = "silu") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       dtype=dtype, linear_method=linear_method)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, dtype=dtype,
                                           linear_method=linear_method)
        self.act_fn = ACTIVATIONS[act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
