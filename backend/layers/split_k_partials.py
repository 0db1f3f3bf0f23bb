"""The typed hand-over between a row-parallel projection whose matmul split K and the RMSNorm
after it: the slices' float32 partial sums, which the norm's kernel adds itself (kernels/norm.py),
so the decode step has no launch of its own for the sum."""
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


def as_output(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | SplitKPartials:
    """A kernel's result with reduce=False: [T, N] as it is, [S, T, N] slices wrapped."""
    return SplitKPartials(y, dtype) if y.dim() == 3 else y
