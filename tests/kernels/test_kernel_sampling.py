"""greedy_sample: the first argmax of each row, exactly as torch.argmax picks it, and its
log-softmax value, against the float64 reference."""

import pytest
import torch
from kernel_checks import DEVICE, DTYPES

import kernels
from kernels import reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab, block", [(5, 1000, 256), (3, 4096, 4096), (2, 70, 4096), (1, 1, 64)])
def test_matches_reference(dtype, rows, vocab, block):
    g = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype).to(DEVICE)
    token_ids, logprobs = kernels.greedy_sample(logits, block=block)
    ref_ids, ref_lp = reference.greedy_sample_ref(logits.cpu().double())
    assert token_ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(token_ids.cpu(), ref_ids)
    torch.testing.assert_close(logprobs.cpu().double(), ref_lp.double(), rtol=1e-5, atol=1e-5)


def test_ties_go_to_the_lowest_index_across_lanes_and_blocks():
    vocab, block = 600, 128
    logits = torch.zeros(4, vocab, device=DEVICE)
    logits[0, [517, 9, 300]] = 5.0  # 9 and 300 in different lanes of different blocks
    logits[1, [130, 2]] = 5.0  # 130 = lane 2 of the second block, 2 = lane 2 of the first
    logits[2, [599, 598]] = 5.0  # in the last, partial block
    logits[3] = 1.0  # all equal: index 0
    token_ids, logprobs = kernels.greedy_sample(logits, block=block)
    assert token_ids.tolist() == [9, 2, 598, 0]
    assert torch.equal(token_ids.cpu(), logits.cpu().argmax(dim=-1))
    torch.testing.assert_close(logprobs[3].item(), -torch.log(torch.tensor(600.0)).item())


def test_masked_entries_and_strided_rows():
    logits = torch.full((3, 2 * 300), float("-inf"), device=DEVICE)
    g = torch.Generator().manual_seed(1)
    logits[:, 250:300] = torch.randn(3, 50, generator=g).to(DEVICE)  # only these can be sampled
    view = logits[:, :300]  # row stride 600
    token_ids, logprobs = kernels.greedy_sample(view, block=64)
    ref_ids, ref_lp = reference.greedy_sample_ref(view.cpu().double())
    assert torch.equal(token_ids.cpu(), ref_ids)
    torch.testing.assert_close(logprobs.cpu().double(), ref_lp, rtol=1e-5, atol=1e-5)


def test_empty_and_bad_input():
    ids, lps = kernels.greedy_sample(torch.zeros(0, 10, device=DEVICE))
    assert ids.shape == (0,) and lps.shape == (0,)
    with pytest.raises(ValueError, match=r"^greedy_sample: logits must be 2-D \[R, V\], got shape \(10,\)$"):
        kernels.greedy_sample(torch.zeros(10, device=DEVICE))
    with pytest.raises(ValueError, match=r"^greedy_sample: logits must have dtype .* got torch.int64$"):
        kernels.greedy_sample(torch.zeros(2, 10, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match=r"^greedy_sample: logits must be contiguous in its last dimension"):
        kernels.greedy_sample(torch.zeros(10, 4, device=DEVICE).t())
