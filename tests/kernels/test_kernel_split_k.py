"""split_k.sum_slices, the last step of the split-K matmuls: slice counts below, at and above the
block of slices loaded at once, outputs that are not multiples of a program's block, and the
float32 sum rounded once to the output dtype."""

import pytest
import torch
from kernel_checks import DEVICE, ON_GPU

from tritium.kernels.split_k import BLOCK, MAX_BLOCK_S, sum_slices

OUT_DTYPES = [torch.float32, torch.float16,
              pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not ON_GPU, reason="interpreter has no bf16"))]


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("split, m, n", [(1, 1, 40), (3, 2, BLOCK + 5), (MAX_BLOCK_S, 1, 3 * BLOCK),
                                         (MAX_BLOCK_S + 7, 3, 300), (86, 1, 2 * BLOCK - 1)])
def test_sum_slices_matches_float64(split, m, n, out_dtype):
    g = torch.Generator().manual_seed(split * 1000 + n)
    ws = torch.randn(split, m, n, generator=g)
    out = sum_slices(ws.to(DEVICE), out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype
    exact = ws.double().sum(dim=0)
    if out_dtype == torch.float32:
        torch.testing.assert_close(out.double().cpu(), exact, rtol=0, atol=1e-5 * split)
    else:  # the float32 sum rounded once: as PyTorch's sum then cast, to one unit in the last place
        torch.testing.assert_close(out.cpu(), ws.sum(dim=0).to(out_dtype), rtol=1e-2, atol=1e-2)


def test_sum_slices_of_nothing():
    assert sum_slices(torch.zeros(4, 0, 8, device=DEVICE), torch.float16).shape == (0, 8)
