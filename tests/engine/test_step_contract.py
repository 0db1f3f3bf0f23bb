"""The step contract: the step is data only (it pickles, holds no engine object, names sequences
by id, and sends a sequence's tokens, parameters and blocks once); a sequence's sampling
parameters are written into per-slot tensors once, when the worker takes it in, and every later
step reads them by slot (backend/layers/sampling_table.py); finished_seq_ids free the slots."""
from __future__ import annotations

import dataclasses
import pickle
from types import SimpleNamespace

import pytest
import torch

from tritium import LLM, SamplingParams
from tritium.layers.sampler import Sampler
from tritium.layers.sampling_table import SamplingTable

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


def test_parameters_are_written_when_a_sequence_is_added_then_read_by_slot(monkeypatch):
    table = SamplingTable(4, VOCAB, CPU)
    rows = [_row(10, SamplingParams(temperature=0.5, top_p=0.9, seed=7)),
            _row(11, SamplingParams(temperature=0)),
            _row(12, SamplingParams(temperature=1.3, top_k=5, min_p=0.1, presence_penalty=0.5))]
    table.add(rows)
    assert table.rows_written == 3
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
    new = _row(13, SamplingParams(temperature=0.25, top_k=3))
    with pytest.raises(RuntimeError) as e:
        Sampler.prepare([sealed[0], new], VOCAB, CPU, table=table)
    assert str(e.value) == "sampling: sequence 13 has no parameter slot (it was never added, or was released)"
    table.add([new])
    md = Sampler.prepare([sealed[0], new], VOCAB, CPU, table=table)
    assert table.rows_written == 4 and table.holds(13)
    assert md.temperature.tolist() == pytest.approx([1.3, 0.25])
    assert md.top_k.tolist() == [5, 3]


def test_a_full_table_says_so():
    table = SamplingTable(1, VOCAB, CPU)
    table.add([_row(1, SamplingParams(temperature=0.7))])
    with pytest.raises(RuntimeError) as e:
        table.add([_row(2, SamplingParams(temperature=0.7))])
    assert str(e.value) == ("sampling: all 1 parameter slots are taken (more sequences running "
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


def _no_engine_object(value, path: str = "step") -> None:
    """Fail on anything in the step but plain data: the records of backend/step.py, containers,
    numbers, strings, SamplingParams and a grammar's host bitmask."""
    from tritium.sampling_params import SamplingParams as Params
    from tritium import step as records
    if value is None or isinstance(value, (bool, int, float, str, Params, torch.Tensor)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _no_engine_object(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_engine_object(v, f"{path}[{k!r}]")
    elif dataclasses.is_dataclass(value) and type(value).__module__ == records.__name__:
        for f in dataclasses.fields(value):
            _no_engine_object(getattr(value, f.name), f"{path}.{f.name}")
    else:
        raise AssertionError(f"{path} is a {type(value).__name__}, not data")


def _watch_the_steps(llm: LLM) -> dict[str, int]:
    """Check every step the executor gets: it pickles, holds only data, sends as new exactly the
    sequences the worker does not hold, and a held sequence's change is its computed count and
    block-table tail, nothing more (no token list, no parameters). Counts what it saw."""
    executor = llm.engine.executor
    execute = executor.execute_model
    seen = {"steps": 0, "new": 0, "cached": 0, "deferred": 0, "verifying": 0, "forks": 0}

    def watched_execute(step):
        _no_engine_object(step)
        copy = pickle.loads(pickle.dumps(step))
        assert dataclasses.replace(copy, grammar_bitmask=None) == dataclasses.replace(step, grammar_bitmask=None)
        if step.grammar_bitmask is not None:
            assert torch.equal(copy.grammar_bitmask.bitmask, step.grammar_bitmask.bitmask)
        freed = set(step.finished_seq_ids)
        for d in step.new_sequences:
            assert d.seq_id not in executor.runner.states or d.seq_id in freed
        for d in step.cached_sequences:
            assert d.seq_id in executor.runner.states and d.seq_id not in freed
            assert [f.name for f in dataclasses.fields(d)] == [
                "seq_id", "num_computed_tokens", "blocks_from", "new_block_ids"]
            assert len(d.new_block_ids) <= 2  # a copy-on-write block and a new one, at most
        scheduled = {it.seq_id for it in step.scheduled}
        assert scheduled == {d.seq_id for d in step.new_sequences + step.cached_sequences}
        seen["steps"] += 1
        seen["new"] += len(step.new_sequences)
        seen["cached"] += len(step.cached_sequences)
        seen["verifying"] += bool(step.spec_runs)
        seen["forks"] += len(step.forks)
        pending = execute(step)
        seen["deferred"] += pending.deferred
        return pending
    executor.execute_model = watched_execute
    return seen


def test_the_step_is_data_and_sends_a_sequence_once(llama_dir):
    """Speculative verification, seeded sampling, penalties, forks, a grammar's deferred
    sampling and preemption: every step is plain data; each sequence is sent whole once (again
    after a preemption), then as changes."""
    loop = [5, 6, 7, 8] * 6
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True, n=2),
              SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=16, ignore_eos=True)]
    speculating = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=256,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    seen = _watch_the_steps(speculating)
    outs = speculating.generate([loop, loop[:10], [9, 10, 11] * 5], params)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [16] * 4
    assert seen["verifying"] and seen["forks"] == 1, seen
    assert seen["new"] == 3 and seen["cached"] > 20, seen  # the fork's sibling is cloned, never sent
    pipelined = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=256)
    seen = _watch_the_steps(pipelined)
    guided = SamplingParams(temperature=0, max_tokens=16, structured_outputs={"regex": "[a-z]{40}"})
    outs = pipelined.generate([loop, loop[:10], [9, 10, 11] * 5, loop], params + [guided])
    assert [len(c.token_ids) for o in outs for c in o.outputs][:4] == [16] * 4
    assert outs[3].outputs[0].text.isalpha() and outs[3].outputs[0].text.islower()
    assert seen["deferred"] and seen["new"] == 4, seen
    tight = LLM(llama_dir, device="cpu", dtype="float32", max_num_seqs=2, block_size=16, num_kv_blocks=5,
                max_num_batched_tokens=32)
    seen = _watch_the_steps(tight)
    longer = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=30, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in pipelined.generate([loop, loop[:10]], longer)]
    outs = tight.generate([loop, loop[:10]], longer)
    assert tight.engine.scheduler.num_preemptions > 0
    assert seen["new"] == 2 + tight.engine.scheduler.num_preemptions, seen
    assert [o.outputs[0].token_ids for o in outs] == alone
