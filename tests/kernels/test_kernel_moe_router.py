"""topk_softmax (the MoE router's selection in one kernel) against the PyTorch reference, which
follows Hugging Face's MoE blocks: the same experts in the same order, the same weights (up to
float32 exp rounding, or the rounding to the model dtype), and clear argument errors."""

import re

import pytest
import torch
from kernel_checks import DEVICE

from tritium import kernels
from tritium.kernels import reference


@pytest.mark.parametrize("m,experts,top_k", [(1, 128, 8), (37, 128, 8), (5, 8, 2), (9, 60, 4), (3, 1, 1),
                                             (20, 16, 16)])
@pytest.mark.parametrize("renormalize,round_to", [(True, None), (False, torch.bfloat16), (True, torch.float16)])
def test_matches_the_reference(m, experts, top_k, renormalize, round_to):
    gen = torch.Generator().manual_seed(m * experts + top_k)
    logits = (torch.randn(m, experts, generator=gen) * 3).to(DEVICE)  # float32: no ties
    weights, ids = kernels.topk_softmax.triton(logits, top_k, renormalize, round_to)
    ref_w, ref_i = reference.topk_softmax_ref(logits.cpu(), top_k, renormalize, round_to)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.cpu(), ref_i)
    tol = 1e-6 if round_to is None else 2 ** -7  # one bf16 / fp16 step at most
    assert torch.allclose(weights.cpu(), ref_w, rtol=tol, atol=1e-7)
    if renormalize and round_to is None:
        assert torch.allclose(weights.sum(-1).cpu(), torch.ones(m), atol=1e-6)


def test_bf16_logits_with_ties_pick_the_lower_expert_id():
    """bf16 logits tie often among 128 experts: the kernel takes the lower id of equal ones, so
    its weights are the reference's, and each id's probability is its weight."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 128, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    weights, ids = kernels.topk_softmax.triton(logits, 8, False)
    ref_w, _ = reference.topk_softmax_ref(logits.cpu(), 8, False)
    probs = torch.softmax(logits.cpu().float(), dim=-1)
    assert torch.allclose(weights.cpu(), ref_w, rtol=1e-6)
    assert torch.allclose(probs.gather(1, ids.cpu().long()), weights.cpu(), rtol=1e-6)
    for row_w, row_i in zip(weights.cpu(), ids.cpu()):
        for k in range(7):  # descending; among equal weights, increasing ids
            assert row_w[k] > row_w[k + 1] or (row_w[k] == row_w[k + 1] and row_i[k] < row_i[k + 1])


def test_nan_and_infinite_logits_still_give_valid_expert_ids():
    """Ids index the experts' weights: a NaN or infinite row must not give one past the end."""
    logits = torch.randn(4, 60, device=DEVICE)
    logits[0, 3] = float("nan")
    logits[1] = float("nan")
    logits[2, 7] = float("inf")
    logits[3] = float("-inf")
    _, ids = kernels.topk_softmax.triton(logits, 8, True)
    assert bool(((ids >= 0) & (ids < 60)).all())
    assert all(len(set(row)) == 8 for row in ids.tolist())


def test_strided_rows_and_no_tokens():
    logits = torch.randn(6, 256, device=DEVICE)[:, :128]  # a row stride of 256
    weights, ids = kernels.topk_softmax.triton(logits, 8, True)
    ref_w, ref_i = reference.topk_softmax_ref(logits.cpu(), 8, True)
    assert torch.equal(ids.cpu(), ref_i) and torch.allclose(weights.cpu(), ref_w, atol=1e-6)
    empty = kernels.topk_softmax.triton(torch.zeros(0, 8, device=DEVICE), 2, True)
    assert [tuple(t.shape) for t in empty] == [(0, 2), (0, 2)]


@pytest.mark.parametrize("args,message", [
    ((torch.zeros(2, 8), 9, True), "topk_softmax: top_k must be an int in 1..8, got 9"),
    ((torch.zeros(2, 8), 0, True), "topk_softmax: top_k must be an int in 1..8, got 0"),
    ((torch.zeros(2, 2048), 2, True), "topk_softmax: logits must have 1 to 1024 experts, got 2048"),
    ((torch.zeros(2, 8, dtype=torch.int32), 2, True), "topk_softmax: logits must have dtype"),
])
def test_argument_errors(args, message):
    for fn in (kernels.topk_softmax.triton, reference.topk_softmax_ref):
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            fn(args[0].to(DEVICE) if fn is kernels.topk_softmax else args[0], *args[1:])
