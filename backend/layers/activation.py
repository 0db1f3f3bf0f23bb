from __future__ import annotations

import torch
from torch import nn

from . import ops


class SiluAndMul(nn.Module):
    """x = cat(gate, up) -> silu(gate) * up (the SwiGLU MLP's activation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)
