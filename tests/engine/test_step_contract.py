"""The worker's side of the step contract: a running sequence's sampling parameters are written
into per-slot tensors once, when it first samples, and every later step reads them by slot
(backend/layers/sampling_table.py); the scheduler's finished_seq_ids free the slots."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backend import LLM, SamplingParams
from backend.layers.sampler import Sampler
from backend.layers.sampling_table import SamplingTable

CPU = torch.device("cpu")
VOCAB = 50


def _row(seq_id: int, params: SamplingParams, tokens=(1, 2, 3)) -> SimpleNamespace:
    return SimpleNamespace(seq_id=seq_id, params=params, token_ids=list(tokens), num_prompt_tokens=len(tokens),
                           index=0, grammar=None)


class _SealedRow:
    """A row already admitted: reading its parameters from it is a failure."""

    def __init__(self, row: SimpleNamespace) -> None:
        self.seq_id, self.token_ids, self.num_prompt_tokens = row.seq_id, row.token_ids, row.num_prompt_tokens
        self.index, self.grammar = row.index, row.grammar

    @property
    def params(self):
        raise AssertionError(f"the parameters of sequence {self.seq_id} were read again")


def test_parameters_are_written_when_a_sequence_first_samples_then_read_by_slot(monkeypatch):
    table = SamplingTable(4, VOCAB, CPU)
    rows = [_row(10, SamplingParams(temperature=0.5, top_p=0.9, seed=7)),
            _row(11, SamplingParams(temperature=0)),
            _row(12, SamplingParams(temperature=1.3, top_k=5, min_p=0.1, presence_penalty=0.5))]
    md = Sampler.prepare(rows, VOCAB, CPU, table=table)
    assert table.rows_written == 3
    assert md.temperature.tolist() == pytest.approx([0.5, 1.0, 1.3])
    assert md.top_k.tolist() == [VOCAB, VOCAB, 5]
    assert md.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0])
    assert md.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1])
    assert md.greedy.tolist() == [False, True, False]
    assert md.seeded == [(0, 7, 0, 3)]  # (row, seed, sample index, token position)
    assert md.penalties.rows.tolist() == [2] and md.penalties.presence.tolist() == pytest.approx([0.5])

    # Later steps: the same sequences in another order, their parameters neither read from the
    # rows nor written again; the tensors come from their slots.
    def no_write(self, new):
        raise AssertionError(f"slots written again: {[slot for slot, _ in new]}")
    monkeypatch.setattr(SamplingTable, "_write", no_write)
    sealed = [_SealedRow(r) for r in reversed(rows)]
    for r in sealed:
        r.token_ids.append(4)
    md = Sampler.prepare(sealed, VOCAB, CPU, table=table)
    assert md.temperature.tolist() == pytest.approx([1.3, 1.0, 0.5])
    assert md.top_k.tolist() == [5, VOCAB, VOCAB]
    assert md.greedy.tolist() == [False, True, False]
    assert md.seeded == [(2, 7, 0, 4)]
    assert md.penalties.rows.tolist() == [0] and md.penalties.presence.tolist() == pytest.approx([0.5])
    md = Sampler.prepare([sealed[1]], VOCAB, CPU, table=table)  # the greedy one alone
    assert md.all_greedy and md.temperature is None and md.penalties is None
    monkeypatch.undo()

    # A finished sequence's slot is freed and the next new sequence's parameters take it.
    table.release([11])
    assert table.num_free == 2 and not table.holds(11)
    md = Sampler.prepare([sealed[0], _row(13, SamplingParams(temperature=0.25, top_k=3))], VOCAB, CPU, table=table)
    assert table.rows_written == 4 and table.holds(13)
    assert md.temperature.tolist() == pytest.approx([1.3, 0.25])
    assert md.top_k.tolist() == [5, 3]


def test_a_full_table_says_so():
    table = SamplingTable(1, VOCAB, CPU)
    Sampler.prepare([_row(1, SamplingParams(temperature=0.7))], VOCAB, CPU, table=table)
    with pytest.raises(RuntimeError) as e:
        Sampler.prepare([_row(2, SamplingParams(temperature=0.7))], VOCAB, CPU, table=table)
    assert str(e.value) == ("sampling: all 1 parameter slots are taken (more sequences sampling "
                            "than max_num_seqs)")


def test_the_engine_writes_each_sequence_once_and_frees_its_slot(llama_dir, monkeypatch):
    """Three requests (one of n=2) decode 12 tokens each: four sequences, each written once
    however many steps sample it. The next batch's first step frees the finished sequences'
    slots, and seeded requests give the same tokens from reused slots."""
    llm = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=256, max_num_seqs=4)
    table = llm.engine.executor.runner.sampler.table
    written: list[int] = []
    write = SamplingTable._write
    monkeypatch.setattr(SamplingTable, "_write", lambda self, new: (
        written.extend(r.seq_id for _, r in new), write(self, new)))
    prompts = [[5, 9, 13, 2], [7, 7, 8], [100, 3, 4, 5, 6]]
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=2, n=2, max_tokens=12, ignore_eos=True)]
    first = llm.generate(prompts, params)
    assert [len(c.token_ids) for o in first for c in o.outputs] == [12] * 4
    assert len(written) == 4 and len(set(written)) == 4
    seqs_of_first = set(written)
    assert {sid for sid in seqs_of_first if table.holds(sid)} == seqs_of_first  # freed by the next step
    written.clear()
    second = llm.generate(prompts, params)
    assert len(written) == 4 and not set(written) & seqs_of_first
    assert not any(table.holds(sid) for sid in seqs_of_first)
    assert [[c.token_ids for c in o.outputs] for o in second] == [[c.token_ids for c in o.outputs] for o in first]


class _WatchedTokens(list):
    """A sequence's token list that fails when changed while the runner works."""
    runner_at_work: list[bool] = []

    def _guard(self) -> None:
        if self.runner_at_work:
            raise AssertionError("the runner changed a sequence's tokens")

    def append(self, x):
        self._guard()
        super().append(x)

    def extend(self, xs):
        self._guard()
        super().extend(xs)

    def __setitem__(self, i, x):
        self._guard()
        super().__setitem__(i, x)

    def __delitem__(self, i):
        self._guard()
        super().__delitem__(i)


def _watch_the_runner(llm: LLM) -> dict[str, int]:
    """Fail when the runner sets a field of a Sequence or changes its tokens while it launches
    a step or a deferred sampling; count the steps it launched of each kind."""
    at_work = _WatchedTokens.runner_at_work
    executor = llm.engine.executor
    execute = executor.execute_model
    launched = {"steps": 0, "deferred": 0, "verifying": 0}

    def at_work_on(call, *args):
        at_work.append(True)
        try:
            return call(*args)
        finally:
            at_work.pop()

    def watched_execute(step):
        for row in step.sample_rows:
            if not isinstance(row.seq.token_ids, _WatchedTokens):
                row.seq.token_ids = _WatchedTokens(row.seq.token_ids)
        launched["steps"] += 1
        launched["verifying"] += bool(step.spec_runs)
        pending = at_work_on(execute, step)
        if pending.deferred:
            launched["deferred"] += 1
            sample = pending.sample
            pending.sample = lambda *args: at_work_on(sample, *args)
        return pending
    executor.execute_model = watched_execute
    return launched


def test_the_runner_writes_nothing_of_the_engine_sequences(llama_dir, monkeypatch):
    """While the runner launches a step (or a deferred sampling), no field of any of the
    engine's Sequences is set and no token list changes: speculative verification (the rows see
    their proposals), seeded sampling, penalties, forks, and a grammar's deferred sampling."""
    from backend.engine.sequence import Sequence

    def guarded_setattr(self, name, value):
        if _WatchedTokens.runner_at_work:
            raise AssertionError(f"the runner set Sequence.{name}")
        object.__setattr__(self, name, value)
    monkeypatch.setattr(Sequence, "__setattr__", guarded_setattr)
    loop = [5, 6, 7, 8] * 6
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True, n=2),
              SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=16, ignore_eos=True)]
    speculating = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=256,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    launched = _watch_the_runner(speculating)
    outs = speculating.generate([loop, loop[:10], [9, 10, 11] * 5], params)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [16] * 4
    assert launched["verifying"], launched
    pipelined = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=256)
    launched = _watch_the_runner(pipelined)
    guided = SamplingParams(temperature=0, max_tokens=16, structured_outputs={"regex": "[a-z]{40}"})
    outs = pipelined.generate([loop, loop[:10], [9, 10, 11] * 5, loop], params + [guided])
    assert [len(c.token_ids) for o in outs for c in o.outputs][:4] == [16] * 4
    assert outs[3].outputs[0].text.isalpha() and outs[3].outputs[0].text.islower()
    assert launched["deferred"], launched
