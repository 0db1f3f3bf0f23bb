"""The gated MLP: down(act(gate(x)) * up(x)), gate and up in one projection (SwiGLU with silu,
Gemma's GeGLU with tanh-approximated gelu)."""
from __future__ import annotations

import torch
from torch import nn

from .activation import GeluTanhAndMul, SiluAndMul
from .fp8_activation import Fp8Activation

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

    @property
    def takes_fp8_activation(self) -> bool:
        """Whether the input may come quantized per token to FP8 (see LinearBase)."""
        return self.gate_up_proj.takes_fp8_activation

    def forward(self, x: torch.Tensor | Fp8Activation, keep_partials: bool = False) -> torch.Tensor:
        """keep_partials: the down projection may return its split-K slices (LinearBase.forward)."""
        if self.act_fn.quantizes_fp8 and self.down_proj.takes_fp8_activation:
            # An FP8 down projection gets its input quantized by the activation's own launch.
            return self.down_proj(self.act_fn(self.gate_up_proj(x), quantize_fp8=True), keep_partials)
        # A split-K gate/up projection's slices go to the activation, which adds them.
        h = self.gate_up_proj(x, keep_partials=self.act_fn.takes_partials)
        return self.down_proj(self.act_fn(h), keep_partials)
