"""Penalty counts on the device (backend/layers/penalties.py): slots, their reuse, preemption, and
the penalties they give against a reference computed from the tokens on the host."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tritium import LLM, SamplingParams
from tritium.layers.penalties import PenaltyCounts
from tritium.layers.sampler import Sampler
from tritium.core.sequence import PLACEHOLDER, Sequence, SequenceStatus

PENALTIES = dict(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3)


def seq(tokens: list[int], num_prompt: int, **params) -> Sequence:
    s = Sequence("r", tokens, num_prompt, SamplingParams(**params))
    s.status = SequenceStatus.RUNNING
    return s


def test_slots_are_filled_from_the_host_once_then_counted_on_the_device():
    counts = PenaltyCounts(3, 10, torch.device("cpu"))
    a = seq([1, 2, 2, 5, 5, 5, PLACEHOLDER], 3, **PENALTIES)  # prompt 1 2 2, output 5 5 5, one in flight
    b = seq([7], 1, **PENALTIES)
    assert counts.slots_for([a, b]) == [0, 1]
    assert counts.output_counts[0].tolist() == [0, 0, 0, 0, 0, 3, 0, 0, 0, 0]  # no placeholder
    assert counts.in_prompt[0].nonzero().flatten().tolist() == [1, 2]
    assert counts.in_prompt[1].nonzero().flatten().tolist() == [7] and counts.output_counts[1].sum() == 0
    counts.count(torch.tensor([0, 1]), torch.tensor([4, 7]))
    a.token_ids.append(9)  # the host's tokens are not read again for a slot it holds
    assert counts.slots_for([b, a]) == [1, 0]
    assert counts.output_counts[0, 4] == 1 and counts.output_counts[0, 9] == 0 and counts.output_counts[1, 7] == 1
    # 16-bit counts where the sequences are short enough, 32-bit otherwise
    assert counts.output_counts.dtype == torch.int32
    assert PenaltyCounts(1, 10, torch.device("cpu"), max_count=8192).output_counts.dtype == torch.int16


def test_slots_of_sequences_that_stopped_running_are_reused_and_refilled():
    counts = PenaltyCounts(2, 10, torch.device("cpu"))
    a, b, c = seq([1, 3], 1, **PENALTIES), seq([2, 4], 1, **PENALTIES), seq([6, 6, 8], 2, **PENALTIES)
    assert counts.slots_for([a, b]) == [0, 1]
    with pytest.raises(RuntimeError) as e:
        counts.slots_for([b, c])
    assert str(e.value) == ("penalties: all 2 count slots are taken (more sequences with penalties "
                            "than max_num_seqs)")
    counts.release([a.seq_id])  # preempted: its slot goes, it is filled again later
    assert counts.slots_for([b, c]) == [1, 0]
    assert counts.output_counts[0].tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 1, 0]  # c's, not a's
    assert counts.in_prompt[0].nonzero().flatten().tolist() == [6]
    counts.release([b.seq_id, 12345])  # finished (an id without a slot is no error)
    assert counts.slots_for([a]) == [1]  # b's slot, now a's again from its host tokens
    assert counts.output_counts[1].tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0, 0]


def _reference_penalties(logits: torch.Tensor, rows) -> torch.Tensor:
    """vLLM's definitions, one row at a time from the host's tokens."""
    out = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        output = [t for t in r.token_ids[r.num_prompt_tokens:] if t >= 0]
        seen = set(t for t in r.token_ids if t >= 0)
        for t in seen:
            v = out[i, t]
            out[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(output):
            out[i, t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


def test_penalties_from_device_counts_equal_the_reference_for_some_rows():
    g = torch.Generator().manual_seed(3)
    vocab = 40
    rows = [SimpleNamespace(params=SamplingParams(temperature=0, **PENALTIES),
                            token_ids=torch.randint(0, vocab, (12,), generator=g).tolist(),
                            num_prompt_tokens=5, index=0, generator=None, grammar=None) for _ in range(3)]
    plain = SimpleNamespace(params=SamplingParams(temperature=0), token_ids=[1, 2, 3], num_prompt_tokens=3,
                            index=0, generator=None, grammar=None)
    rows[1].params = SamplingParams(temperature=0, repetition_penalty=0.7)  # (a row with one kind only)
    logits = torch.randn(4, vocab, generator=g) * 3
    batch = [rows[0], plain, rows[1], rows[2]]
    md = Sampler.prepare(batch, vocab, logits.device)
    got = Sampler._apply_penalties(logits.clone(), md)
    want = _reference_penalties(logits[[0, 2, 3]], [rows[0], rows[1], rows[2]])
    torch.testing.assert_close(got[[0, 2, 3]], want, rtol=0, atol=1e-6)
    assert torch.equal(got[1], logits[1])  # the plain row untouched


def test_penalized_requests_through_preemption_and_reused_slots_equal_each_alone(llama_dir):
    """Two slots for six penalized requests (two with n=2) in a cache so small that sequences
    are preempted and recomputed: each output equals that request's alone in a roomy engine."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (20, 35, 12, 28, 40, 16)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                             n=2 if i % 3 == 0 else 1, **PENALTIES) for i in range(len(prompts))]
    alone = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=256)
    want = [[c.token_ids for c in alone.generate([p], [sp])[0].outputs] for p, sp in zip(prompts, params)]
    tight = LLM(llama_dir, device="cpu", dtype="float32", max_num_seqs=2, block_size=16, num_kv_blocks=5,
                max_num_batched_tokens=32)
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want


def test_a_preempted_sequence_whose_slot_was_taken_is_refilled_with_its_output(llama_dir, monkeypatch):
    """Priority scheduling: b (priority 1) is preempted, c (priority 0) arrives and takes the
    slot b held while it waited, and b, admitted again with 19 tokens out, gets a slot filled
    from its host tokens. Every output equals that request's alone."""
    from tritium.layers import penalties
    from tritium.engine.request import accumulate
    from tritium import LLMEngine, EngineArgs

    fills = []
    fill = penalties.PenaltyCounts._fill
    monkeypatch.setattr(penalties.PenaltyCounts, "_fill", lambda self, new, proposed=None: (
        fills.append([(slot, s.seq_id, len(s.token_ids) - s.num_prompt_tokens) for slot, s in new]),
        fill(self, new, proposed)))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (30, 30, 12)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **PENALTIES)
    engine = LLMEngine(EngineArgs(model=llama_dir, device="cpu", dtype="float32", max_num_seqs=2, block_size=16,
                                  num_kv_blocks=6, scheduling_policy="priority"))
    names = {}  # seq id -> request id (the worker knows sequences by id only)

    def add(rid: str, prompt: list[int], priority: int) -> None:
        engine.add_request(rid, prompt, params, priority=priority)
        names[engine.requests[rid].seqs[0].seq_id] = rid
    add("a", prompts[0], 0)
    add("b", prompts[1], 1)
    got: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = accumulate(got.get(out.request_id), out)
        if engine.scheduler.num_preemptions and "c" not in engine.requests and "c" not in got:
            add("c", prompts[2], 0)
    assert engine.scheduler.num_preemptions == 1
    assert [[(slot, names[sid], n) for slot, sid, n in fill] for fill in fills] == [
        [(0, "a", 0), (1, "b", 0)], [(1, "c", 0)], [(0, "b", 19)]]
    alone = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=256)
    for rid, prompt in zip("abc", prompts):
        assert got[rid].outputs[0].token_ids == alone.generate([prompt], [params])[0].outputs[0].token_ids, rid


def test_a_verification_run_is_penalized_with_its_proposals_and_counts_only_kept_tokens():
    """One sequence verifying proposals 4 5 6 (rows 0-3 of its run): row j's frequency penalty
    counts the proposals before it; row 1 rejects 5 (it takes 7, because 4 now counts once), so
    rows 2 and 3 (after a proposal that did not happen) are sampled but not counted. A new slot
    is filled from the tokens before the proposals."""
    counts = PenaltyCounts(2, 10, torch.device("cpu"))
    s = seq([1, 2, 3, 4, 5, 6], 2, temperature=0, frequency_penalty=1.0)  # output 3, proposals 4 5 6
    rows, drafts = [s] * 4, [4, 5, 6, -1]
    logits = torch.full((4, 10), -1.0)
    logits[0, 4] = 3.0  # row 0 takes 4 (its proposal)
    logits[1, 4], logits[1, 7] = 5.0, 4.5  # 5.0 - 1 (4 was proposed before) < 4.5: takes 7, not 5
    logits[2, 8], logits[3, 9] = 3.0, 3.0
    logits[:, 3] = 3.5  # 3 is in the output: 2.5 everywhere, below the rows' picks
    md = Sampler.prepare(rows, 10, torch.device("cpu"), counts=counts, drafts=drafts)
    assert counts.output_counts[0].tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0, 0]  # not 4, 5, 6
    assert Sampler(counts)(logits, rows, md).token_ids.tolist() == [4, 7, 8, 9]
    assert counts.output_counts[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 0, 0]  # 8, 9 not kept
    # Two runs side by side: s misses its first proposal, so only that row's token counts; t
    # (a new slot, filled from the tokens before its proposal) takes its proposal, so both count.
    t = seq([1, 2, 3], 1, temperature=0, presence_penalty=0.5)
    s.token_ids[:] = [1, 2, 3, 4, 7, 0, 2]  # 4 7 kept last step; proposals 0 2
    t.token_ids += [5]  # proposal 5
    rows, drafts = [s, s, s, t, t], [0, 2, -1, 5, -1]
    logits = torch.full((5, 10), -1.0)
    logits[0, 1], logits[1, 2], logits[2, 6], logits[3, 5], logits[4, 6] = 2.0, 2.0, 2.0, 2.0, 2.0
    md = Sampler.prepare(rows, 10, torch.device("cpu"), counts=counts, drafts=drafts)
    assert counts.output_counts[1].tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 0, 0]  # t's output 2 3, not 5
    assert Sampler(counts)(logits, rows, md).token_ids.tolist() == [1, 2, 6, 5, 6]
    assert counts.output_counts[0].tolist() == [0, 1, 0, 1, 1, 0, 0, 1, 0, 0]
    assert counts.output_counts[1].tolist() == [0, 0, 1, 1, 0, 1, 1, 0, 0, 0]


def test_verification_rows_are_penalized_as_if_their_proposals_had_been_sampled():
    """Each penalized row of a batch with verification runs gets exactly the logits the
    reference gives it with its slot's counts plus the proposals before it: positive and
    negative logits, a token proposed twice, a proposal already in the prompt, penalized rows
    after an unpenalized one (rows of the batch != rows among the penalized)."""
    from tritium.kernels.reference import apply_penalties_ref
    counts = PenaltyCounts(4, 12, torch.device("cpu"))
    plain = seq([1, 2, 3], 2, temperature=0)
    a = seq([1, 2, 5, 5, 7, 9, 7, 1], 3, temperature=0, **PENALTIES)  # prompt 1 2 5, output 5 7, proposals 9 7 1
    b = seq([4, 6, 8, 6], 2, temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    rows, drafts = [plain, a, a, a, a, b], [-1, 9, 7, 1, -1, -1]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 12, generator=g) * 3
    logits[2, 9], logits[3, 7], logits[4, 7], logits[4, 1] = 2.5, -1.5, 1.25, -2.0
    md = Sampler.prepare(rows, 12, torch.device("cpu"), counts=counts, drafts=drafts)
    from tritium.layers.penalties import apply_penalties
    out = apply_penalties(logits.clone(), md.penalties)
    known = {1: [5, 7], 2: [5, 7, 9], 3: [5, 7, 9, 7], 4: [5, 7, 9, 7, 1], 5: [8, 6]}
    prompts = {1: [1, 2, 5], 2: [1, 2, 5], 3: [1, 2, 5], 4: [1, 2, 5], 5: [4, 6]}
    params = {r: rows[r].params for r in known}
    want = logits.clone()
    for r, output in known.items():
        c = torch.bincount(torch.tensor(output), minlength=12)[None].to(torch.int32)
        p = torch.zeros(1, 12, dtype=torch.bool)
        p[0, prompts[r]] = True
        ps = params[r]
        apply_penalties_ref(want[r:r + 1], None, torch.tensor([0]), c, p, torch.tensor([ps.repetition_penalty]),
                            torch.tensor([ps.frequency_penalty]), torch.tensor([ps.presence_penalty]))
    assert torch.equal(out, want)
