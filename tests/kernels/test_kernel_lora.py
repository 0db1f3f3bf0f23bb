"""add_lora (multi-LoRA shrink and expand): rows of one batch using different adapters, or
none, get their own adapter's delta and nothing else, against float64 and the reference."""

import pytest
import torch
from kernel_checks import DEVICE, DTYPES, assert_accurate

from tritium import kernels
from tritium.kernels import reference


def _case(dtype, tokens, k, n, rank, adapters, gen, slots=None):
    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)
    x, y = randn(tokens, k), randn(tokens, n)
    a, b = randn(adapters, rank, k, scale=0.2), randn(adapters, n, rank, scale=0.2)
    if slots is None:
        slots = torch.randint(-1, adapters, (tokens,), generator=gen)
    return y, x, a, b, slots.to(torch.int32).to(DEVICE)


def _float64_result(y, x, a, b, slots):
    want = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[t] += (x[t].double() @ a[s].double().t()) @ b[s].double().t()
    return want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,k,n,rank,adapters", [
    (5, 64, 96, 8, 2),       # fewer rows than a block; rank below the 16-wide tile
    (70, 96, 200, 16, 3),    # several row blocks mixing adapters, n not a multiple of the tile
    (33, 128, 64, 48, 1),    # a fused layer's stacked ranks (3 x 16)
])
def test_add_lora_matches_float64(dtype, tokens, k, n, rank, adapters):
    gen = torch.Generator().manual_seed(tokens * 7 + rank)
    y, x, a, b, slots = _case(dtype, tokens, k, n, rank, adapters, gen)
    want = _float64_result(y, x, a, b, slots)
    at_dtype = y.cpu().clone()  # the same computation in PyTorch at dtype, for the error bound
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            at_dtype[t] += (x[t].cpu() @ a[s].cpu().t()) @ b[s].cpu().t()
    untouched = (slots < 0).cpu()
    before = y.clone()
    out = kernels.add_lora.triton(y, x, a, b, slots)
    assert out is y
    assert_accurate(y, want, at_dtype)
    assert torch.equal(y.cpu()[untouched], before.cpu()[untouched])  # rows without an adapter


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_and_reference_round_alike(dtype):
    gen = torch.Generator().manual_seed(3)
    y, x, a, b, slots = _case(dtype, 40, 64, 80, 16, 3, gen)
    ref = reference.add_lora_ref(y.clone().cpu(), x.cpu(), a.cpu(), b.cpu(), slots.cpu())
    out = kernels.add_lora.triton(y, x, a, b, slots).cpu()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (out.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()


def test_each_row_gets_its_own_adapter():
    """One-hot adapters: adapter s adds s + 1 to column s of its rows, so any row given another
    adapter's delta, two deltas, or none shows in the exact values."""
    tokens, k, n, adapters = 37, 16, 8, 4
    x = torch.zeros(tokens, k, device=DEVICE)
    x[:, 0] = 1.0
    a = torch.zeros(adapters, 16, k, device=DEVICE)
    a[:, 0, 0] = 1.0
    b = torch.zeros(adapters, n, 16, device=DEVICE)
    for s in range(adapters):
        b[s, s, 0] = s + 1.0
    slots = torch.tensor([(t % 5) - 1 for t in range(tokens)], dtype=torch.int32, device=DEVICE)
    y = torch.zeros(tokens, n, device=DEVICE)
    kernels.add_lora.triton(y, x, a, b, slots)
    want = torch.zeros(tokens, n)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[t, s] = s + 1.0
    assert torch.equal(y.cpu(), want)


def test_bad_arguments_are_named():
    x = torch.zeros(4, 8, device=DEVICE)
    y = torch.zeros(4, 6, device=DEVICE)
    a, b = torch.zeros(2, 16, 8, device=DEVICE), torch.zeros(2, 6, 16, device=DEVICE)
    slots = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"^add_lora: lora_b must have shape \[S, N, R\] = \(2, 6, 16\), got \(2, 6, 8\)$"):
        kernels.add_lora.triton(y, x, a, b[:, :, :8].contiguous(), slots)
    with pytest.raises(ValueError, match=r"^add_lora: slots must have shape \[T\] = \(4,\), got \(3,\)$"):
        reference.add_lora_ref(y, x, a, b, slots[:3])
    with pytest.raises(ValueError, match=r"^add_lora: slots must have dtype torch.int32 or torch.int64, got torch.float32$"):
        kernels.add_lora.triton(y, x, a, b, slots.float())
