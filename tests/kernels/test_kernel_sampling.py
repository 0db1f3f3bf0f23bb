"""greedy_sample: the first argmax of each row, exactly as torch.argmax picks it, and its
log-softmax value, against the float64 reference."""

import pytest
import torch
from kernel_checks import DEVICE, DTYPES

from tritium import kernels
from tritium.kernels import reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab, block", [(5, 1000, 256), (3, 4096, 4096), (2, 70, 4096), (1, 1, 64)])
def test_matches_reference(dtype, rows, vocab, block):
    g = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype).to(DEVICE)
    token_ids, logprobs = kernels.greedy_sample.triton(logits, block=block)
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
    token_ids, logprobs = kernels.greedy_sample.triton(logits, block=block)
    assert token_ids.tolist() == [9, 2, 598, 0]
    assert torch.equal(token_ids.cpu(), logits.cpu().argmax(dim=-1))
    torch.testing.assert_close(logprobs[3].item(), -torch.log(torch.tensor(600.0)).item())


def test_masked_entries_and_strided_rows():
    logits = torch.full((3, 2 * 300), float("-inf"), device=DEVICE)
    g = torch.Generator().manual_seed(1)
    logits[:, 250:300] = torch.randn(3, 50, generator=g).to(DEVICE)  # only these can be sampled
    view = logits[:, :300]  # row stride 600
    token_ids, logprobs = kernels.greedy_sample.triton(view, block=64)
    ref_ids, ref_lp = reference.greedy_sample_ref(view.cpu().double())
    assert torch.equal(token_ids.cpu(), ref_ids)
    torch.testing.assert_close(logprobs.cpu().double(), ref_lp, rtol=1e-5, atol=1e-5)


def test_empty_and_bad_input():
    ids, lps = kernels.greedy_sample.triton(torch.zeros(0, 10, device=DEVICE))
    assert ids.shape == (0,) and lps.shape == (0,)
    with pytest.raises(ValueError, match=r"^greedy_sample: logits must be 2-D \[R, V\], got shape \(10,\)$"):
        kernels.greedy_sample.triton(torch.zeros(10, device=DEVICE))
    with pytest.raises(ValueError, match=r"^greedy_sample: logits must have dtype .* got torch.int64$"):
        kernels.greedy_sample.triton(torch.zeros(2, 10, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match=r"^greedy_sample: logits must be contiguous in its last dimension"):
        kernels.greedy_sample.triton(torch.zeros(10, 4, device=DEVICE).t())


def _penalty_case(rows_given: bool, counts_dtype, rep: bool, additive: bool, vocab=300, slots_total=5):
    g = torch.Generator().manual_seed(vocab + rows_given + 2 * rep + 4 * additive)
    logits = torch.randn(6, vocab, generator=g) * 3
    counts = torch.randint(0, 4, (slots_total, vocab), generator=g).to(counts_dtype)
    counts[counts == 1] = 0  # many zero counts: seen and unseen tokens both
    in_prompt = torch.rand(slots_total, vocab, generator=g) < 0.2
    rows = torch.tensor([4, 0, 3]) if rows_given else None
    q = 3 if rows_given else 6
    slots = torch.randint(0, slots_total, (q,), generator=g)
    repetition = (torch.rand(q, generator=g) + 0.5) if rep else None
    frequency = torch.rand(q, generator=g) if additive else None
    presence = torch.rand(q, generator=g) if additive else None
    return logits, rows, slots, counts, in_prompt, repetition, frequency, presence


def _penalty_oracle(logits, rows, slots, counts, in_prompt, repetition, frequency, presence):
    """vLLM's definitions, one row and one token at a time, in float32."""
    out = logits.clone()
    for q, slot in enumerate(slots.tolist()):
        r = rows[q].item() if rows is not None else q
        for t in range(logits.shape[1]):
            x, c = out[r, t], counts[slot, t].float()
            if repetition is not None and (c > 0 or in_prompt[slot, t]):
                x = x / repetition[q] if x > 0 else x * repetition[q]
            if frequency is not None:
                x = x - (frequency[q] * c + presence[q] * (c > 0).float())
            out[r, t] = x
    return out


@pytest.mark.parametrize("rows_given", [False, True])
@pytest.mark.parametrize("counts_dtype", [torch.int16, torch.int32])
@pytest.mark.parametrize("rep, additive", [(True, True), (True, False), (False, True)])
def test_penalties_match_the_oracle_exactly(rows_given, counts_dtype, rep, additive):
    case = _penalty_case(rows_given, counts_dtype, rep, additive)
    want = _penalty_oracle(*case)
    on_device = [t.clone().to(DEVICE) if t is not None else None for t in case]
    got = kernels.apply_penalties.triton(*on_device, block=128)  # three blocks, the last partial
    assert torch.equal(got.cpu(), want)
    ref = reference.apply_penalties_ref(*[t.clone() if t is not None else None for t in case])
    assert torch.equal(ref, want)
    if rows_given:  # rows without penalties untouched
        untouched = [1, 2, 5]
        assert torch.equal(got.cpu()[untouched], case[0][untouched])


def test_penalties_check_their_arguments():
    logits, rows, slots, counts, in_prompt, rep, freq, pres = _penalty_case(True, torch.int32, True, True)
    with pytest.raises(ValueError, match=r"^apply_penalties: frequency and presence must be given together$"):
        kernels.apply_penalties.triton(logits, rows, slots, counts, in_prompt, rep, freq, None)
    with pytest.raises(ValueError, match=r"^apply_penalties: slots must have one entry per logits row when "
                                         r"rows is None, got 3 for 6 rows$"):
        kernels.apply_penalties.triton(logits, None, slots, counts, in_prompt, rep, freq, pres)
    with pytest.raises(ValueError, match=r"^apply_penalties: in_prompt must have the logits' 300 columns, "
                                         r"got shape \(5, 299\)$"):
        kernels.apply_penalties.triton(logits, rows, slots, counts, in_prompt[:, :299], rep, freq, pres)
    with pytest.raises(ValueError, match=r"^apply_penalties: logits must have dtype"):
        kernels.apply_penalties.triton(logits.half(), rows, slots, counts, in_prompt, rep, freq, pres)
