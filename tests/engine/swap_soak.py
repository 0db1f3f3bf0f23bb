"""A random soak of the scheduler with swap_space's host pool (preemption by swap and/or the
prefix cache's host tier), with a worker mirrored from the steps' data alone that moves token
ids as the runner moves keys and values (swap-outs, then copy-on-write copies, then swap-ins,
then the forward's writes): every token a step reads must be the sequence's own. Also what the
swap and host-tier tests share: random prompts, and a count of the tokens each step computes."""
from __future__ import annotations

import pickle
import random

import torch

from tritium.core.block_manager import BlockManager
from tritium.core.scheduler import Scheduler
from tritium.core.sequence import Sequence, SequenceStatus
from tritium.engine_config import SchedulerConfig
from tritium.llm import LLM
from tritium.sampling_params import SamplingParams
from tritium.worker.request_states import RequestStates


def random_prompts(seed: int, lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]


def count_computed_tokens(llm: LLM) -> list[int]:
    """Tokens each launched step computes (proposals none here), summed into the list's one entry."""
    total = [0]
    update = llm.engine.scheduler.update_after_step

    def counted(out):
        total[0] += sum(item.num_known_tokens for item in out.scheduled)
        update(out)
    llm.engine.scheduler.update_after_step = counted
    return total


def run_swap_soak(mode: str, host_tier: bool, seed: int = 99,
                  sliding_window: int | None = None) -> tuple[Scheduler, int]:
    """800 steps of random arrivals, forks (n > 1), shared prefixes, aborts and preemptions
    (`mode`: the preemption mode), checked every step; then every sequence is finished. Returns
    the scheduler and how many sequences finished on their own. With a sliding_window, attention
    reads only the window's tokens, and blocks behind it go back to the pool."""
    rng = random.Random(seed)
    bs = 4
    bm = BlockManager(24, bs, True, sliding_window)
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=12, enable_chunked_prefill=True,
                             long_prefill_token_threshold=0, policy="fcfs", stream_interval=1,
                             max_waiting_requests=None, preemption_mode=mode)
    sched = Scheduler(config, bm, num_host_blocks=16)
    if not host_tier:  # the swap path alone
        sched.host_tier = bm.host_tier = None
    pool = sched.host_pool
    device: dict[int, list] = {}  # block id -> the token id in each slot
    host: dict[int, list] = {}
    worker = RequestStates()
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    live: dict[str, list[Sequence]] = {}
    counter = finished = 0
    for step in range(800):
        if rng.random() < 0.3 and len(live) < 10 and step < 700:
            counter += 1
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 14))]
            s = Sequence(f"q{counter}", tokens, len(tokens), SamplingParams(n=rng.choice([1, 1, 2, 3])),
                         0, float(step))
            live[s.request_id] = [s]
            sched.add(s)
        if live and rng.random() < 0.03:
            for s in live.pop(rng.choice(sorted(live))):
                if not s.is_finished:
                    sched.finish(s)
        out = sched.schedule()
        assert pickle.loads(pickle.dumps(out)) == out
        bm.check_integrity(sched.all_sequences())
        pool.check_integrity(sched.all_sequences())
        # The runner's order: swap-outs, copy-on-write copies, swap-ins, then the forward pass.
        worker.apply(out)
        for d, h in out.blocks_to_swap_out:
            host[h] = list(device[d])
        for src, dst in out.block_copies:
            device[dst] = list(device[src])
        for h, d in out.blocks_to_swap_in:
            device[d] = list(host[h])
        for it in out.scheduled:
            state, truth = worker[it.seq_id], sched.sequence(it.seq_id).token_ids
            assert state.block_table == sched.sequence(it.seq_id).block_table
            first = max(0, state.num_computed_tokens - sliding_window + 1) if sliding_window else 0
            for pos in range(first, state.num_computed_tokens):  # what attention reads
                assert device[state.block_table[pos // bs]][pos % bs] == truth[pos], (step, it.seq_id, pos)
            for pos in range(state.num_computed_tokens, state.num_computed_tokens + it.num_known_tokens):
                device.setdefault(state.block_table[pos // bs], [None] * bs)[pos % bs] = truth[pos]
        for fork in out.forks:
            worker.fork(fork)
        worker.book_launch(out, [])  # computed counts as the runner books them (no sample rows here)
        children = {c: sched.sequence(c) for f in out.forks for c in f.children}
        sched.update_after_step(out)
        for fork in out.forks:
            live[sched.sequence(fork.parent).request_id].extend(children[c] for c in fork.children)
        for s in [c for g in live.values() for c in g if c.status == SequenceStatus.RUNNING
                  and c.num_computed_tokens == c.num_tokens]:
            s.append_token(rng.randrange(50))
            if s.num_output_tokens >= rng.randint(3, 30) or s.num_tokens >= 24 * bs - 1:
                sched.finish(s)
                finished += 1
        for rid in [r for r, g in live.items() if all(s.is_finished for s in g)]:
            del live[rid]
    while sched.num_unfinished:  # the rest finish as they are
        for s in sched.all_sequences():
            sched.finish(s)
    while sched.num_unfinished:  # the rest finish as they are
        for s in sched.all_sequences():
            sched.finish(s)
    return sched, finished
