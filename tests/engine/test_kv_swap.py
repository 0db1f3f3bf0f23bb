"""Preemption by swap (swap_space, preemption_mode): a preempted sequence's computed blocks go
to host memory and come back when it resumes, its computed tokens kept; tokens equal Hugging
Face's and the no-swap run's; nothing leaks; bad arguments get exact errors."""
from __future__ import annotations

import re

import pytest
import torch

import tritium.config
from tritium import EngineArgs, SamplingParams
from tritium.core.block_manager import BlockManager
from tritium.core.host_block_pool import HostBlockPool
from tritium.core.kv_swap import KVSwapper
from tritium.core.sequence import Sequence, SequenceStatus
from tritium.llm import LLM
from tritium.serving.triton_metrics import MetricsTracker
from tritium.worker.host_kv_cache import HostKVCache
from swap_soak import count_computed_tokens, random_prompts, run_swap_soak

# A cache far too small for the batch: 8 blocks of 16 tokens for four sequences of 50-70 tokens.
TIGHT = dict(device="cpu", dtype="float32", block_size=16, num_kv_blocks=8, max_num_batched_tokens=32)
SWAP = dict(TIGHT, swap_space=0.01, preemption_mode="swap")


def _assert_empty(llm: LLM) -> None:
    """Every device block and host block is free again, the bookkeeping consistent."""
    engine = llm.engine
    bm, swapper = engine.block_manager, engine.scheduler.swapper
    bm.check_integrity([])
    assert bm.num_free_blocks == bm.num_blocks
    swapper.host_pool.check_integrity([])
    assert swapper.host_pool.num_free_blocks == swapper.host_pool.num_blocks
    assert engine.get_stats().cpu_cache_usage == 0.0 and engine.get_stats().num_swapped == 0
    assert engine.scheduler.sequences == {} and not engine.scheduler.waiting


def test_greedy_tokens_with_swapping_equal_hugging_face_and_nothing_is_recomputed(llama_dir):
    from hf_reference import hf_greedy_generate
    from transformers import AutoModelForCausalLM
    prompts = random_prompts(7, (30, 41, 22, 35))
    max_new = 24
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32)
    want = hf_greedy_generate(hf, prompts, max_new)
    greedy = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    # Without prefix caching every computed token is the step's work, so recompute shows.
    swap = LLM(llama_dir, enable_prefix_caching=False, **SWAP)
    computed = count_computed_tokens(swap)
    assert [o.outputs[0].token_ids for o in swap.generate(prompts, greedy)] == want
    stats = swap.engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.num_swapped_preemptions == stats.num_preemptions  # the host pool had room for all
    assert stats.num_blocks_swapped_out > 0
    assert stats.num_blocks_swapped_in == stats.num_blocks_swapped_out
    ops = MetricsTracker().update(stats)
    assert ("tritium:kv_blocks_swapped_out_total", "increment", float(stats.num_blocks_swapped_out), {}) in ops
    assert ("tritium:kv_blocks_swapped_in_total", "increment", float(stats.num_blocks_swapped_in), {}) in ops
    assert ("tritium:num_swapped_preemptions_total", "increment", float(stats.num_preemptions), {}) in ops
    assert ("vllm:cpu_cache_usage_perc", "set", 0.0, {}) in ops
    metrics = {m.name: m.value for m in swap.get_metrics() if hasattr(m, "value")}
    assert metrics["tritium:kv_blocks_swapped_out"] == stats.num_blocks_swapped_out
    # Each token computed once: the prompt, and every output token but the last (never fed back).
    assert computed[0] == sum(len(p) + max_new - 1 for p in prompts)
    _assert_empty(swap)
    # The same batch preempted by recompute computes more (the test can tell them apart).
    recompute = LLM(llama_dir, enable_prefix_caching=False, **TIGHT)
    again = count_computed_tokens(recompute)
    assert [o.outputs[0].token_ids for o in recompute.generate(prompts, greedy)] == want
    assert recompute.engine.get_stats().num_preemptions > 0
    assert again[0] > computed[0]
    assert recompute.engine.scheduler.swapper is None


def test_seeded_sampling_and_forked_samples_with_swapping_equal_their_no_swap_tokens(llama_dir):
    """Sampled, seeded requests (one of n=2 samples, whose siblings share their prompt's blocks;
    one with penalties, whose counts the worker rebuilds on resumption; prompts that share a
    prefix, so prefix-cache hits share blocks too) give the tokens they give in a cache large
    enough for all."""
    shared = random_prompts(3, (32,))[0]
    prompts = [shared + p for p in random_prompts(4, (9, 17))] + random_prompts(5, (28, 19))
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    params[1] = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=20, ignore_eos=True,
                               repetition_penalty=1.2, frequency_penalty=0.4)
    params[2] = SamplingParams(temperature=0.7, seed=5, max_tokens=20, ignore_eos=True,
                               repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3)

    def run(**engine):
        llm = LLM(llama_dir, **engine)
        outs = llm.generate(prompts, params)
        return llm, [[c.token_ids for c in o.outputs] for o in outs]
    _, want = run(device="cpu", dtype="float32", block_size=16, num_kv_blocks=256)
    llm, got = run(**SWAP)
    assert got == want
    stats = llm.engine.get_stats()
    assert stats.num_swapped_preemptions > 0 and stats.num_blocks_swapped_in == stats.num_blocks_swapped_out
    _assert_empty(llm)


def test_an_aborted_swapped_sequence_frees_its_host_blocks(llama_dir):
    llm = LLM(llama_dir, **SWAP)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(9, (40, 45, 38, 50))):
        engine.add_request(str(i), prompt, params)
    swapped = []
    while not swapped and engine.has_unfinished_requests():
        engine.step()
        swapped = [s for s in engine.scheduler.waiting if s.status == SequenceStatus.SWAPPED]
    assert swapped, "no sequence was swapped out"
    seq = swapped[0]
    held = len(seq.host_block_table)
    pool = engine.scheduler.swapper.host_pool
    before = pool.num_free_blocks
    stats = engine.get_stats()
    assert stats.cpu_cache_usage == (pool.num_blocks - before) / pool.num_blocks > 0
    assert stats.num_swapped == len(swapped)
    assert stats.num_waiting == len(engine.scheduler.waiting) - len(swapped)
    engine.abort_request(seq.request_id)
    assert pool.num_free_blocks == before + held and seq.host_block_table == []
    pool.check_integrity(engine.scheduler.all_sequences())
    while engine.has_unfinished_requests():
        engine.step()
    _assert_empty(llm)


def test_the_automatic_mode_swaps_what_takes_more_than_a_chunk_to_recompute():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence("r", list(range(30)), 30, SamplingParams(max_tokens=1))
    auto = KVSwapper(HostBlockPool(4), "auto", bm)
    swap = KVSwapper(HostBlockPool(4), "swap", bm)
    seq.num_computed_tokens = 0
    assert not auto.should_swap(seq, chunk_cap=8) and not swap.should_swap(seq, chunk_cap=8)
    seq.num_computed_tokens = 8
    assert not auto.should_swap(seq, chunk_cap=8) and swap.should_swap(seq, chunk_cap=8)
    seq.num_computed_tokens = 9
    assert auto.should_swap(seq, chunk_cap=8)
    seq.num_computed_tokens = 17  # 5 blocks: more than the host pool holds
    assert not auto.should_swap(seq, chunk_cap=8) and not swap.should_swap(seq, chunk_cap=8)


def test_the_automatic_mode_through_the_engine(llama_dir):
    """Without preemption_mode, swap_space turns the automatic choice on: sequences computed
    past one chunk (16 tokens of a 32-token budget) swap, tokens unchanged."""
    prompts = random_prompts(7, (30, 41, 22, 35))
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(llama_dir, **TIGHT).generate(prompts, greedy)]
    llm = LLM(llama_dir, swap_space=0.01, **TIGHT)
    assert llm.engine.scheduler.swapper.mode == "auto"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want
    assert llm.engine.get_stats().num_swapped_preemptions > 0
    _assert_empty(llm)


def test_host_kv_cache_moves_bytes_of_any_cache_dtype_both_ways():
    """Blocks out to host blocks (runs and single blocks), then back into other device blocks:
    the same bytes, an FP8 pool's included; other blocks untouched."""
    for dtype in (torch.float32, torch.float8_e4m3fn):
        raw = torch.randint(0, 255, (2, 3, 10, 4, 2, 8 * dtype.itemsize), dtype=torch.uint8)
        pool = raw.view(dtype)
        host = HostKVCache(pool, num_host_blocks=6)
        before = raw.clone()
        host.swap_out([(3, 0), (1, 1), (5, 4)])
        assert torch.equal(host.host[1], before[:, :, 1]) and torch.equal(host.host[4], before[:, :, 5])
        host.swap_in([(0, 7), (1, 8), (4, 2)])
        assert torch.equal(raw[:, :, 7], before[:, :, 3]) and torch.equal(raw[:, :, 8], before[:, :, 1])
        assert torch.equal(raw[:, :, 2], before[:, :, 5])
        untouched = [0, 1, 3, 4, 5, 6, 9]
        assert torch.equal(raw[:, :, untouched], before[:, :, untouched])


def test_host_kv_cache_moves_large_swaps_in_batches(monkeypatch):
    import tritium.worker.host_kv_cache as module
    raw = torch.randint(0, 255, (2, 1, 12, 2, 1, 4), dtype=torch.uint8)
    monkeypatch.setattr(module, "STAGING_BYTES", 2 * raw[:, :, 0].numel())  # two blocks a batch
    host = HostKVCache(raw, num_host_blocks=8)
    assert host.max_batch == 2
    before = raw.clone()
    host.swap_out([(i, 7 - i) for i in range(5)])
    host.swap_in([(7 - i, 11 - i) for i in range(5)])
    assert torch.equal(raw[:, :, 7:12], before[:, :, 0:5].flip(2))


def test_the_swap_staging_the_memory_profile_reserves():
    from tritium.worker.host_kv_cache import NUM_STAGING, STAGING_BYTES, staging_bytes
    two_mib = 2 << 20  # a Llama-3-8B block of 16 tokens in bf16
    assert staging_bytes(two_mib) == (NUM_STAGING + 1) * STAGING_BYTES == 3 * 64 << 20
    assert staging_bytes(3 << 20) == 3 * 21 * (3 << 20)  # whole blocks only
    assert staging_bytes(STAGING_BYTES * 2) == 3 * STAGING_BYTES * 2  # at least one block a batch


def test_bad_swap_arguments_get_exact_errors(llama_dir, monkeypatch):
    def error(**kwargs) -> str:
        with pytest.raises(ValueError) as info:
            EngineArgs(model=llama_dir, **kwargs)
        return str(info.value)
    assert error(swap_space=-1) == "swap_space must be a non-negative number of GiB, got -1."
    assert error(swap_space=float("inf")) == "swap_space must be a non-negative number of GiB, got inf."
    assert error(swap_space="4") == "swap_space must be a non-negative number of GiB, got '4'."
    assert error(preemption_mode="bogus") == "preemption_mode must be one of recompute, swap; got 'bogus'."
    assert error(preemption_mode="swap") == \
        "preemption_mode='swap' needs swap_space > 0 (GiB of host memory per device)."
    assert error(swap_space=1, speculative_config={"model": llama_dir, "num_speculative_tokens": 2}) == (
        "swap_space: speculative method 'draft_model' keeps a KV cache of its own, which is not "
        "swapped; use swap_space=0 (or 'ngram').")
    monkeypatch.setattr(tritium.config, "available_host_memory", lambda: 4 << 30)
    assert error(swap_space=3, tensor_parallel_size=2) == (
        "swap_space=3 GiB per device (6.00 GiB for 2 device(s)) is more than the host's available "
        "memory (4.00 GiB).")
    with pytest.raises(ValueError, match=re.escape("engine argument swap_space: cannot parse 'lots' as float.")):
        EngineArgs.from_strings({"model": llama_dir, "swap_space": "lots"})
    # As config.pbtxt and model.json give them.
    args = EngineArgs.from_strings({"model": llama_dir, "swap_space": "2.5", "preemption_mode": "swap"})
    assert (args.swap_space, args.preemption_mode) == (2.5, "swap")
    assert EngineArgs.from_strings({"model": llama_dir, "preemption_mode": "none"}).preemption_mode is None


def test_the_resolved_parts_carry_swap_space_and_the_preemption_mode(llama_dir):
    from tritium.models import model_limits
    for kwargs, mode in (({}, "recompute"), ({"swap_space": 0.01}, "auto"),
                         ({"swap_space": 0.01, "preemption_mode": "recompute"}, "recompute"),
                         ({"swap_space": 0.01, "preemption_mode": "swap"}, "swap")):
        args = EngineArgs(model=llama_dir, **kwargs)
        config = args.create_engine_config(args.create_model_config(model_limits))
        assert config.cache_config.swap_space == kwargs.get("swap_space", 0.0)
        assert config.scheduler_config.preemption_mode == mode


def test_each_tensor_parallel_rank_swaps_its_shard_of_an_fp8_cache(llama_dir):
    """tensor_parallel_size=2 (gloo): each rank holds one of the two kv heads and swaps its own
    part of every block; an FP8 cache moves as bytes. Tokens equal one rank's in a large cache."""
    prompts = random_prompts(7, (30, 41, 22, 35))
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fp8 = dict(kv_cache_dtype="fp8", enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in LLM(llama_dir, device="cpu", dtype="float32", block_size=16,
                                                num_kv_blocks=256, **fp8).generate(prompts, greedy)]
    llm = LLM(llama_dir, tensor_parallel_size=2, **fp8, **SWAP)
    try:
        assert llm.engine.executor.worker.attn_layers[0].num_kv_heads == 1
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want
        assert llm.engine.get_stats().num_swapped_preemptions > 0
        _assert_empty(llm)
    finally:
        llm.shutdown()


def test_swapping_out_shared_blocks_and_a_fresh_copy_on_write_block():
    """A forked sibling shares its parent's blocks and has just taken a copy-on-write block
    that no step has filled yet: its swap-out copies the shared blocks (the parent keeps them)
    and, for the unfilled block, the block it was to be copied from."""
    bm = BlockManager(num_blocks=8, block_size=4)
    pool = HostBlockPool(4)
    swapper = KVSwapper(pool, "swap", bm)
    parent = Sequence("r", list(range(6)), 6, SamplingParams(max_tokens=4))
    assert bm.allocate_slots(parent, 6) and parent.block_table == [0, 1]
    parent.num_computed_tokens = 6
    child = parent.fork(1)
    bm.fork(parent, child)
    assert bm.allocate_slots(child, 1) and child.block_table == [0, 2]
    assert bm.pending_copies == [(1, 2)]
    swapper.swap_out(child)
    assert pool.take_copies_out() == [(0, 0), (1, 1)]
    assert bm.pending_copies == [] and child.block_table == [] and child.host_block_table == [0, 1]
    assert [bm.blocks[i].ref_cnt for i in (0, 1, 2)] == [1, 1, 0]
    bm.check_integrity([parent, child])
    pool.check_integrity([parent, child])
    assert bm.allocate_slots(child, 1)  # resumed: its 6 computed tokens and the next one
    assert swapper.swap_in(child) == [(0, child.block_table[0]), (1, child.block_table[1])]
    pool.check_integrity([parent, child])
    # Held until the step that copies them in is taken: its copies out must not reuse them.
    assert pool.num_free_blocks == 2 and pool.allocate(2) == [2, 3]
    assert pool.take_copies_out() == []
    assert pool.num_free_blocks == 2 and swapper.stats()["num_blocks_swapped_in"] == 2


def test_swap_space_from_model_json_and_config_pbtxt(llama_dir, tmp_path):
    """As the vLLM backend's repositories give it: a number in 1/model.json, a string parameter."""
    import json

    from tritium.serving.triton_config import serving_config
    version = tmp_path / "llm" / "1"
    version.mkdir(parents=True)
    (version / "model.json").write_text(json.dumps({"model": llama_dir, "swap_space": 0.5}), encoding="utf-8")
    cfg = serving_config({"preemption_mode": "swap"}, str(tmp_path), str(version))
    assert (cfg.engine_args.swap_space, cfg.engine_args.preemption_mode) == (0.5, "swap")
    assert not any("swap_space" in note for note in cfg.notes)
    with pytest.raises(ValueError, match=r"^preemption_mode must be one of recompute, swap; got 'later'\.$"):
        serving_config({"model": llama_dir, "preemption_mode": "later"}, str(tmp_path))


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_random_workload_with_swapping_keeps_every_block_s_contents(mode):
    """The soak of tests/engine/swap_soak.py, preemption by swap alone (the prefix cache's host
    tier is tested in test_host_prefix_cache.py): every token a step reads is the sequence's
    own, and at the end nothing is held anywhere."""
    sched, finished = run_swap_soak(mode, host_tier=False)
    bm, pool = sched.block_manager, sched.host_pool
    stats = sched.swap_stats()
    assert finished > 50 and stats["num_swapped_preemptions"] > 0 and stats["num_blocks_swapped_in"] > 0
    if mode == "auto":
        assert sched.num_preemptions > stats["num_swapped_preemptions"]  # short ones recomputed
    bm.check_integrity([])
    pool.check_integrity([])
    assert bm.num_free_blocks == bm.num_blocks and pool.num_free_blocks == pool.num_blocks
    assert stats["num_swapped"] == 0
