"""KV memory that follows a sliding window: when every layer attends to at most W past tokens,
the blocks behind the window go back to the pool as a sequence grows (prefix-cached ones stay
hits until evicted); forks, preemption by swap and recompute keep every token attention reads
the sequence's own; greedy tokens still equal Hugging Face's while a cache too small for the
sequences' whole histories serves them without preemption. A model with one full-attention
layer keeps every block."""
from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy_generate
from swap_soak import random_prompts, run_swap_soak
from transformers import AutoModelForCausalLM

from tritium import EngineArgs, LLMEngine, SamplingParams
from tritium.core.block_manager import NULL_BLOCK_ID, BlockManager
from tritium.core.host_block_pool import HostBlockPool
from tritium.core.kv_swap import KVSwapper
from tritium.core.sequence import Sequence
from scripts.build_default_model import build_model


def _grow(bm: BlockManager, s: Sequence, tokens: int) -> list[int]:
    """Decode `tokens` tokens one step at a time; the blocks it holds after each step."""
    held = []
    for t in range(tokens):
        assert bm.allocate_slots(s, 1)
        s.num_computed_tokens += 1
        bm.cache_full_blocks(s)
        s.append_token(100 + t)
        held.append(len(s.block_table) - s.num_released_blocks)
        bm.check_integrity([s])
    return held


def test_blocks_behind_the_window_go_back_and_stay_prefix_hits():
    bm = BlockManager(num_blocks=16, block_size=4, sliding_window=8)
    s = Sequence("a", list(range(3)), 3, SamplingParams())
    assert bm.allocate_slots(s, 3) and s.block_table == [0]
    s.num_computed_tokens = 3
    s.append_token(3)
    held = _grow(bm, s, 37)
    # The query at c sees keys c-7..c: the blocks from (c-7)//4 to c's are held, no others.
    assert held == [-(-(c + 1) // 4) - max(0, (c - 7) // 4) for c in range(3, 40)]
    assert max(held) == 3
    assert len(s.block_table) == 10 and s.num_released_blocks == 8
    assert bm.num_free_blocks == 16 - 2
    # Released blocks keep their hashes: a prompt with the same first 32 tokens hits them.
    t = Sequence("b", s.token_ids[:33], 33, SamplingParams())
    hit = bm.get_computed_blocks(t)
    assert [b.block_id for b in hit.blocks] == s.block_table[:8] and hit.num_tokens == 32
    # Of the hit, it takes only the blocks its first query's window reaches (keys 25..32).
    assert bm.allocate_slots(t, 1, hit)
    assert t.num_released_blocks == 6 and t.block_table[6:8] == s.block_table[6:8]
    assert [bm.blocks[b].ref_cnt for b in s.block_table[6:8]] == [1, 1]
    assert bm.blocks[s.block_table[5]].ref_cnt == 0
    bm.check_integrity([s, t])


def test_forks_share_the_window_and_free_everything():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False, sliding_window=6)
    a = Sequence("a", list(range(20)), 20, SamplingParams())
    assert bm.allocate_slots(a, 20)
    a.num_computed_tokens = 20
    a.append_token(7)
    assert bm.allocate_slots(a, 1) and a.num_released_blocks == 3  # keys 15..19 are still seen
    b = a.fork(1)
    bm.fork(a, b)
    assert b.num_released_blocks == 3 and b.block_table == a.block_table
    bm.check_integrity([a, b])
    a.num_computed_tokens = b.num_computed_tokens = 21
    for x in (a, b):
        x.append_token(9)
        assert bm.allocate_slots(x, 1)
    bm.check_integrity([a, b])
    bm.free(a)
    bm.free(b)
    bm.check_integrity([])
    assert bm.num_free_blocks == 16


def test_swap_keeps_only_the_window_and_rebuilds_the_table_past_it():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False, sliding_window=6)
    swapper = KVSwapper(HostBlockPool(8), "swap", bm)
    s = Sequence("a", list(range(21)), 21, SamplingParams())
    assert bm.allocate_slots(s, 21)
    s.num_computed_tokens = 21
    s.append_token(5)
    assert bm.allocate_slots(s, 1) and s.num_released_blocks == 4
    live = s.block_table[4:]
    assert swapper.should_swap(s, chunk_cap=1)
    swapper.swap_out(s)
    assert s.block_table == [] and s.num_released_blocks == 4 and len(s.host_block_table) == len(live)
    assert swapper.host_pool.take_copies_out() == list(zip(live, s.host_block_table))
    assert bm.num_free_blocks == 16
    host = list(s.host_block_table)
    assert bm.allocate_slots(s, 1)  # its next token, on top of the computed 21
    assert s.block_table[:4] == [NULL_BLOCK_ID] * 4 and len(s.block_table) == 6
    assert swapper.swap_in(s) == list(zip(host, s.block_table[4:]))
    bm.check_integrity([s])
    assert bm.num_free_blocks == 14


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_soak_reads_only_the_sequences_own_tokens_inside_the_window(mode, monkeypatch):
    """The swap soak (forks, shared prefixes, aborts, preemption, the host tier) with a window
    of 24 tokens (sequences grow to 95): every token a step's attention reads is the
    sequence's own."""
    released = [0]
    release = BlockManager.release_out_of_window

    def counted(self, seq):
        n = release(self, seq)
        released[0] += n
        return n
    monkeypatch.setattr(BlockManager, "release_out_of_window", counted)
    sched, finished = run_swap_soak(mode, host_tier=True, seed=50, sliding_window=24)
    assert finished > 300 and released[0] > 100
    assert sched.num_preemptions > 0
    sched.block_manager.check_integrity([])
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def _serve(engine: LLMEngine, prompts, max_new: int) -> tuple[list[list[int]], int]:
    """Greedy tokens, and the most blocks held at once."""
    params = SamplingParams(temperature=0, max_tokens=max_new, min_tokens=max_new)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    bm, peak = engine.block_manager, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id].extend(o.outputs[0].token_ids)
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
    bm.check_integrity([])
    return [got[str(i)] for i in range(len(prompts))], peak


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.mark.parametrize("extra", [{}, dict(speculative_config=NGRAM),
                                   dict(swap_space=0.01, preemption_mode="swap", num_kv_blocks=14)])
def test_mistral_window_serves_more_than_the_cache_holds_and_matches_hf(tmp_path, extra):
    """Four sequences of 90-100 tokens with a 16-token window on 30 blocks of 4 tokens (120
    tokens; their histories need about 95 blocks): no preemption, HF's tokens, with n-gram
    speculation too. On 14 blocks some are preempted by swap, and the window's blocks alone go
    to host memory and back."""
    d = build_model(str(tmp_path / "mistral"), arch="mistral", seed=9, sliding_window=16)
    args = dict(model=d, dtype="float32", block_size=4, num_kv_blocks=30, max_num_batched_tokens=16,
                enable_prefix_caching=True)
    engine = LLMEngine(EngineArgs(**{**args, **extra}))
    assert engine.block_manager.sliding_window == 16
    prompts = random_prompts(11, (30, 41, 22, 35))
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    got, peak = _serve(engine, prompts, 60)
    assert got == hf_greedy_generate(hf, prompts, 60)
    stats = engine.get_stats()
    if "swap_space" not in extra:
        assert stats.num_preemptions == 0 and peak <= 30
    else:
        assert stats.num_swapped_preemptions > 0
        assert stats.num_blocks_swapped_in == stats.num_blocks_swapped_out
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_full_attention_layer_keeps_every_block(tmp_path):
    """Gemma 2 (every other layer global) gives nothing back; nor does a windowed model with a
    draft model (the draft attends to everything)."""
    from test_gemma import FAMILIES
    gemma = build_model(str(tmp_path / "g2"), seed=11, num_attention_heads=4, num_key_value_heads=2,
                        **FAMILIES["gemma2"])
    assert LLMEngine(EngineArgs(model=gemma, dtype="float32")).block_manager.sliding_window is None
    mistral = build_model(str(tmp_path / "m"), arch="mistral", seed=9, sliding_window=16)
    drafted = LLMEngine(EngineArgs(model=mistral, dtype="float32", speculative_config={
        "model": mistral, "num_speculative_tokens": 2}))
    assert drafted.block_manager.sliding_window is None
