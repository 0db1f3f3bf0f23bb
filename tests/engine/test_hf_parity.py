"""Greedy generation must be token-for-token identical to Hugging Face transformers (float32, CPU)
under prefix caching, chunked prefill with a tiny token budget, staggered arrivals and preemption."""
from __future__ import annotations

import random

import pytest
import torch
from hf_reference import hf_greedy_generate
from transformers import AutoModelForCausalLM, AutoTokenizer

from tritium import LLM, EngineArgs, LLMEngine, SamplingParams
from tritium.engine.request import accumulate

MAX_NEW = 20
SHARED_PREFIX = ("The scheduler computes the next word for every user while others run. "
                 "A client streams tokens one step at a time. ")


def make_prompts(tokenizer) -> list[list[int]]:
    """18 prompts of different lengths; half of them share a prefix of several full blocks."""
    rng = random.Random(0)
    words = "the engine cache block token stream prefill decode kernel café 日本 ∑ user GPU".split()
    prompts = []
    for i in range(18):
        tail = " ".join(rng.choice(words) for _ in range(rng.randint(0, 12 + i)))
        text = (SHARED_PREFIX + tail) if i % 2 == 0 else (tail or "x")
        prompts.append(tokenizer(text)["input_ids"])
    return prompts


def hf_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return hf_greedy_generate(model, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def expected(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = make_prompts(tok)
    return prompts, hf_greedy(model_dir, prompts)


def run_staggered(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Submit a third of the prompts, then one more every other step while the others run.
    min_tokens, as Hugging Face's min_new_tokens, keeps EOS from being drawn."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    pending = list(enumerate(prompts))
    results: dict[str, object] = {}
    for _ in range(len(prompts) // 3):
        i, p = pending.pop(0)
        engine.add_request(str(i), p, params)
    step = 0
    while engine.has_unfinished_requests() or pending:
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params)
        for delta in engine.step():
            results[delta.request_id] = accumulate(results.get(delta.request_id), delta)
        engine.block_manager.check_integrity(engine.scheduler.all_sequences())
        step += 1
    return {rid: out.outputs[0].token_ids for rid, out in results.items()}


def test_matches_hf_under_chunking_prefix_hits_and_preemption(model_dir, expected):
    prompts, ref = expected
    # 16-token budget forces chunked prefill; 24 blocks of 16 for 18 requests of up to ~80
    # tokens forces preemption.
    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", max_num_batched_tokens=16,
                                  num_kv_blocks=24, block_size=16, enable_prefix_caching=True))
    got = run_staggered(engine, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_cache_hits > 0
    for i in range(len(prompts)):
        assert got[str(i)] == ref[i], f"prompt {i} ({len(prompts[i])} tokens) differs from HF"
    engine.block_manager.check_integrity([])
    assert engine.block_manager.usage == 0.0


def test_matches_hf_with_default_engine_and_text_prompts(model_dir, expected):
    prompts, ref = expected
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [tok.decode(p, skip_special_tokens=True) for p in prompts]
    # Text round-trips to the same ids (the tokenizer adds BOS, as HF does by default).
    assert [tok(t)["input_ids"] for t in texts] == prompts
    llm = LLM(model_dir, dtype="float32")
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o in outs:
        assert o.outputs[0].finish_reason == "length"
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)


def test_greedy_logprobs_match_hf_scores(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    ids = tok("The cache streams a batch")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    x = torch.tensor([ids])
    gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=5, min_new_tokens=5,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    hf_logprobs = [torch.log_softmax(s[0].float(), -1) for s in gen.logits]
    out = LLM(llama_dir, dtype="float32").generate(
        [ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3))[0].outputs[0]
    assert out.token_ids == gen.sequences[0, len(ids):].tolist()
    total = 0.0
    for step, (tid, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = hf_logprobs[step]
        assert entry[tid].logprob == pytest.approx(ref[tid].item(), abs=1e-4)
        assert entry[tid].rank == 1
        top = ref.topk(3)
        assert sorted(entry) == sorted(top.indices.tolist())
        total += entry[tid].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
