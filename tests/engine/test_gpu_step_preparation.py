"""The parts of the GPU step path that are plain Python, checked on the CPU: block-table padding,
the worker's block tables kept across steps by tail diffs, the decode graphs' context buckets, and the
start-up run of every eager kernel variant."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from tritium import EngineArgs, LLMEngine
from tritium.worker.cuda_graph import PrefillGraphs, context_buckets, prefill_capture_sizes
from tritium.core.block_manager import BlockManager
from tritium.worker.input_batch import prepare_batch
from tritium.worker.request_states import RequestStates
from tritium.worker.warmup import compile_step_variants
from tritium.core.worker_view import WorkerView
from tritium.step import (CachedSequenceData, Fork, NewSequenceData, ScheduledSequence,
                          SchedulerOutput)
from tritium.sampling_params import SamplingParams
from tritium.core.sequence import Sequence
from step_helpers import make_state, pack


def pack_states(out: SchedulerOutput, states: RequestStates):
    return prepare_batch(out.scheduled, states, 4)


def test_block_tables_are_padded_to_a_multiple_of_16():
    items = []
    for i, (n, new) in enumerate([(40, 1), (17 * 16 + 3, 1), (50, 50)]):
        s = make_state(i, list(range(n)), list(range(100 * i, 100 * i + -(-n // 16))), n - new)
        items.append((s, new))
    batch = pack(items, 16)
    assert batch.decode_block_tables.shape == (2, 32)  # 18 blocks, padded
    assert batch.decode_block_tables[1, :18].tolist() == list(range(100, 118))
    assert batch.decode_block_tables[1, 18:].tolist() == [0] * 14
    assert batch.prefill_block_tables.shape == (1, 16)  # 4 blocks, padded


def test_the_workers_block_tables_follow_every_change_by_tail_diffs():
    """The scheduler sends a held sequence only the tail of its block table that changed
    (`WorkerView`); the worker's tables (`RequestStates`) and its kept int32 rows must equal the
    block manager's after each kind of change between decode steps: appends, copy-on-write of
    the last block after a fork, a sequence freed and given new blocks of the same count (sent
    whole again), one that skips steps, one that finishes."""
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    view, states = WorkerView(), RequestStates()
    seqs = []
    for i in range(3):
        s = Sequence(str(i), list(range(10 + i)), 10 + i, SamplingParams())
        assert bm.allocate_slots(s, len(s.token_ids))
        s.num_computed_tokens = len(s.token_ids)
        seqs.append(s)
    by_id = {s.seq_id: s for s in seqs}
    sent_whole: list[int] = []

    def step(active, finished=()):
        for s in active:  # room for this step's token
            s.token_ids.append(7)
            assert bm.allocate_slots(s, 1)
        out = SchedulerOutput(scheduled=[ScheduledSequence(s.seq_id, 1) for s in active],
                              finished_seq_ids=list(finished))
        view.describe(out, by_id.__getitem__)
        assert pickle.loads(pickle.dumps(out)) == out
        sent_whole.extend(d.seq_id for d in out.new_sequences)
        states.apply(out)
        for s in active:  # the token the worker sampled itself in the step before
            if len(states[s.seq_id].token_ids) < len(s.token_ids):
                states[s.seq_id].token_ids.append(7)
        got = pack_states(out, states).decode_block_tables
        for row, s in zip(got, active):
            assert states[s.seq_id].block_table == s.block_table
            assert row[:len(s.block_table)].tolist() == s.block_table
        for s in active:  # the token is computed, on both sides
            s.num_computed_tokens += 1
            states[s.seq_id].num_computed_tokens += 1

    for _ in range(3):  # seq 0 crosses into a new block (an append)
        step(seqs)
    assert sent_whole == [s.seq_id for s in seqs]
    # A fork shares the partial last block; the parent's next token copies it (copy-on-write).
    child = Sequence("1", list(seqs[1].token_ids), 11, SamplingParams(), index=1)
    child.num_computed_tokens = seqs[1].num_computed_tokens
    bm.fork(seqs[1], child)
    by_id[child.seq_id] = child
    view.fork(seqs[1].seq_id, child.seq_id)
    states.fork(Fork(seqs[1].seq_id, [child.seq_id], [1]))
    before = list(seqs[1].block_table)
    step(seqs + [child])
    assert seqs[1].block_table[:-1] == before[:-1] and seqs[1].block_table[-1] != before[-1]
    # Freed (preempted) and given new blocks, as many as before, while it skipped a step: the
    # worker frees it and gets it whole again.
    old = list(seqs[2].block_table)
    bm.free(seqs[2])
    view.forget(seqs[2].seq_id)
    step(seqs[:2] + [child], finished=[seqs[2].seq_id])
    assert seqs[2].seq_id not in states
    computed, seqs[2].num_computed_tokens = seqs[2].num_computed_tokens, 0  # recomputed
    assert bm.allocate_slots(seqs[2], computed)
    seqs[2].num_computed_tokens = computed
    assert len(seqs[2].block_table) == len(old) and seqs[2].block_table != old
    step(seqs + [child])
    assert sent_whole == [s.seq_id for s in seqs] + [seqs[2].seq_id]
    bm.free(seqs[0])  # finished
    view.forget(seqs[0].seq_id)
    step(seqs[1:] + [child], finished=[seqs[0].seq_id])
    assert len(states) == 3


def test_the_worker_refuses_a_computed_count_it_does_not_share():
    states = RequestStates()
    states.apply(SchedulerOutput(new_sequences=[NewSequenceData(5, 0, [1, 2, 3], 3, SamplingParams(), [0], 0, -1)]))
    states[5].num_computed_tokens = 3
    with pytest.raises(RuntimeError) as e:
        states.apply(SchedulerOutput(cached_sequences=[CachedSequenceData(5, 2, 1, [])]))
    assert str(e.value) == "step contract: the scheduler counts 2 computed tokens of sequence 5, the worker 3"
    with pytest.raises(RuntimeError) as e:
        states.apply(SchedulerOutput(cached_sequences=[CachedSequenceData(6, 0, 0, [])]))
    assert str(e.value) == ("step contract: the step names sequence 6, which the worker does not hold "
                            "(it was never sent as new, or was freed)")


def test_decode_graph_context_buckets():
    assert context_buckets(2048) == [2048]
    assert context_buckets(4096) == [4096]
    assert context_buckets(8192) == [4096, 8192]


def test_start_up_kernel_variants_run_on_any_pool(llama_dir, monkeypatch):
    engine = LLMEngine(EngineArgs(model=llama_dir, num_kv_blocks=8, max_num_seqs=4, max_model_len=128))
    props = type("Props", (), {"multi_processor_count": 132})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    forward = engine.executor.runner.forward_eager
    monkeypatch.setattr(engine.executor.runner, "forward_eager", lambda batch: calls.append(batch) or forward(batch))
    compile_step_variants(engine.executor.worker)  # 8 blocks: block ids wrap around the pool
    shapes = [(b.num_decodes, b.num_tokens - b.num_decodes) for b in calls]
    # Prompt chunks: the tiny model has 2 query heads per KV head, so chunks of 8, 16 and 17
    # tokens fill 16-, 32- and 64-row tiles with heads packed; 32 and 64 tokens take unpacked
    # tiles (and 1,040 would exceed max_model_len).
    assert shapes == [(1, 0), (1, 0), (4, 0), (4, 0), (1, 8), (1, 16), (1, 17), (1, 32), (1, 64)]
    assert all(int(b.decode_block_tables.max()) < 8 for b in calls)
    assert engine.block_manager.usage == 0.0


def test_prefill_graph_capture_sizes():
    assert prefill_capture_sizes(0) == []
    assert prefill_capture_sizes(16) == [16]
    assert prefill_capture_sizes(100) == [16, 32, 64, 100]
    assert prefill_capture_sizes(1024) == [16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024]
    assert prefill_capture_sizes(2000)[10:] == [1024, 1280, 1536, 1792, 2000]


def _generate(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, list[tuple[int, float]]]:
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=3, logprobs=0,
                                                    ignore_eos=True))
    done: dict[str, list[tuple[int, float]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            done.setdefault(out.request_id, []).extend(
                (t, lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs))
    return done


def test_prefill_graph_padding_changes_nothing(llama_dir):
    """Prefill-only steps run on PrefillGraphs' padded buffers (eagerly: no GPU here) and give the
    eager engine's tokens, logprobs and KV cache: padding tokens store nothing and attend to
    nothing, unused sequence slots stay empty. Covers several chunks in one step, a lone short
    prompt, a chunk after a cached prefix, and a step too big for the graphs (eager)."""
    # On the CPU even where a GPU is present: the graphs' buffers here are CPU tensors.
    args = EngineArgs(model=llama_dir, num_kv_blocks=64, max_num_seqs=8, max_model_len=256, device="cpu")
    eager, padded = LLMEngine(args), LLMEngine(args)
    graphs = PrefillGraphs(padded.executor.worker.model, 64, 256 // 16, torch.device("cpu"), capture=False)
    seen = []
    run = graphs.run
    graphs.run = lambda batch: seen.append((batch.num_tokens, len(batch.prefill_cu_seqlens_q) - 1)) or run(batch)
    padded.executor.runner.prefill_graphs = graphs
    rng = torch.Generator().manual_seed(4)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 250, (n,), generator=rng).tolist()

    shared = ids(32)
    waves = [{"a": ids(5), "b": ids(17), "c": ids(30)},  # one step of 3 chunks: 52 tokens -> 64
             {"d": ids(9)},                              # a lone prompt: 9 -> 16
             {"e": shared + ids(3)},                     # 35 -> 64
             {"f": shared + ids(7)},                     # 32 tokens cached: a 7-token chunk -> 16
             {"g": ids(70)}]                             # over 64 tokens: eager
    for wave in waves:
        got, want = _generate(padded, wave), _generate(eager, wave)
        assert sorted(got) == sorted(want) == sorted(wave)
        for rid in wave:
            assert [t for t, _ in got[rid]] == [t for t, _ in want[rid]]
            assert [lp for _, lp in got[rid]] == pytest.approx([lp for _, lp in want[rid]], abs=1e-5)
    assert seen == [(52, 3), (9, 1), (35, 1), (7, 1)]
    assert torch.allclose(padded.executor.worker.kv_cache, eager.executor.worker.kv_cache, atol=1e-5)


def test_prefill_graphs_serve_only_prefill_steps_that_fit(llama_dir):
    graphs = PrefillGraphs(torch.nn.Identity(), 64, 4, torch.device("cpu"), capture=False)

    def batch(*items, all_chunks=False):  # (prompt length, tokens already computed, tokens this step)
        return pack([(make_state(i, list(range(n)), list(range(4 * i, 4 * i + -(-n // 16))), done), new)
                     for i, (n, done, new) in enumerate(items)], 16, all_chunks=all_chunks)

    assert graphs.can_run(batch((40, 0, 40), (20, 0, 20)))
    assert graphs.can_run(batch((64, 0, 64)))
    assert not graphs.can_run(batch((65, 0, 65)))                  # more tokens than captured
    assert not graphs.can_run(batch((40, 0, 40), (20, 19, 1)))     # a decode alongside
    assert not graphs.can_run(batch(*[(5, 0, 5)] * 9))             # more prompts than slots
    assert not graphs.can_run(batch((60, 0, 60), (90, 89, 1)))
    wide = batch((40, 0, 40))
    wide.prefill_block_tables = np.zeros((1, 32), dtype=np.int32)  # wider than the graph's 16
    assert not graphs.can_run(wide)
    # Verification graphs (speculative decoding, k = 4): chunks of at most 5 tokens, 16 of them,
    # and attention told so (its tiles pack GQA heads for chunks that short).
    verify = PrefillGraphs(torch.nn.Identity(), 80, 4, torch.device("cpu"), capture=False,
                           rows_per_seq=5, max_seqs=16, max_chunk=5)
    assert verify.can_run(batch(*[(30, 25, 5)] * 15, (30, 29, 1), all_chunks=True))  # a decode as a chunk
    assert not verify.can_run(batch((30, 24, 6), all_chunks=True))
    assert verify._metadata(64).prefill_max_seqlen_q == 5 and graphs._metadata(64).prefill_max_seqlen_q == 64
