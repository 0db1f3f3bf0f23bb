"""Sampling: seeds independent of the batch, top-k/top-p/min-p allowed sets, penalties, n > 1."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from backend import LLM, LLMEngine, EngineArgs, SamplingParams
from backend.layers.sampler import Sampler
from backend.request import accumulate


def row(params: SamplingParams, token_ids=(1, 2, 3), num_prompt_tokens=3, index=0):
    return SimpleNamespace(params=params, token_ids=list(token_ids),
                           num_prompt_tokens=num_prompt_tokens, index=index, generator=None)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, p) in requests.items():
        engine.add_request(rid, prompt, p)
    results: dict = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            results[d.request_id] = accumulate(results.get(d.request_id), d)
    return results


def test_seeded_request_same_alone_and_in_busy_batch(llama_dir):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    prompt = [0, 5, 9, 42, 77]
    alone = run(LLMEngine(EngineArgs(model=llama_dir)), {"s": (prompt, seeded)})["s"]
    busy_requests = {f"noise{i}": ([0, i + 3, i + 7] * (i + 1),
                                   SamplingParams(temperature=1.2, max_tokens=10 + i, ignore_eos=True))
                     for i in range(6)}
    busy_requests["s"] = (prompt, seeded)
    busy = run(LLMEngine(EngineArgs(model=llama_dir, max_num_batched_tokens=16)), busy_requests)["s"]
    assert busy.outputs[0].token_ids == alone.outputs[0].token_ids
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=24, ignore_eos=True)
    different = run(LLMEngine(EngineArgs(model=llama_dir)), {"s": (prompt, other_seed)})["s"]
    assert different.outputs[0].token_ids != alone.outputs[0].token_ids


def _draws(params: SamplingParams, logits: torch.Tensor, num: int) -> set[int]:
    sampler = Sampler()
    rows = [row(params) for _ in range(num)]
    return set(sampler(logits.expand(num, -1).clone(), rows).token_ids.tolist())


@pytest.fixture
def logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 64, generator=g) * 2


def test_top_k_never_leaves_the_k_most_likely(logits):
    allowed = set(logits[0].topk(5).indices.tolist())
    seen = _draws(SamplingParams(temperature=1.5, top_k=5), logits, 4000)
    assert seen <= allowed and len(seen) == 5


def test_top_p_keeps_the_smallest_set_reaching_p(logits):
    probs = torch.softmax(logits[0] / 0.8, -1)
    order = probs.argsort(descending=True).tolist()
    allowed, mass = set(), 0.0
    for t in order:
        allowed.add(t)
        mass += probs[t].item()
        if mass >= 0.6:
            break
    seen = _draws(SamplingParams(temperature=0.8, top_p=0.6), logits, 4000)
    assert seen <= allowed and len(seen) == len(allowed)


def test_min_p_drops_unlikely_tokens(logits):
    probs = torch.softmax(logits[0], -1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    seen = _draws(SamplingParams(temperature=1.0, min_p=0.2), logits, 4000)
    assert seen <= allowed and len(seen) == len(allowed)


def test_combined_filters_and_frequencies(logits):
    # top_k=3 at temperature 1: empirical frequencies follow the renormalised probabilities.
    top = logits[0].topk(3)
    expect = torch.softmax(top.values, -1)
    sampler = Sampler()
    rows = [row(SamplingParams(top_k=3)) for _ in range(6000)]
    ids = sampler(logits.expand(6000, -1).clone(), rows).token_ids
    for t, p in zip(top.indices.tolist(), expect.tolist()):
        freq = (ids == t).float().mean().item()
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / 6000) + 1e-3


def test_penalties_change_logits_as_vllm_defines():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    # prompt [0], output [3, 3, 2]
    r = row(SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5,
                           frequency_penalty=0.25), token_ids=[0, 3, 3, 2], num_prompt_tokens=1)
    out = Sampler._apply_penalties(logits.clone(), Sampler.prepare([r], 4, logits.device))
    # repetition: seen tokens 0, 2, 3 (prompt and output): positive / 2, negative * 2
    # presence/frequency: output counts {3: 2, 2: 1}
    expected = torch.tensor([[1.0, -1.0, 0.25 - 0.25 - 0.5, 1.5 - 0.5 - 0.5]])
    assert torch.allclose(out, expected)


def test_min_tokens_masks_eos_until_reached(llama_dir):
    engine = LLMEngine(EngineArgs(model=llama_dir))
    eos = engine.eos_token_ids[0]
    r = row(SamplingParams(min_tokens=2), token_ids=[1, 2, 3, 4], num_prompt_tokens=3)
    r.params._eos_token_ids = (eos,)
    logits = torch.zeros(1, engine.vocab_size)
    logits[0, eos] = 100.0
    md = Sampler.prepare([r], engine.vocab_size, logits.device)
    assert Sampler._apply_penalties(logits.clone(), md)[0, eos] == float("-inf")
    r.token_ids.append(5)
    md = Sampler.prepare([r], engine.vocab_size, logits.device)
    assert Sampler._apply_penalties(logits.clone(), md)[0, eos] == 100.0


def test_n_samples_share_prompt_blocks_copy_on_write(llama_dir):
    engine = LLMEngine(EngineArgs(model=llama_dir, block_size=16))
    prompt = list(range(1, 41))  # 2 full blocks + 8 tokens in a shared partial block
    p = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    engine.add_request("r", prompt, p)
    results = {}

    def step():
        for d in engine.step():
            results[d.request_id] = accumulate(results.get(d.request_id), d)

    step()  # prefill of the parent, then fork
    seqs = engine.requests["r"].seqs
    assert len(seqs) == 4
    tables = [s.block_table for s in seqs]
    assert all(t == tables[0] for t in tables)
    assert [engine.block_manager.blocks[b].ref_cnt for b in tables[0]] == [4, 4, 4]
    step()  # each sample writes into the shared partial block: three copies, one in place
    tables = [s.block_table for s in seqs]
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert len({t[2] for t in tables}) == 4
    engine.block_manager.check_integrity(engine.scheduler.all_sequences())
    while engine.has_unfinished_requests():
        step()
    outs = results["r"].outputs
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 6 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1
    assert engine.block_manager.usage == 0.0


def test_n_greedy_samples_are_identical_and_match_single(llama_dir):
    llm = LLM(llama_dir)
    one = llm.generate([[0, 3, 5]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    many = llm.generate([[0, 3, 5]], SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert [o.token_ids for o in many.outputs] == [one.outputs[0].token_ids] * 3


def test_greedy_fast_path_matches_the_general_path(monkeypatch):
    """All-greedy batches take ops.greedy_sample (one pass); the same rows in a batch that also
    asks for logprobs take the log-softmax path. Both give the same tokens and logprobs."""
    from backend.layers import ops
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=g) * 3
    logits[2, [7, 250]] = 40.0  # a tie: the first index wins on both paths
    greedy = SamplingParams(temperature=0)
    calls = []
    real = ops.greedy_sample
    monkeypatch.setattr(ops, "greedy_sample", lambda x: calls.append(x.shape) or real(x))
    fast = Sampler()(logits.clone(), [row(greedy) for _ in range(6)])
    assert calls == [(6, 300)]
    general = Sampler()(torch.cat([logits, logits[:1]]),
                        [row(greedy) for _ in range(6)] + [row(SamplingParams(temperature=0, logprobs=2))])
    assert calls == [(6, 300)]  # logprobs requested: the general path
    assert fast.token_ids.tolist() == general.token_ids[:6].tolist() == logits.argmax(-1).tolist()
    assert fast.token_ids[2].item() == 7
    torch.testing.assert_close(fast.logprobs, general.logprobs[:6], rtol=0, atol=1e-6)
    assert fast.ranks is None and fast.top_logprobs is None
