"""quantize_fp8_per_token: per-row scale amax/448 and FP8 (e4m3) values that dequantize to the
input within e4m3's rounding. GPU only: Triton's interpreter converts float32 to float8 wrongly
(127.09 becomes 64), so on the CPU the engine uses kernels.reference instead."""

import pytest
import torch
from kernel_checks import DEVICE, ON_GPU

from tritium import kernels
from tritium.kernels import reference

pytestmark = pytest.mark.skipif(not ON_GPU, reason="Triton's interpreter mis-rounds float32 -> float8")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("cols", [128, 4096, 14336, 1000])
def test_matches_reference(dtype, cols):
    g = torch.Generator(device="cpu").manual_seed(cols)
    x = torch.randn(67, cols, generator=g) * torch.logspace(-3, 3, 67)[:, None]
    x[5] = 0.0
    x = x.to(device=DEVICE, dtype=dtype)
    q, s = kernels.quantize_fp8_per_token.triton(x)
    q_ref, s_ref = reference.quantize_fp8_per_token_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (67, 1) and s.dtype == torch.float32
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # The kernel's reciprocal may differ from torch's by an ulp, which moves a value sitting
    # on a rounding midpoint to the other neighbour: allow a handful of such elements.
    differ = (q.float() != q_ref.float()).float().mean().item()
    assert differ < 1e-4, f"{differ:.2e} of elements differ from the reference"
    err = (q.float() * s - x.float()).abs()
    assert (err <= x.float().abs() * 2 ** -4 + s * 2 ** -9).all()


def test_strided_rows_and_empty():
    x = torch.randn(8, 512, device=DEVICE, dtype=torch.bfloat16)
    q, s = kernels.quantize_fp8_per_token.triton(x[:, :256])
    q_ref, s_ref = reference.quantize_fp8_per_token_ref(x[:, :256])
    assert torch.equal(s, s_ref)
    q, s = kernels.quantize_fp8_per_token.triton(x[:0])
    assert q.shape == (0, 512) and s.shape == (0, 1)
