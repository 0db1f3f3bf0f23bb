from __future__ import annotations

import torch
from torch import nn

from tritium import kernels

from .fp8_activation import Fp8Activation
from .split_k_partials import SplitKPartials


class RMSNorm(nn.Module):
    """RMSNorm; with `residual`, adds it first and returns (normed, new residual) in one pass.
    With `quantize_fp8`, the normed output comes quantized per token for an FP8 projection
    (an Fp8Activation), from the same launch. With `residual`, x may be a projection's split-K
    slices (SplitKPartials), which the same launch adds first."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor | SplitKPartials, residual: torch.Tensor | None = None,
                quantize_fp8: bool = False):
        if isinstance(x, SplitKPartials):
            x = x.slices  # (the kernels add them, rounding the sum to the residual's dtype)
        if not quantize_fp8:
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        out = kernels.rms_norm_quant_fp8(x, self.weight, self.eps, residual)
        act = Fp8Activation(out[0], out[1], x.dtype if residual is None else residual.dtype)
        return act if residual is None else (act, out[2])


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is an offset from one, and the product is taken in float32
    before rounding to the input's dtype (Hugging Face's Gemma2RMSNorm / Gemma3RMSNorm). With
    `residual`, adds it first and returns (normed, new residual), as RMSNorm does."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)
