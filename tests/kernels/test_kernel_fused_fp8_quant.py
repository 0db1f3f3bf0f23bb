"""rms_norm_quant_fp8 and silu_and_mul_quant_fp8: each must write the same bytes as its op
followed by quantize_fp8_per_token (the two launches it replaces), scales and new residual
included, and name itself in its errors. The comparison is kernel against kernels, so it holds in
Triton's interpreter too, whose float32 -> float8 conversion differs from the GPU's (see
test_kernel_quant.py): both sides convert the same values the same way. On a GPU the fused ops
are also checked against kernels.reference."""

import pytest
import torch
from kernel_checks import DEVICE, DTYPES, ON_GPU

from tritium import kernels
from tritium.kernels import reference


def _same_fp8(q: torch.Tensor, want: torch.Tensor) -> None:
    assert q.dtype == torch.float8_e4m3fn and q.shape == want.shape
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


def _rows(rows: int, cols: int, dtype: torch.dtype, seed: int, top: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Row magnitudes from 1e-3 to 10**top, and an all-zero row (the smallest scale).
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, top, rows)[:, None]
    x[min(2, rows - 1)] = 0.0
    return x.to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [128, 1000, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_is_the_norm_then_the_quantization(dtype, hidden, with_residual):
    x = _rows(7, hidden, dtype, hidden)
    residual = _rows(7, hidden, dtype, hidden + 1) if with_residual else None
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(3)) + 0.5).to(device=DEVICE, dtype=dtype)
    got = kernels.rms_norm_quant_fp8.triton(x, weight, 1e-5, residual)
    normed = kernels.rms_norm.triton(x, weight, 1e-5, residual)
    want_q, want_scale = kernels.quantize_fp8_per_token.triton(normed[0] if with_residual else normed)
    assert len(got) == (3 if with_residual else 2)
    _same_fp8(got[0], want_q)
    assert got[1].dtype == torch.float32 and torch.equal(got[1], want_scale)
    if with_residual:
        assert torch.equal(got[2], normed[1])
    if ON_GPU:
        ref = reference.rms_norm_quant_fp8_ref(x, weight, 1e-5, residual)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [128, 1000, 14336])  # one block, a ragged one, several
def test_silu_and_mul_quant_is_the_activation_then_the_quantization(dtype, inter):
    x = _rows(5, 2 * inter, dtype, inter, top=1)  # products within float16's range
    q, scale = kernels.silu_and_mul_quant_fp8.triton(x)
    want_q, want_scale = kernels.quantize_fp8_per_token.triton(kernels.silu_and_mul.triton(x))
    _same_fp8(q, want_q)
    assert scale.shape == (5, 1) and torch.equal(scale, want_scale)
    if ON_GPU:
        torch.testing.assert_close(scale, reference.silu_and_mul_quant_fp8_ref(x)[1], rtol=1e-6, atol=0)


def test_the_references_are_the_two_ops_in_turn():
    x, residual = _rows(4, 64, torch.float32, 1), _rows(4, 64, torch.float32, 2)
    weight = torch.rand(64, device=DEVICE) + 0.5
    q, scale, new_residual = reference.rms_norm_quant_fp8_ref(x, weight, 1e-6, residual)
    normed, want_residual = reference.rms_norm_ref(x, weight, 1e-6, residual)
    want_q, want_scale = reference.quantize_fp8_per_token_ref(normed)
    _same_fp8(q, want_q)
    assert torch.equal(scale, want_scale) and torch.equal(new_residual, want_residual)
    q, scale = reference.silu_and_mul_quant_fp8_ref(x)
    want_q, want_scale = reference.quantize_fp8_per_token_ref(reference.silu_and_mul_ref(x))
    _same_fp8(q, want_q)
    assert torch.equal(scale, want_scale)


def test_empty_batches_and_errors_name_the_op():
    x = torch.zeros(0, 256, device=DEVICE)
    q, scale = kernels.rms_norm_quant_fp8.triton(x, torch.ones(256, device=DEVICE), 1e-6)
    assert q.shape == (0, 256) and scale.shape == (0, 1)
    q, scale = kernels.silu_and_mul_quant_fp8.triton(x)
    assert q.shape == (0, 128) and scale.shape == (0, 1)
    with pytest.raises(ValueError, match=r"^silu_and_mul_quant_fp8: x last dimension must be even \(cat\(gate, up\)\), got 7$"):
        kernels.silu_and_mul_quant_fp8.triton(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match=r"^rms_norm_quant_fp8: weight must have shape \[H\]"):
        kernels.rms_norm_quant_fp8.triton(torch.zeros(2, 8, device=DEVICE), torch.ones(4, device=DEVICE), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [2, 5])
@pytest.mark.parametrize("quant", [False, True])
def test_norms_take_a_split_k_matmuls_slices(dtype, split, quant):
    """x as [S, T, H] float32 slices: the norm of their sum (rounded to the residual's dtype),
    as split_k.finish and the norm would give in two launches. Two slices add in either order
    alike, so there the bytes must match; five may round the float32 sum differently."""
    from tritium.kernels.split_k import sum_slices
    hidden = 1000
    slices = (_rows(split * 6, hidden, torch.float32, split, top=1).reshape(split, 6, hidden)).contiguous()
    residual = _rows(6, hidden, dtype, 7, top=1)
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(4)) + 0.5).to(device=DEVICE, dtype=dtype)
    op = kernels.rms_norm_quant_fp8 if quant else kernels.rms_norm
    got = op.triton(slices, weight, 1e-5, residual)
    want = op.triton(sum_slices(slices, dtype), weight, 1e-5, residual)
    ref = op.reference(slices, weight, 1e-5, residual)
    assert len(got) == len(want) == len(ref)
    if split == 2:
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    else:
        torch.testing.assert_close(got[-1], want[-1], rtol=1e-2, atol=1e-2)  # the new residual
    if not quant:
        torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match=r"^rms_norm: x as \[S, T, H\] slices needs the residual \(its dtype is the "
                                         r"sum's\), got residual=None$"):
        kernels.rms_norm.triton(slices, weight, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [2, 3])
def test_silu_and_mul_takes_a_split_k_matmuls_slices(dtype, split):
    """x as [S, T, 2*I] float32 slices with `out`: the activation of their sum rounded to out's
    dtype, as split_k.finish and silu_and_mul would give in two launches (two slices: the same
    bytes; three may round the float32 sum differently)."""
    from tritium.kernels.split_k import sum_slices
    slices = _rows(split * 4, 2 * 1000, torch.float32, split, top=1).reshape(split, 4, 2000).contiguous()
    got = kernels.silu_and_mul.triton(slices, torch.empty(4, 1000, dtype=dtype, device=DEVICE))
    want = kernels.silu_and_mul.triton(sum_slices(slices, dtype))
    ref = kernels.silu_and_mul.reference(slices, torch.empty(4, 1000, dtype=dtype, device=DEVICE))
    assert got.dtype == dtype and got.shape == (4, 1000)
    if split == 2:
        assert torch.equal(got, want)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match=r"^silu_and_mul: x as \[S, T, 2\*I\] slices needs out \(its dtype is the "
                                         r"sum's\), got out=None$"):
        kernels.silu_and_mul.triton(slices)
