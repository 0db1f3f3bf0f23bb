"""prompt_logprobs: each prompt token's logprob given the tokens before it, its rank and the most
likely alternatives, equal to Hugging Face's (float32, CPU) under chunked prefill, a shared
prefix in the cache and preemption; delivered once, with the first token."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tritium import EngineArgs, LLMEngine, SamplingParams
from tritium.worker import model_runner
from tritium.engine.request import accumulate

PREFIX = "The scheduler computes the next word for every user while others run. A client streams "


def hf_logprobs(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]


def check_against(ref: torch.Tensor, prompt: list[int], got: list, k: int) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        dist, token = ref[i - 1], prompt[i]
        entry = got[i]
        assert entry[token].logprob == pytest.approx(dist[token].item(), abs=1e-4), i
        assert entry[token].rank == int((dist > dist[token]).sum()) + 1, i
        top = dist.topk(k).indices.tolist() if k else []
        assert set(entry) == set(top) | {token}, i
        for r, t in enumerate(top):
            if t != token:
                assert entry[t].rank == r + 1 and entry[t].logprob == pytest.approx(dist[t].item(), abs=1e-4)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Submit one request, then one more every step; returns the accumulated outputs and how many
    outputs of each request carried prompt logprobs."""
    pending = list(requests.items())
    results: dict = {}
    carried: dict[str, int] = {}
    while pending or engine.has_unfinished_requests():
        if pending:
            rid, (prompt, params) = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for delta in engine.step():
            if delta.prompt_logprobs is not None:
                carried[delta.request_id] = carried.get(delta.request_id, 0) + 1
                assert delta.outputs[0].token_ids, "prompt logprobs come with the first token"
            results[delta.request_id] = accumulate(results.get(delta.request_id), delta)
        engine.block_manager.check_integrity(engine.scheduler.all_sequences())
    return {"outputs": results, "carried": carried}


@pytest.mark.parametrize("budget", [16, 2])
def test_prompt_logprobs_match_hf_with_chunks_and_a_cached_prefix(model_dir, budget):
    """Budget 16: prompts in chunks of several tokens. Budget 2: one prompt token per step next
    to a decode, packed as a decode row (rows of one token)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(PREFIX + tail)["input_ids"] for tail in ("tokens.", "a batch of words to the cache",
                                                            "every kernel the GPU has, one block at a time")]
    prompts.append(prompts[0][:1])  # one token: nothing to score
    ref = hf_logprobs(model_dir, prompts)
    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", max_num_batched_tokens=budget,
                                  block_size=16, num_kv_blocks=64, enable_prefix_caching=True))
    spans: list = []
    execute = engine.executor.execute_model

    def execute_and_record(step):
        num_new = {item.seq_id: item.num_new_tokens for item in step.scheduled}
        spans.extend((num_new[span.seq_id], span.first, span.end) for span in step.prompt_spans)
        return execute(step)

    engine.executor.execute_model = execute_and_record
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    requests = {"warm": (prompts[2], SamplingParams(**greedy))}  # puts the shared prefix in the cache
    ks = {"p0": 3, "p1": 0, "p2": 5, "p3": 2}
    for i, k in enumerate(ks.values()):
        requests[f"p{i}"] = (prompts[i], SamplingParams(prompt_logprobs=k, **greedy))
    requests["plain"] = (prompts[1], SamplingParams(**greedy))
    got = run(engine, requests)
    outs = got["outputs"]
    for i, (rid, k) in enumerate(ks.items()):
        check_against(ref[i], prompts[i], outs[rid].prompt_logprobs, k)
        assert outs[rid].num_cached_tokens == 0, "the prompt is computed in full"
        assert outs[rid].outputs[0].token_ids[0] == int(ref[i][-1].argmax())
    assert got["carried"] == {rid: 1 for rid in ks}
    assert outs["plain"].num_cached_tokens > 0 and outs["plain"].prompt_logprobs is None
    assert outs["plain"].outputs[0].token_ids == outs["p1"].outputs[0].token_ids
    # Every prompt position was computed once, in several chunks per prompt.
    assert sum(end - first for _, first, end in spans) == sum(len(p) - 1 for p in prompts)
    assert len(spans) > len(prompts)
    assert any(n == 1 for n, _, _ in spans) if budget == 2 else any(n > 1 for n, _, _ in spans)


def test_prompt_logprobs_survive_preemption_without_being_computed_twice(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    prompts = [tok(PREFIX + " ".join(["word"] * (10 + 7 * i)))["input_ids"] for i in range(6)]
    ref = hf_logprobs(llama_dir, prompts)
    # 12 blocks of 16 tokens for six prompts of ~30-70 tokens that each generate 24: preemption.
    engine = LLMEngine(EngineArgs(model=llama_dir, dtype="float32", max_num_batched_tokens=32,
                                  block_size=16, num_kv_blocks=12, enable_prefix_caching=True))
    rows = []
    compute = model_runner.compute_prompt_logprobs

    def counting(compute_logits, hidden, targets, num_top, rows_per_pass):
        rows.append(hidden.shape[0])
        return compute(compute_logits, hidden, targets, num_top, rows_per_pass)

    model_runner.compute_prompt_logprobs = counting
    try:
        got = run(engine, {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                      prompt_logprobs=1)) for i, p in enumerate(prompts)})
    finally:
        model_runner.compute_prompt_logprobs = compute
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        check_against(ref[i], p, got["outputs"][f"r{i}"].prompt_logprobs, 1)
    assert sum(rows) == sum(len(p) - 1 for p in prompts)


def test_prompt_logprobs_with_n_samples_come_once(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    prompt = tok(PREFIX)["input_ids"]
    engine = LLMEngine(EngineArgs(model=llama_dir, dtype="float32"))
    got = run(engine, {"n": (prompt, SamplingParams(n=3, seed=7, max_tokens=5, prompt_logprobs=2))})
    out = got["outputs"]["n"]
    assert len(out.outputs) == 3 and got["carried"] == {"n": 1}
    check_against(hf_logprobs(llama_dir, [prompt])[0], prompt, out.prompt_logprobs, 2)


def test_prompt_logprobs_errors():
    for bad in (-1, 21):
        with pytest.raises(ValueError, match=rf"^prompt_logprobs must be in \[0, 20\], got {bad}\.$"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match=r"^sampling parameter 'prompt_logprobs' must be an integer, got 'x'\.$"):
        SamplingParams.from_dict({"prompt_logprobs": "x"})
    assert SamplingParams.from_dict({"prompt_logprobs": "4"}).prompt_logprobs == 4


def test_prompt_logprobs_above_max_logprobs(llama_dir):
    engine = LLMEngine(EngineArgs(model=llama_dir, dtype="float32", max_logprobs=2))
    with pytest.raises(ValueError, match=r"^prompt_logprobs=3 is larger than max_logprobs=2\.$"):
        engine.add_request("r", [1, 2, 3], SamplingParams(prompt_logprobs=3))


def test_decoded_tokens_of_logprobs(llama_dir):
    """Each Logprob carries its token's own text (vLLM's decoded_token), for the prompt's and
    the sampled ones; an id the tokenizer does not know keeps None."""
    from tritium.outputs import Logprob
    from tritium.engine.tokenizer import fill_decoded_tokens, load_tokenizer

    tok = load_tokenizer(llama_dir)
    ids = tok("Hello world")["input_ids"]
    entries = [None, {ids[1]: Logprob(-1.0), 10**6: Logprob(-2.0)}, {ids[2]: Logprob(-3.0, decoded_token="kept")}]
    fill_decoded_tokens(tok, entries)
    assert entries[1][ids[1]].decoded_token == tok.convert_tokens_to_string([tok.convert_ids_to_tokens(ids[1])])
    assert entries[1][10**6].decoded_token is None and entries[2][ids[2]].decoded_token == "kept"
    assert tok.convert_tokens_to_string(["Ġw"]) == " w"  # byte-level pieces are made readable

    engine = LLMEngine(EngineArgs(model=llama_dir, dtype="float32"))
    got = run(engine, {"r": (ids, SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=1))})
    out = got["outputs"]["r"]
    entries = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    assert len(entries) == len(ids) - 1 + 4
    for entry in entries:
        for t, lp in entry.items():
            assert lp.decoded_token == tok.convert_tokens_to_string([tok.convert_ids_to_tokens(t)])
