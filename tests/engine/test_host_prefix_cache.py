"""The prefix cache's host tier (swap_space with prefix caching): full blocks the device evicts
are kept in the host pool under their hash, LRU; a prompt whose cached prefix ends on the device
continues its lookup there and the hits are copied back instead of computed. Tokens equal Hugging
Face's and the no-tier run's; blocks held by swapped-out sequences are never evicted; nothing
leaks."""
from __future__ import annotations

import pytest
import torch

from tritium import SamplingParams
from tritium.core.block_manager import NONE_HASH, BlockManager, hash_prompt_blocks
from tritium.core.host_block_pool import HostBlockPool
from tritium.core.host_prefix_cache import HostPrefixCache
from tritium.core.kv_swap import KVSwapper
from tritium.core.sequence import Sequence
from tritium.llm import LLM
from tritium.serving.triton_metrics import MetricsTracker
from swap_soak import count_computed_tokens, random_prompts, run_swap_soak

# 12 device blocks of 16 tokens: one 70-token prompt and its 8 new tokens take 5 of them, so four
# other such requests evict it. 0.001 GiB of host memory holds 131 tiny-llama blocks of fp32.
SMALL = dict(device="cpu", dtype="float32", block_size=16, num_kv_blocks=12, max_num_batched_tokens=64)
TIER = dict(SMALL, swap_space=0.001)
MAX_NEW = 8


def _shared_evicted_shared(llm: LLM, shared: list[int], others: list[list[int]]):
    """The shared prompt, then the others one by one (each evicts older cached blocks), then the
    shared prompt again. Returns the token ids of the three phases and the tokens the last
    phase computed, with the engine's stats before it."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    computed = count_computed_tokens(llm)
    first = llm.generate([shared], greedy)[0].outputs[0].token_ids
    middle = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in others]
    bm = llm.engine.block_manager
    hashes = hash_prompt_blocks(NONE_HASH, shared, bm.block_size)
    assert not any(h in bm.cached_blocks for h in hashes), "the shared prefix is still on the device"
    if bm.host_tier is not None:
        assert all(bm.host_tier.pool.lookup(h) is not None for h in hashes), "not in host memory"
    before, computed[0] = llm.engine.get_stats(), 0
    again = llm.generate([shared], greedy)[0]
    return first, middle, again, computed[0], before


def _assert_nothing_held(llm: LLM) -> None:
    """Every device and host block is free or evictable, the bookkeeping consistent; after a
    prefix-cache reset both pools are empty."""
    engine = llm.engine
    bm, pool = engine.block_manager, engine.scheduler.host_pool
    bm.check_integrity([])
    pool.check_integrity([])
    assert bm.num_free_blocks == bm.num_blocks and pool.num_free_blocks == pool.num_blocks
    assert engine.get_stats().cpu_cache_usage == 0.0 and engine.scheduler.sequences == {}
    bm.reset_prefix_cache()
    assert bm.cached_blocks == {} and pool.num_cached_blocks == 0
    pool.check_integrity([])


def test_an_evicted_shared_prefix_is_found_in_host_memory_and_not_computed_again(llama_dir):
    from hf_reference import hf_greedy_generate
    from transformers import AutoModelForCausalLM
    shared, *others = random_prompts(21, (70, 66, 68, 70, 67))
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32)
    want_shared, *want_others = hf_greedy_generate(hf, [shared, *others], MAX_NEW)

    tier = LLM(llama_dir, **TIER)
    first, middle, again, computed, before = _shared_evicted_shared(tier, shared, others)
    assert first == want_shared and middle == want_others
    assert again.outputs[0].token_ids == want_shared
    stats = tier.engine.get_stats()
    # 4 full blocks of the 70 tokens (a hit never covers the last token) came back from the host.
    assert stats.external_prefix_cache_hits - before.external_prefix_cache_hits == 64
    # None of the 70 prompt tokens was on the device: all were looked up in the host tier.
    assert stats.external_prefix_cache_queries - before.external_prefix_cache_queries == 70
    assert stats.num_blocks_reloaded - before.num_blocks_reloaded == 4
    assert stats.prefix_cache_hits - before.prefix_cache_hits == 64  # host hits count as hits
    assert stats.num_blocks_offloaded >= 4 and again.num_cached_tokens == 64
    # Computed: the 6 uncached prompt tokens and the 7 new tokens fed back.
    assert computed == 70 - 64 + MAX_NEW - 1
    assert stats.num_preemptions == 0 and stats.num_blocks_swapped_out == 0
    ops = MetricsTracker().update(stats)
    assert ("vllm:external_prefix_cache_hits_total", "increment", float(stats.external_prefix_cache_hits), {}) in ops
    assert ("tritium:kv_blocks_reloaded_total", "increment", float(stats.num_blocks_reloaded), {}) in ops
    assert ("tritium:kv_blocks_offloaded_total", "increment", float(stats.num_blocks_offloaded), {}) in ops
    metrics = {m.name: m.value for m in tier.get_metrics() if hasattr(m, "value")}
    assert metrics["vllm:external_prefix_cache_hits"] == stats.external_prefix_cache_hits
    _assert_nothing_held(tier)

    # Without swap_space the same requests recompute the whole prompt (the test can tell).
    plain = LLM(llama_dir, **SMALL)
    first, middle, again, computed, _ = _shared_evicted_shared(plain, shared, others)
    assert (first, middle, again.outputs[0].token_ids) == (want_shared, want_others, want_shared)
    assert computed == 70 + MAX_NEW - 1 and again.num_cached_tokens == 0
    assert plain.engine.scheduler.host_tier is None


def test_the_host_pool_evicts_least_recently_used_cached_blocks_and_never_held_ones():
    pool = HostBlockPool(3)
    h = [bytes([i]) * 32 for i in range(8)]
    assert [pool.store(h[i]) for i in range(3)] == [0, 1, 2]
    pool.touch(0)  # h0 used again: h1 is now the least recent
    assert pool.store(h[3]) == 1 and pool.lookup(h[1]) is None and pool.lookup(h[3]) == 1
    pool.hold(2)  # h2 is read by a copy in: not evictable
    assert pool.store(h[4]) == 0 and pool.lookup(h[0]) is None
    pool.free([2])  # h2 cached again, the most recent
    assert pool.num_free_blocks == 3 and pool.usage == 0.0 and pool.num_evicted == 2
    # Preemption by swap takes blocks for a sequence, evicting cached ones least recent first.
    assert pool.allocate(2) == [1, 0] and pool.lookup(h[3]) is None and pool.lookup(h[4]) is None
    assert pool.usage == 2 / 3 and pool.lookup(h[2]) == 2
    assert pool.store(h[5]) == 2 and pool.lookup(h[2]) is None
    pool.hold(2)
    assert pool.store(h[6]) is None  # every block held: the tier keeps nothing
    pool.free([2, 1, 0])
    pool.check_integrity([])
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 1
    pool.clear_cached()
    assert pool.num_cached_blocks == 0 and pool.allocate(3) == [0, 1, 2]


def test_the_block_manager_offloads_evicted_blocks_once_and_reloads_hits_into_fresh_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    pool = HostBlockPool(3)
    bm.host_tier = tier = HostPrefixCache(pool, 2)

    def run(seq: Sequence) -> list[int]:
        assert bm.allocate_slots(seq, seq.num_tokens - (hit := bm.get_computed_blocks(seq)).num_tokens, hit)
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
        table = list(seq.block_table)
        bm.free(seq)
        return table

    def seq(first: int) -> Sequence:
        return Sequence(str(first), list(range(first, first + 5)), 5, SamplingParams(max_tokens=1))
    a, b = seq(100), seq(200)
    assert run(a) == [0, 1, 2]  # two full blocks cached; block 2 (partial) not
    a_hashes = bm._block_hashes(a)[:2]
    # b takes the never-used block 3, then the least recently freed: a's partial block 2 and
    # a's tail block 1, which goes to the host tier.
    assert run(b) == [3, 2, 1]
    assert pool.take_copies_out() == [(1, 0)] and pool.lookup(a_hashes[1]) == 0
    # a again: its head is still on the device, its tail comes back from host block 0 into a
    # fresh device block, which is cached on the device at once.
    hit = bm.get_computed_blocks(a)
    assert [blk.block_id for blk in hit.blocks] == [0] and hit.host_blocks == [0] and hit.num_tokens == 4
    assert bm.allocate_slots(a, 1, hit)
    assert a.block_table[:1] == [0] and bm.cached_blocks[a_hashes[1]].block_id == a.block_table[1]
    assert tier.take_copies_in() == [(0, a.block_table[1])] and pool.ref_cnt[0] == 1
    # Its fresh blocks were b's partial block 1 and b's cached tail block 2, which went to the host.
    assert a.block_table == [0, 1, 2] and pool.take_copies_out() == [(2, 1)]
    assert pool.ref_cnt[0] == 0 and pool.lookup(a_hashes[1]) == 0  # released, still cached
    assert tier.num_blocks_offloaded == 2 and tier.num_blocks_reloaded == 1
    assert bm.prefix_cache_hits == 4 and tier.num_hit_tokens == 2
    a.num_computed_tokens = 5
    bm.free(a)
    # c evicts b's head (block 3: copied to the host) and a's tail (block 1: its hash is on the
    # host already, so nothing is copied).
    assert run(seq(300)) == [3, 2, 1]
    assert pool.take_copies_out() == [(3, 2)] and tier.num_blocks_offloaded == 3
    bm.check_integrity([])
    pool.check_integrity([])


def test_blocks_of_a_swapped_out_sequence_are_never_evicted_by_the_tier():
    bm = BlockManager(num_blocks=6, block_size=2)
    pool = HostBlockPool(4)
    bm.host_tier = tier = HostPrefixCache(pool, 2)
    swapper = KVSwapper(pool, "swap", bm)
    held = Sequence("held", list(range(5)), 5, SamplingParams(max_tokens=4))
    assert bm.allocate_slots(held, 5)
    held.num_computed_tokens = 5
    bm.cache_full_blocks(held)
    swapper.swap_out(held)
    assert held.host_block_table == [0, 1, 2] and pool.take_copies_out() == [(0, 0), (1, 1), (2, 2)]
    # Other prompts evict cached device blocks (the swapped sequence's two among them): the tier
    # has one host block left, which each offload takes in turn.
    for i in range(4):
        other = Sequence(f"o{i}", list(range(10 * i + 10, 10 * i + 15)), 5, SamplingParams(max_tokens=1))
        assert bm.allocate_slots(other, 5, bm.get_computed_blocks(other))
        other.num_computed_tokens = 5
        bm.cache_full_blocks(other)
        bm.free(other)
        assert all(h == 3 for _, h in pool.take_copies_out())
        pool.check_integrity([held])
    assert tier.num_blocks_offloaded >= 3 and pool.num_evicted >= 2
    assert [pool.ref_cnt[h] for h in (0, 1, 2)] == [1, 1, 1] and pool.num_free_blocks == 1
    # The cached host block counts as room for another swap-out; the held ones come back intact.
    two = Sequence("two", [1, 2, 3], 3, SamplingParams(max_tokens=1))
    two.num_computed_tokens = 2
    assert swapper.should_swap(two, 8)
    two.num_computed_tokens = 3  # two blocks: more than the one evictable block
    assert not swapper.should_swap(two, 8)
    assert bm.allocate_slots(held, 1)  # resumed (its fresh blocks evict cached ones to host 3)
    pairs = swapper.swap_in(held)
    assert pairs == list(zip([0, 1, 2], held.block_table[:3]))
    pool.check_integrity([held])  # released only once the step is taken
    assert pool.num_free_blocks == 1
    assert all(h == 3 for _, h in pool.take_copies_out()) and pool.num_free_blocks == 4
    pool.check_integrity([held])


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_random_workload_with_the_host_tier_keeps_every_block_s_contents_and_leaks_nothing(mode):
    """The soak of tests/engine/swap_soak.py with the host tier on (and preemption by swap in
    the swap modes): every token a step reads is the sequence's own, host hits and swaps
    happen, and at the end nothing is held; a prefix-cache reset empties both pools."""
    sched, finished = run_swap_soak(mode, host_tier=True)
    bm, pool = sched.block_manager, sched.host_pool
    stats = sched.swap_stats()
    assert finished > 50 and stats["num_blocks_reloaded"] > 20 and stats["num_blocks_offloaded"] > 200
    assert stats["external_prefix_cache_hits"] == 4 * stats["num_blocks_reloaded"]
    if mode != "recompute":
        assert stats["num_swapped_preemptions"] > 0
        assert stats["num_blocks_swapped_in"] == stats["num_blocks_swapped_out"] > 0
    bm.check_integrity([])
    pool.check_integrity([])
    assert bm.num_free_blocks == bm.num_blocks and pool.num_free_blocks == pool.num_blocks
    assert stats["cpu_cache_usage"] == 0.0 and pool.num_cached_blocks > 0
    bm.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.allocate(pool.num_blocks) == list(range(pool.num_blocks))


def test_greedy_tokens_with_preemption_by_swap_and_the_host_tier_equal_a_large_cache_s(llama_dir):
    """Prompts sharing a long prefix in a cache too small for the batch, preempted by swap:
    the prefix comes back from the host tier after it was evicted, and tokens equal those of
    a cache large enough for all (Hugging Face's generate with min_new_tokens never samples
    EOS, which this model's greedy choice sometimes is)."""
    shared = random_prompts(31, (40,))[0]
    prompts = [shared + p for p in random_prompts(32, (9, 20, 14, 25))] + random_prompts(33, (50, 45))
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    waves = (prompts[:2] + prompts[4:], prompts[2:4])  # the second finds the prefix evicted

    def run(**engine):
        llm = LLM(llama_dir, **engine)
        return llm, [[o.outputs[0].token_ids for o in llm.generate(wave, greedy)] for wave in waves]
    _, want = run(**dict(SMALL, num_kv_blocks=256))
    llm, got = run(**dict(TIER, num_kv_blocks=10, max_num_batched_tokens=32, preemption_mode="swap"))
    assert got == want
    stats = llm.engine.get_stats()
    assert stats.num_swapped_preemptions > 0 and stats.external_prefix_cache_hits > 0
    _assert_nothing_held(llm)


def test_each_tensor_parallel_rank_reloads_its_shard_of_an_fp8_cache(llama_dir):
    """tensor_parallel_size=2 (gloo) with an FP8 cache: the shared prompt comes back from each
    rank's host blocks; tokens equal one rank's without the tier."""
    shared, *others = random_prompts(21, (70, 66, 68, 70, 67))
    fp8 = dict(kv_cache_dtype="fp8")
    want = _shared_evicted_shared(LLM(llama_dir, **SMALL, **fp8), shared, others)
    llm = LLM(llama_dir, tensor_parallel_size=2, **TIER, **fp8)
    try:
        assert llm.engine.executor.worker.attn_layers[0].num_kv_heads == 1
        first, middle, again, computed, before = _shared_evicted_shared(llm, shared, others)
        assert (first, middle, again.outputs[0].token_ids) == (want[0], want[1], want[2].outputs[0].token_ids)
        assert llm.engine.get_stats().external_prefix_cache_hits - before.external_prefix_cache_hits == 64
        assert computed == 70 - 64 + MAX_NEW - 1
        _assert_nothing_held(llm)
    finally:
        llm.shutdown()
