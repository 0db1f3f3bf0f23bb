"""Sampling: seeds independent of the batch, top-k/top-p/min-p allowed sets, penalties, n > 1."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tritium import LLM, LLMEngine, EngineArgs, SamplingParams
from tritium.layers.sampler import Sampler
from tritium.core.sequence import PLACEHOLDER
from tritium.engine.request import accumulate


def row(params: SamplingParams, token_ids=(1, 2, 3), num_prompt_tokens=3, index=0):
    return SimpleNamespace(params=params, token_ids=list(token_ids),
                           num_prompt_tokens=num_prompt_tokens, index=index, generator=None, grammar=None)


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


def test_adjustments_of_several_rows_stay_on_their_rows():
    """The sampler applies each kind of adjustment to all rows' (row, token) pairs at once:
    every row gets its own (allowed ids, bias, penalties), and a row without any none."""
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    rows = [row(SamplingParams(allowed_token_ids=[1, 2], logit_bias={2: 1.0}), token_ids=[0], num_prompt_tokens=1),
            row(SamplingParams(allowed_token_ids=[0], repetition_penalty=2.0), token_ids=[0, 3], num_prompt_tokens=1),
            row(SamplingParams(), token_ids=[1, 2], num_prompt_tokens=1)]
    out = Sampler._apply_penalties(logits.clone(), Sampler.prepare(rows, 4, logits.device))
    inf = float("-inf")
    assert out.tolist() == [[inf, 2.0, 4.0, inf], [2.0, inf, inf, inf], [1.0, 1.0, 1.0, 1.0]]


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
    """All-greedy batches take kernels.greedy_sample (one pass); the same rows in a batch that also
    asks for logprobs take the log-softmax path. Both give the same tokens and logprobs."""
    from tritium import kernels
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=g) * 3
    logits[2, [7, 250]] = 40.0  # a tie: the first index wins on both paths
    greedy = SamplingParams(temperature=0)
    calls = []
    real = kernels.greedy_sample
    monkeypatch.setattr(kernels, "greedy_sample", lambda x: calls.append(x.shape) or real(x))
    fast = Sampler()(logits.clone(), [row(greedy) for _ in range(6)])
    assert calls == [(6, 300)]
    general = Sampler()(torch.cat([logits, logits[:1]]),
                        [row(greedy) for _ in range(6)] + [row(SamplingParams(temperature=0, logprobs=2))])
    assert calls == [(6, 300)]  # logprobs requested: the general path
    assert fast.token_ids.tolist() == general.token_ids[:6].tolist() == logits.argmax(-1).tolist()
    assert fast.token_ids[2].item() == 7
    torch.testing.assert_close(fast.logprobs, general.logprobs[:6], rtol=0, atol=1e-6)
    assert fast.ranks is None and fast.top_logprobs is None


def test_allowed_ids_and_logit_bias_change_logits_as_vllm_defines():
    """allowed_token_ids first (the rest to -inf), then logit_bias, then penalties on the result;
    logprobs stay those of the raw distribution."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    r = row(SamplingParams(temperature=0, allowed_token_ids=[0, 2, 4, 2], logit_bias={2: 4.0, 3: 9.0},
                           repetition_penalty=2.0), token_ids=[2], num_prompt_tokens=1)
    out = Sampler._apply_penalties(logits.clone(), Sampler.prepare([r], 5, logits.device))
    # token 3 is not allowed, so its bias does not bring it back; token 2: (0.5 + 4) / 2
    inf = float("-inf")
    assert out.tolist() == [[2.0, inf, 2.25, inf, 1.0]]
    sampled = Sampler()(logits.clone(), [r])
    assert sampled.token_ids.tolist() == [2]  # 2.25 beats token 0's 2.0; raw, token 3 would win
    assert sampled.logprobs.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item())


def test_greedy_rows_with_bias_or_allowed_ids_leave_the_fast_path(monkeypatch):
    from tritium import kernels
    calls = []
    monkeypatch.setattr(kernels, "greedy_sample", lambda x: calls.append(x.shape) or (_ for _ in ()).throw(AssertionError))
    logits = torch.tensor([[5.0, 1.0, 0.0], [5.0, 1.0, 0.0]])
    rows = [row(SamplingParams(temperature=0, logit_bias={1: 4.5})),
            row(SamplingParams(temperature=0, allowed_token_ids=[2]))]
    assert Sampler()(logits.clone(), rows).token_ids.tolist() == [1, 2]
    assert calls == []


def test_logit_bias_and_allowed_ids_through_the_engine(llama_dir):
    """Greedy generation restricted to two ids alternates as their raw logits say; a large bias
    forces a token; out-of-vocabulary ids are refused with a clear error."""
    engine = LLMEngine(EngineArgs(model=llama_dir))
    prompt = [1, 17, 42, 99]
    base = run(engine, {"b": (prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                        logprobs=1))})["b"].outputs[0]
    forced = run(engine, {"f": (prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                          logit_bias={123: 1000.0}))})["f"].outputs[0]
    assert forced.token_ids == [123] * 6 != base.token_ids
    allowed = [base.token_ids[0], 7]
    only = run(engine, {"a": (prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                        allowed_token_ids=allowed, logprobs=0))})["a"].outputs[0]
    assert set(only.token_ids) <= set(allowed) and only.token_ids[0] == base.token_ids[0]
    # logprobs are the raw distribution's: the first token's equals the unrestricted run's
    assert only.logprobs[0][only.token_ids[0]].logprob == pytest.approx(
        base.logprobs[0][base.token_ids[0]].logprob, abs=1e-5)
    for params, message in [
            (SamplingParams(logit_bias={engine.vocab_size: 1.0}),
             f"logit_bias: token id {engine.vocab_size} is out of vocabulary (valid ids are 0 to "
             f"{engine.vocab_size - 1})."),
            (SamplingParams(allowed_token_ids=[3, engine.vocab_size + 5]),
             f"allowed_token_ids: token id {engine.vocab_size + 5} is out of vocabulary (valid ids are 0 "
             f"to {engine.vocab_size - 1}).")]:
        with pytest.raises(ValueError) as e:
            engine.add_request("bad", prompt, params)
        assert str(e.value) == message


@pytest.mark.parametrize("kwargs, message", [
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be non-negative token ids, got -1."),
    ({"logit_bias": {3: float("nan")}}, "logit_bias values must be finite numbers, got nan for token 3."),
    ({"logit_bias": [1, 2]}, "logit_bias must map token ids to numbers, got [1, 2]."),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty."),
    ({"allowed_token_ids": [1, True]}, "allowed_token_ids must contain only non-negative integers, got True."),
])
def test_bad_logit_bias_and_allowed_ids(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value) == message
    assert SamplingParams.from_dict({"logit_bias": '{"5": "2.5"}', "allowed_token_ids": "[4, 5]"}).logit_bias == {5: 2.5}


def test_truncate_prompt_tokens_keeps_the_prompt_end(llama_dir):
    """The last k prompt tokens, as if only they had been sent; -1 fits a too-long prompt to
    max_model_len (one token left to generate); shorter prompts are left alone."""
    engine = LLMEngine(EngineArgs(model=llama_dir, max_model_len=64))
    prompt = list(range(3, 103))  # 100 tokens, longer than max_model_len
    greedy = dict(temperature=0, max_tokens=5, ignore_eos=True)
    cut = run(engine, {"cut": (prompt, SamplingParams(truncate_prompt_tokens=20, **greedy))})["cut"]
    tail = run(engine, {"tail": (prompt[-20:], SamplingParams(**greedy))})["tail"]
    assert cut.prompt_token_ids == prompt[-20:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    fit = run(engine, {"fit": (prompt, SamplingParams(truncate_prompt_tokens=-1, temperature=0, max_tokens=1))})["fit"]
    assert fit.prompt_token_ids == prompt[-63:] and len(fit.outputs[0].token_ids) == 1
    short = run(engine, {"short": (prompt[:10], SamplingParams(truncate_prompt_tokens=20, **greedy))})["short"]
    assert short.prompt_token_ids == prompt[:10]
    with pytest.raises(ValueError) as e:
        engine.add_request("long", prompt, SamplingParams(**greedy))
    assert str(e.value) == ("The prompt has 100 tokens, but max_model_len is 64: prompt plus at least one "
                            "generated token must fit.")


@pytest.mark.parametrize("value, message", [
    (0, "truncate_prompt_tokens must be -1 or at least 1, got 0."),
    (-2, "truncate_prompt_tokens must be -1 or at least 1, got -2."),
    (2.5, "truncate_prompt_tokens must be of type int, got 2.5."),
])
def test_bad_truncate_prompt_tokens(value, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(truncate_prompt_tokens=value)
    assert str(e.value) == message
    assert SamplingParams.from_dict({"truncate_prompt_tokens": "8"}).truncate_prompt_tokens == 8


def test_bad_words_ban_a_word_s_last_token_after_its_prefix():
    from tritium.layers.sampler import _banned_by_bad_words
    words = [[5], [7, 8], [1, 2, 3]]
    assert _banned_by_bad_words(words, []) == [5]
    assert _banned_by_bad_words(words, [9, 7]) == [5, 8]
    assert _banned_by_bad_words(words, [0, 1, 2]) == [3, 5]
    assert _banned_by_bad_words(words, [2, 1]) == [5]


def test_bad_words_tokenized_as_vllm_does():
    """The word without leading spaces, and with one leading space when that tokenizes to as
    many tokens starting with another id."""
    vocab = {"cat": [10], " cat": [11], "big cat": [20, 11], " big cat": [21, 11],
             "engine": [30, 31], " engine": [32]}
    p = SamplingParams(bad_words=["cat", "  big cat", "engine"])
    p.tokenize_bad_words(lambda text: vocab[text])
    assert p._bad_words_token_ids == [[10], [11], [20, 11], [21, 11], [30, 31]]
    assert p.needs_output_on_host  # multi-token words read the previous tokens
    single = SamplingParams(bad_words="cat")
    single.tokenize_bad_words(lambda text: vocab[text])
    assert single._bad_words_token_ids == [[10], [11]] and not single.needs_output_on_host
    with pytest.raises(ValueError) as e:
        SamplingParams(bad_words=["ok", "  "])
    assert str(e.value) == "bad_words must contain only non-empty strings, got '  '."


def test_bad_words_through_the_engine(llama_dir):
    engine = LLMEngine(EngineArgs(model=llama_dir))
    tok = engine.tokenizer
    prompt = [1, 17, 42, 99]
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    base = run(engine, {"b": (prompt, SamplingParams(**greedy))})["b"].outputs[0].token_ids
    # a generated token whose text tokenizes back to it alone: a one-token bad word
    k, word = next((i, tok.decode([t])) for i, t in enumerate(base)
                   if tok.encode(tok.decode([t]).lstrip(), add_special_tokens=False) == [t])
    banned = run(engine, {"w": (prompt, SamplingParams(bad_words=[word], **greedy))})["w"].outputs[0].token_ids
    assert base[k] not in banned and banned[:k] == base[:k] and banned[k] != base[k]
    # a two-token word from the output: its second token never follows its first
    pair = tok.encode(tok.decode(base[2:4]).lstrip(), add_special_tokens=False)
    assert pair == base[2:4]  # so the unrestricted output has it, and the ban must change it
    params = SamplingParams(bad_words=[tok.decode(pair)], **greedy)
    out = run(engine, {"p": (prompt, params)})["p"].outputs[0].token_ids
    assert all(out[i:i + 2] != pair for i in range(len(out) - 1))
    with pytest.raises(ValueError) as e:
        engine.add_request("bad", prompt, SamplingParams(bad_words=[""]))
    assert str(e.value) == "bad_words must contain only non-empty strings, got ''."


def test_penalties_read_the_previous_token_while_steps_overlap(llama_dir, monkeypatch):
    """A repetition penalty reads every earlier token of its row: the counts stay on the device
    (PenaltyCounts) and the sampler adds each sampled token to them, so each step is launched
    before the previous step's tokens are taken, with no deferred sampling. Greedy tokens with
    the penalty equal Hugging Face's (RepetitionPenaltyLogitsProcessor is vLLM's definition),
    for requests with and without it in one batch, and min_tokens counts the same."""
    from hf_reference import hf_greedy_generate
    from transformers import AutoModelForCausalLM
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (9, 30, 17)]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32)
    want = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, min_new_tokens=12,
                        do_sample=False, pad_token_id=0, repetition_penalty=1.8)
        want.append(y[0, len(ids):].tolist())
    plain = hf_greedy_generate(hf, prompts, 12)
    assert want != plain  # the penalty changes the output: the test can tell
    llm = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=128)
    executor, deferred, overlapped = llm.engine.executor, [], []
    execute = executor.execute_model

    def watch_execute(step):  # a placeholder input: the previous step is in flight
        # (the worker's own tokens of the sequences it holds, and those of the new ones)
        tokens = [executor.runner.states[d.seq_id].token_ids for d in step.cached_sequences]
        overlapped.append(any(PLACEHOLDER in t for t in tokens + [d.token_ids for d in step.new_sequences]))
        if step.defer_sampling:
            deferred.append(len(step.sample_rows))
        return execute(step)
    monkeypatch.setattr(executor, "execute_model", watch_execute)
    penalty = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, repetition_penalty=1.8)
    greedy = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    outs = llm.generate(prompts + prompts, [penalty] * 3 + [greedy] * 3)
    assert [o.outputs[0].token_ids for o in outs] == want + plain
    assert deferred == [] and overlapped == [False] + [True] * 11
