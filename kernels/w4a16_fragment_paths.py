"""The engine's W4A16 matmul on fragment-ordered words: per row bucket, the fragment kernel
(kernels/w4a16_fragment.py) or the weight dequantized to 16 bits once and one cuBLAS GEMM, as the
card's table (kernels/w4a16_fragment_layout.py) says."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._launch import check_runnable
from .w4a16_fragment import check_arguments, fragment_dequantize, w4a16_fragment_matmul
from .w4a16_fragment_layout import SLAB, FragmentConfig, choose_config


def w4a16_fragment_linear(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          group_size: int, perm: torch.Tensor | None = None, *, reduce: bool = True,
                          config: FragmentConfig | None = None) -> torch.Tensor:
    """x [M, K] bf16/fp16 -> x @ W^T [M, N], W in `repack_fragment`'s words (row k of the values
    multiplies x[:, perm[k]] with act-order), scales and zeros [K / group_size, N]; with
    reduce=False the kernel's K slices, if it splits K, come back unsummed [S, M, N] float32."""
    m, k = x.shape if x.dim() == 2 else (0, 0)
    cfg = config or choose_config(m, words.shape[1] * SLAB if words.dim() == 4 else 0, k, group_size, x.device)
    if cfg.method == "dequant":
        check_arguments(x, words, scales, zeros, group_size, perm, cfg)
        check_runnable("w4a16_fragment_linear", x)
        w = fragment_dequantize(words, scales, zeros, group_size, x.dtype)
        if perm is not None:
            x = x.index_select(1, perm)  # the words' K order is act-order's sorted one
        return F.linear(x, w)
    return w4a16_fragment_matmul(x, words, scales, zeros, group_size, perm, reduce=reduce, config=cfg)
