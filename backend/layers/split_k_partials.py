"""The typed hand-over between a projection whose matmul split K and the kernel after it (the
RMSNorm after o_proj and down_proj, SiLU-and-mul after gate_up_proj): the slices' float32
partial sums, which that kernel adds itself, so the decode step has no launch of its own for
the sum."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SplitKPartials:
    """slices [S, T, N] float32 whose sum, rounded to `dtype`, is the projection's output."""
    slices: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.slices.shape[1:]

    def reduced(self) -> torch.Tensor:
        """The output itself [T, N] (for a consumer that cannot take the slices)."""
        from tritium.kernels.split_k import sum_slices  # (imports Triton: slices exist on a GPU only)
        return sum_slices(self.slices, self.dtype)

