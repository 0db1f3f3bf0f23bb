from __future__ import annotations

import torch
from torch import nn

from . import ops


class RMSNorm(nn.Module):
    """RMSNorm; with `residual`, adds it first and returns (normed, new residual) in one pass."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)
