"""Speculative decoding with a draft model (backend/spec_decode/draft_model.py): greedy tokens equal
Hugging Face's whatever the draft proposes, sampled tokens keep the target's distribution, and
the draft's cache follows the target's through chunked prefill, prefix caching and preemption."""
from __future__ import annotations

import pytest
import torch

from tritium import LLM, EngineArgs, SamplingParams
from scripts.build_default_model import build_model

K = 3
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=512)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    """A draft that disagrees with the target: another architecture (Qwen2), one layer, its
    own random weights, the target's tokenizer."""
    return build_model(str(tmp_path_factory.mktemp("draft-qwen2")), seed=11, arch="qwen2", num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)


def _draft(model: str, k: int = K) -> dict:
    return {"model": model, "num_speculative_tokens": k}


def _prompts(seed: int, lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_greedy_tokens_equal_hugging_face_with_a_disagreeing_draft_and_with_the_target_as_its_own(
        llama_dir, other_draft):
    from hf_reference import hf_greedy_generate
    from transformers import AutoModelForCausalLM
    prompts = _prompts(3, (9, 40, 15, 23))
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32)
    want = hf_greedy_generate(hf, prompts, 20)
    # Prompt chunks of at most 16 tokens: the draft follows the target chunk by chunk.
    engine = dict(ENGINE, max_num_batched_tokens=16, enable_chunked_prefill=True)
    own = LLM(llama_dir, speculative_config=_draft(llama_dir), **engine)
    # Its passes through its graphs' static buffers (run eagerly on the CPU), greedy choice included.
    drafter, replays = own.engine.executor.worker.drafter, []
    drafter.build_graphs(capture=False)
    for graphs in (drafter.decode_graphs, drafter.prefill_graphs):
        run = graphs.run
        graphs.run = lambda *a, _run=run, _g=graphs: replays.append(type(_g).__name__) or _run(*a)
    assert _tokens(own, prompts, greedy) == want
    assert set(replays) == {"DecodeGraphs", "PrefillGraphs"}
    st = own.engine.get_stats()
    # Every proposal of the target's own copy is right: each step takes k + 1 tokens.
    assert st.spec_decode_num_draft_tokens > 0
    assert st.spec_decode_num_accepted_tokens == st.spec_decode_num_draft_tokens
    # Acceptance offline, as vLLM's LLM.get_metrics() gives it: counters and per position.
    from tritium.engine.metrics_reader import Counter, Vector
    metrics = {m.name: m for m in own.get_metrics()}
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    assert isinstance(accepted, Counter) and accepted.value == st.spec_decode_num_accepted_tokens
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and len(per_pos.values) == K and sum(per_pos.values) == accepted.value
    assert per_pos.values[0] == metrics["vllm:spec_decode_num_drafts"].value  # every first proposal kept
    other = LLM(llama_dir, speculative_config=_draft(other_draft), **engine)
    assert _tokens(other, prompts, greedy) == want
    st = other.engine.get_stats()
    assert st.spec_decode_num_drafts > 4 * 19 // (K + 1)
    assert st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens // 4  # it disagrees


def test_the_draft_follows_prefix_caching_and_preemption(llama_dir):
    """Prompts sharing a 32-token prefix in a cache so small that sequences are preempted and
    recomputed: tokens equal plain decoding's, and the target as its own draft is always right,
    so the draft's keys and values were there for every cached and recomputed block."""
    shared = _prompts(5, (32,))[0]
    prompts = [shared + p for p in _prompts(6, (5, 9, 3, 12))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = dict(device="cpu", dtype="float32", block_size=16, num_kv_blocks=14, max_num_batched_tokens=64,
                  enable_prefix_caching=True)
    want = _tokens(LLM(llama_dir, **engine), prompts, params)
    llm = LLM(llama_dir, speculative_config=_draft(llama_dir), **engine)
    assert _tokens(llm, prompts, params) == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_cache_hits > 0
    st = llm.engine.get_stats()
    assert 0 < st.spec_decode_num_accepted_tokens == st.spec_decode_num_draft_tokens


def test_sampled_tokens_keep_the_targets_distribution(llama_dir, other_draft):
    """600 unseeded draws of the second output token (the first verified position: its proposal
    kept with probability p(d), else drawn from p without d) at temperature 0.25, against
    Hugging Face's probabilities for each draw's context: Pearson's chi-square over the likeliest
    tokens and the rest. With the target as its own draft the proposal is p's argmax, kept
    about a quarter of the time; a verifier that kept it always, or never, fails by far."""
    from transformers import AutoModelForCausalLM
    prompt = _prompts(8, (12,))[0]
    n, temperature = 600, 0.25
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
    llm = LLM(llama_dir, speculative_config=_draft(llama_dir), max_num_seqs=128, **ENGINE)
    outs = _tokens(llm, [prompt] * n, params)
    st = llm.engine.get_stats()
    assert st.spec_decode_num_drafts == n and st.spec_decode_num_draft_tokens == n  # one proposal each
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        contexts = torch.tensor([prompt + o[:1] for o in outs])
        probs = torch.softmax(hf(contexts).logits[:, -1] / temperature, dim=-1)
    expected = probs.sum(dim=0)
    observed = torch.bincount(torch.tensor([o[1] for o in outs]), minlength=probs.shape[1]).double()
    cells = (expected >= 5).nonzero().flatten()
    rest = torch.ones_like(expected, dtype=torch.bool)
    rest[cells] = False
    e = torch.cat([expected[cells], expected[rest].sum()[None]]).double()
    o = torch.cat([observed[cells], observed[rest].sum()[None]])
    chi2 = float(((o - e) ** 2 / e).sum())
    df = len(e) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(chi2 / 2)))
    assert len(cells) >= 8
    assert p_value > 1e-3, (chi2, df)
    # The proposal (the argmax) was kept about as often as p says it is drawn.
    kept = st.spec_decode_num_accepted_tokens
    want_kept = float(probs.max(dim=-1).values.sum())
    assert abs(kept - want_kept) < 4 * want_kept ** 0.5 + 5, (kept, want_kept)


def test_seeded_requests_are_reproducible_and_penalties_apply(llama_dir, other_draft):
    """A seeded request draws each token from (seed, sample, position): with a draft, the
    tokens are those it gets without speculation; a repetition penalty and min_p apply at every
    verified position as without speculation (greedy: the same tokens)."""
    prompts = _prompts(12, (10, 17))
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, repetition_penalty=1.4, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, min_p=0.1, presence_penalty=0.5, max_tokens=16,
                             ignore_eos=True)]
    want = _tokens(LLM(llama_dir, **ENGINE), prompts * 3, params * 2)
    for draft in (llama_dir, other_draft):
        llm = LLM(llama_dir, speculative_config=_draft(draft), **ENGINE)
        assert _tokens(llm, prompts * 3, params * 2) == want


@pytest.mark.parametrize("config, message", [
    ({"method": "draft_model", "num_speculative_tokens": 3},
     "speculative_config: method 'draft_model' needs 'model', the directory of the draft model."),
    ({"method": "medusa", "model": "x", "num_speculative_tokens": 3},
     "speculative_config: method 'medusa' is not supported; supported: ngram, draft_model, eagle, eagle3."),
    ({"model": "x", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
     "speculative_config: prompt_lookup_max is for method 'ngram', not 'draft_model'."),
    ({"model": "x", "num_speculative_tokens": 3, "dtype": "int8"},
     "speculative_config: dtype must be auto, float32, bfloat16 or float16, got 'int8'."),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"},
     "speculative_config: model is for a draft model or EAGLE heads, not method 'ngram'."),
])
def test_bad_draft_configs_are_refused(llama_dir, config, message):
    with pytest.raises(ValueError) as e:
        EngineArgs(model=llama_dir, speculative_config=config)
    assert str(e.value) == message


def test_a_draft_without_the_targets_vocabulary_or_directory_is_refused(llama_dir, tmp_path):
    from scripts.build_default_model import build_model as build
    with pytest.raises(ValueError) as e:
        LLM(llama_dir, speculative_config=_draft(str(tmp_path / "nowhere")), **ENGINE)
    assert str(e.value) == f"speculative_config: model directory '{tmp_path / 'nowhere'}' does not exist."
    small = build(str(tmp_path / "small-vocab"), seed=3, vocab_size=300, num_hidden_layers=1)
    with pytest.raises(ValueError) as e:
        LLM(llama_dir, speculative_config=_draft(small), **ENGINE)
    assert str(e.value).startswith(f"speculative_config: the draft model's tokenizer ({small}) numbers its "
                                   "tokens otherwise than the target's (")
    with pytest.raises(ValueError) as e:
        EngineArgs(model=llama_dir, tensor_parallel_size=2, speculative_config=_draft(llama_dir),
                   device="cpu").create_engine_config(
            EngineArgs(model=llama_dir).create_model_config(lambda c: __import__(
                "tritium.models", fromlist=["model_limits"]).model_limits(c)))
    assert str(e.value) == ("speculative_config: method 'draft_model' runs its model on one device; with "
                            "tensor_parallel_size=2 only 'ngram' is supported.")


def test_lora_and_structured_outputs_while_speculating(llama_dir, other_draft, tmp_path):
    """A request with a LoRA adapter is verified by the target with its adapter (the draft
    proposes without one), a guided request's grammar masks every verified row: the tokens are
    those of plain decoding, in one batch with plain requests."""
    from lora_adapters import write_adapter
    adapter = write_adapter(str(tmp_path / "qv"), llama_dir, ["q_proj", "v_proj"], 8, 16, seed=1)
    prompts = _prompts(14, (11, 19, 7))
    guided = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": r"[a-z]{3,6}( [a-z]{3,6}){3}\."})
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    params, loras = [greedy, guided, greedy], ["qv", None, None]
    engine = dict(ENGINE, enable_lora=True, lora_modules={"qv": adapter}, max_lora_rank=8)
    want = [o.outputs[0] for o in LLM(llama_dir, **engine).generate(prompts, params, lora_request=loras)]
    assert want[1].finish_reason == "stop" and want[0].token_ids != _tokens(LLM(llama_dir, **ENGINE), prompts[:1], greedy)[0]
    for draft in (llama_dir, other_draft):
        llm = LLM(llama_dir, speculative_config=_draft(draft), **engine)
        got = [o.outputs[0] for o in llm.generate(prompts, params, lora_request=loras)]
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert got[1].text == want[1].text
        assert llm.engine.get_stats().spec_decode_num_drafts > 0


def test_above_the_speculating_batch_the_draft_only_follows(llama_dir):
    """With more sequences running than speculate (one verification graph's worth on the GPU),
    the draft runs its first pass only, keeping its cache up, and proposes nothing; once few
    enough run, it proposes again, right (the target as its own draft)."""
    prompts = _prompts(16, (8, 12, 9, 14))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 5, 24, 24)]
    want = _tokens(LLM(llama_dir, **ENGINE), prompts, params)
    llm = LLM(llama_dir, speculative_config=_draft(llama_dir), **ENGINE)
    llm.engine.max_speculating_seqs = 2
    drafter, made = llm.engine.executor.worker.drafter, []
    propose = drafter.propose
    drafter.propose = lambda step, *a: made.append((len(step.scheduled), propose(step, *a))) or made[-1][1]
    assert _tokens(llm, prompts, params) == want
    assert all(out == {} for n, out in made if n > 2) and any(n > 2 for n, _ in made)
    assert any(out for n, out in made if n <= 2)
    st = llm.engine.get_stats()
    assert 0 < st.spec_decode_num_accepted_tokens == st.spec_decode_num_draft_tokens
