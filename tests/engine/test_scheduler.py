"""Scheduler: token budget, chunked prefill, FCFS, preemption of the newest, and a randomized
workload with the block manager's integrity check after every step."""
from __future__ import annotations

import pickle
import random

import pytest

from tritium.engine_config import SchedulerConfig
from tritium.core.block_manager import BlockManager
from tritium.sampling_params import SamplingParams
from tritium.worker.request_states import RequestStates
from tritium.core.scheduler import Scheduler
from tritium.core.sequence import Sequence, SequenceStatus


def sched_config(max_num_seqs: int, budget: int, chunked: bool = True, policy: str = "fcfs") -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                           long_prefill_token_threshold=0, policy=policy, stream_interval=1,
                           max_waiting_requests=None, preemption_mode="recompute")


def make(num_blocks=16, block_size=4, max_num_seqs=8, budget=16, chunked=True, caching=True):
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(sched_config(max_num_seqs, budget, chunked), bm), bm


def seq(n: int, rid: str, start: int = 0, params: SamplingParams | None = None) -> Sequence:
    return Sequence(rid, list(range(start, start + n)), n, params or SamplingParams())


def run_step(sched: Scheduler, sample_token: int = 7) -> list[tuple[str, int]]:
    """Schedule, pretend the model ran, append a token to each sequence that reached its end."""
    out = sched.schedule()
    seqs = [sched.sequence(it.seq_id) for it in out.scheduled]
    plan = [(s.request_id, it.num_new_tokens) for s, it in zip(seqs, out.scheduled)]
    done = [s for s, it in zip(seqs, out.scheduled) if s.num_computed_tokens + it.num_new_tokens == s.num_tokens]
    sched.update_after_step(out)
    for s in done:
        s.append_token(sample_token)
    return plan


def test_chunked_prefill_mixes_decodes_with_prompt_chunks():
    sched, bm = make(budget=8)
    sched.add(seq(3, "short"))
    sched.add(seq(20, "long", 100))
    assert run_step(sched) == [("short", 3), ("long", 5)]
    # The short request decodes while the long prompt continues in chunks.
    assert run_step(sched) == [("short", 1), ("long", 7)]
    assert run_step(sched) == [("short", 1), ("long", 7)]
    assert run_step(sched) == [("short", 1), ("long", 1)]  # the long prompt is done; both decode
    bm.check_integrity(sched.all_sequences())


def test_short_request_not_stuck_behind_long_prompt():
    sched, _ = make(budget=8, num_blocks=32)
    sched.add(seq(40, "long"))
    assert run_step(sched) == [("long", 8)]  # alone: the whole budget
    sched.add(seq(2, "short", 500))
    # With someone waiting, the long prompt's chunk is capped (half the budget) and the
    # newcomer is admitted in the same step.
    assert run_step(sched) == [("long", 4), ("short", 2)]
    assert run_step(sched) == [("short", 1), ("long", 7)]  # its decode goes first


def test_without_chunked_prefill_prompt_waits_for_whole_budget():
    sched, _ = make(budget=8, chunked=False)
    sched.add(seq(3, "a"))
    sched.add(seq(6, "b", 50))
    assert run_step(sched) == [("a", 3)]
    assert run_step(sched) == [("a", 1), ("b", 6)]


def test_max_num_seqs_limits_admission_fcfs():
    sched, _ = make(max_num_seqs=2, budget=64, num_blocks=32)
    for i in range(3):
        sched.add(seq(2, f"r{i}", 10 * i))
    assert run_step(sched) == [("r0", 2), ("r1", 2)]
    assert [s.request_id for s in sched.waiting] == ["r2"]


def test_max_num_seqs_counts_the_samples_a_request_will_fork():
    """n=2 takes two of max_num_seqs from its admission on, before its prompt is done and it
    forks: the request behind it waits, in the same step and while the prompt is in chunks."""
    sched, _ = make(max_num_seqs=2, budget=4, num_blocks=32)
    sched.add(seq(6, "pair", params=SamplingParams(n=2)))
    sched.add(seq(2, "next", 50))
    assert run_step(sched) == [("pair", 2)]  # (chunks of half the budget while others wait)
    assert run_step(sched) == [("pair", 2)]
    assert [s.request_id for s in sched.waiting] == ["next"]


def test_preempts_most_recent_and_recomputes_it_later():
    sched, bm = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq(8, "a"), seq(8, "b", 100)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == [("a", 8), ("b", 8)]  # 2 full blocks each: the cache is full
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    # Both need a third block to decode: b (admitted last) is preempted for a.
    assert run_step(sched) == [("a", 1)]
    assert sched.num_preemptions == 1
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.token_ids == list(range(100, 108)) + [7]  # its generated token is kept
    assert list(sched.waiting) == [b]
    # a took b's last freed block (the tail is freed, hence evicted, first).
    assert a.block_table == [0, 1, 3]
    sched.finish(a)
    # b comes back as prompt + output; its first block is still cached, so only 5 tokens run.
    assert run_step(sched) == [("b", 5)]
    assert b.block_table[0] == 2 and b.num_computed_tokens == 9 and b.num_cached_tokens == 0
    bm.check_integrity(sched.all_sequences())


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workload_keeps_integrity(policy):
    """Random arrivals (random priorities under "priority"), forks, aborts and preemptions."""
    rng = random.Random(1234)
    bm = BlockManager(24, 4, True)
    sched = Scheduler(sched_config(6, 12, policy=policy), bm)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    live: dict[str, list[Sequence]] = {}
    worker = RequestStates()
    counter = 0
    finished = 0
    for step in range(600):
        if rng.random() < 0.3 and len(live) < 10:
            counter += 1
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 14))]
            n = rng.choice([1, 1, 1, 2, 3])
            s = Sequence(f"q{counter}", tokens, len(tokens), SamplingParams(n=n), 0, float(step),
                         rng.randrange(3) if policy == "priority" else 0)
            live[s.request_id] = [s]
            sched.add(s)
        if live and rng.random() < 0.03:  # abort
            rid = rng.choice(sorted(live))
            for s in live.pop(rid):
                if not s.is_finished:
                    sched.finish(s)
        out = sched.schedule()
        bm.check_integrity(sched.all_sequences())
        assert pickle.loads(pickle.dumps(out)) == out  # data only
        assert [row.seq_id for row in out.sample_rows] == [
            sid for it in out.scheduled
            if sched.sequence(it.seq_id).num_computed_tokens + it.num_new_tokens == sched.sequence(it.seq_id).num_tokens
            for sid in [it.seq_id] + next((f.children for f in out.forks if f.parent == it.seq_id), [])]
        children = {c: sched.sequence(c) for f in out.forks for c in f.children}
        # The worker's mirror, from the step's data alone: tables and computed counts agree.
        worker.apply(out)
        for it in out.scheduled:
            assert worker[it.seq_id].block_table == sched.sequence(it.seq_id).block_table
        for fork in out.forks:
            worker.fork(fork)
        worker.book_launch(out, [])  # computed counts as the runner books them (no sample rows here)
        sched.update_after_step(out)
        for fork in out.forks:  # the siblings run from now on, sharing the parent's blocks
            parent = sched.sequence(fork.parent)
            assert len(fork.children) == parent.params.n - 1 and parent.num_forks_pending == 0
            assert all(children[c].status == SequenceStatus.RUNNING for c in fork.children)
            live[parent.request_id].extend(children[c] for c in fork.children)
        for s in [c for group in live.values() for c in group if c.status == SequenceStatus.RUNNING
                  and c.num_computed_tokens == c.num_tokens]:
            s.append_token(rng.randrange(50))
            if s.num_output_tokens >= rng.randint(3, 30) or s.num_tokens >= 24 * 4 - 1:
                sched.finish(s)
                finished += 1
        for rid in [r for r, g in live.items() if all(s.is_finished for s in g)]:
            del live[rid]
        bm.check_integrity(sched.all_sequences())
        assert bm.num_free_blocks + sum(1 for b in bm.blocks if b.ref_cnt) == bm.num_blocks
        assert sched.num_wasted_slots() < bm.block_size * max(1, len(sched.running))
    assert finished > 50 and sched.num_preemptions > 0 and bm.prefix_cache_hits > 0


def pseq(n: int, rid: str, start: int, priority: int, arrival: float) -> Sequence:
    return Sequence(rid, list(range(start, start + n)), n, SamplingParams(), 0, arrival, priority)


def test_priority_policy_admits_by_priority_then_arrival():
    bm = BlockManager(32, 4, False)
    sched = Scheduler(sched_config(2, 64, policy="priority"), bm)
    for rid, priority, arrival in (("late-low", 5, 3.0), ("early-low", 5, 1.0), ("high", 0, 2.0),
                                   ("mid", 1, 0.5)):
        sched.add(pseq(4, rid, 10 * len(sched.waiting), priority, arrival))
    assert [s.request_id for s in sched.waiting] == ["high", "mid", "early-low", "late-low"]
    assert run_step(sched) == [("high", 4), ("mid", 4)]  # max_num_seqs=2: the two first
    # A newcomer of higher priority waits for a free slot (no preemption for admission) and is
    # then first in line.
    sched.add(pseq(4, "urgent", 90, -1, 9.0))
    assert run_step(sched) == [("high", 1), ("mid", 1)]
    sched.finish(sched.running[0])
    assert run_step(sched) == [("mid", 1), ("urgent", 4)]


def test_priority_policy_preempts_the_lowest_priority_and_requeues_it_by_priority():
    bm = BlockManager(4, 4, False)
    sched = Scheduler(sched_config(8, 64, policy="priority"), bm)
    low, high = pseq(8, "low", 0, 3, 1.0), pseq(8, "high", 100, 0, 2.0)
    sched.add(low)
    sched.add(high)
    # high is admitted first although it arrived later; the cache is then full.
    assert run_step(sched) == [("high", 8), ("low", 8)]
    # Both need a third block: low (lowest priority, though admitted last here too) goes.
    waiting = pseq(4, "other", 200, 1, 0.5)
    sched.add(waiting)
    assert run_step(sched) == [("high", 1)]
    assert low.status == SequenceStatus.WAITING and low.num_computed_tokens == 0
    # Requeued by priority: behind "other" (priority 1), not at the front as under fcfs.
    assert [s.request_id for s in sched.waiting] == ["other", "low"]


def test_priority_policy_victim_is_not_simply_the_newest():
    """Under fcfs the most recently admitted sequence is preempted; under priority the one with
    the highest (priority, arrival), here the one admitted first."""
    for policy, plan, victim in (("fcfs", [("a", 1)], "b"), ("priority", [("b", 1)], "a")):
        bm = BlockManager(4, 4, False)
        sched = Scheduler(sched_config(8, 64, policy=policy), bm)
        a = pseq(7, "a", 0, 2 if policy == "priority" else 0, 1.0)
        b = pseq(8, "b", 100, 0, 2.0)
        sched.add(a)
        assert run_step(sched) == [("a", 7)]
        sched.add(b)
        assert run_step(sched) == [("a", 1), ("b", 8)]  # the cache is full
        assert run_step(sched) == plan  # a's next token needs a block
        assert [s.request_id for s in sched.waiting] == [victim]
        bm.check_integrity(sched.all_sequences())


def _lora_seq(n: int, rid: str, adapter: str | None, start: int = 0) -> Sequence:
    s = seq(n, rid, start)
    s.lora_name = adapter
    return s


def test_lora_slots_bound_the_adapters_of_a_step():
    """Two device slots, three adapters: a request whose adapter finds no slot waits while
    later ones go ahead; a slot changes adapter (the least recently used one, reported to the
    runner once) only when no running sequence uses it; preemption and finishing release."""
    from tritium.core.lora_slots import LoRASlots
    slots = LoRASlots(2, ["a", "b"])
    bm = BlockManager(32, 4, True)
    sched = Scheduler(sched_config(8, 64), bm, slots)
    for rid, adapter in (("a1", "a"), ("b1", "b"), ("c1", "c"), ("base", None), ("a2", "a")):
        sched.add(_lora_seq(4, rid, adapter, start=10 * len(sched.waiting)))
    out = sched.schedule()
    assert [(sched.sequence(it.seq_id).request_id, sched.sequence(it.seq_id).lora_slot)
            for it in out.scheduled] == [("a1", 0), ("b1", 1), ("base", -1), ("a2", 0)]
    assert [d.lora_slot for d in out.new_sequences] == [0, 1, -1, 0]
    assert out.lora_loads == [] and [s.request_id for s in sched.waiting] == ["c1"]
    assert slots.refs == [2, 1]
    sched.update_after_step(out)
    for s in sched.running:
        s.append_token(7)
    b1 = next(s for s in sched.running if s.request_id == "b1")
    sched.finish(b1)  # slot 1 is free now; "c" takes it in the next step
    assert slots.refs == [2, 0]
    out = sched.schedule()
    assert ("c1", 1) in [(sched.sequence(d.seq_id).request_id, d.lora_slot) for d in out.new_sequences]
    assert out.lora_loads == [(1, "c")] and slots.names == ["a", "c"]
    assert sched.schedule().lora_loads == []  # loaded once
    victim = sched.running[-1]
    sched._preempt(victim, out)
    assert victim.lora_slot == -1 and slots.refs == [sum(s.lora_slot == 0 for s in sched.running),
                                                    sum(s.lora_slot == 1 for s in sched.running)]


def test_lora_slots_choose_an_empty_slot_then_the_least_recently_used():
    from tritium.core.lora_slots import LoRASlots
    slots = LoRASlots(3, ["a", "b"])
    assert slots.acquire("c") == 2  # the empty slot
    slots.release(slots.acquire("b"))
    slots.release(slots.acquire("a"))
    slots.release(2)
    assert slots.acquire("d") == 2  # "c" (slot 2) was taken before "b" and "a"
    assert slots.take_loads() == [(2, "d")]  # "c" never reached the device: only "d" is loaded
    assert slots.acquire("e") == 1  # of the unused "a" and "b", "b" was used longer ago
    assert slots.acquire("a") == 0 and slots.refs == [1, 1, 1]
    assert not slots.can_use("x") and slots.can_use("d")
    with pytest.raises(RuntimeError, match=r"^no LoRA slot is free for adapter 'x'$"):
        slots.acquire("x")
    slots.release(0)
    with pytest.raises(RuntimeError, match=r"^LoRA slot 0 released more often than acquired$"):
        slots.release(0)
