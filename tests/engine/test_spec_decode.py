"""Speculative decoding by n-gram lookup (backend/spec_decode/ngram.py): the proposer, the config, and
the engine's verification: whatever is proposed, the tokens are exactly plain greedy decoding's
(checked against Hugging Face), and proposals are accepted up to the first wrong one."""
from __future__ import annotations

import pytest
import torch

from tritium import LLM, EngineArgs, LLMEngine, SamplingParams
from tritium.engine_config import SpeculativeConfig
from tritium.spec_decode.ngram import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def proposer(k=3, hi=3, lo=1) -> NgramProposer:
    return NgramProposer(SpeculativeConfig.from_dict(
        {"num_speculative_tokens": k, "prompt_lookup_max": hi, "prompt_lookup_min": lo}))


def test_the_proposer_takes_the_longest_suffix_that_occurred_and_its_latest_occurrence():
    p = proposer(k=3, hi=3, lo=1)
    # "7 8" occurred twice, followed by 1 2 3 and later by 4 5 6: the latest wins
    assert p.propose([7, 8, 1, 2, 3, 9, 7, 8, 4, 5, 6, 0, 7, 8], 10) == [4, 5, 6]
    # "5 7 8" occurred (followed by 9) while "7 8" alone also occurred later: the longer suffix wins
    assert p.propose([5, 7, 8, 9, 1, 7, 8, 2, 5, 7, 8], 10) == [9, 1, 7]
    assert p.propose([5, 7, 8, 9, 1, 7, 8, 2, 5, 7, 8], 2) == [9, 1]  # what the limits leave
    assert p.propose([5, 7, 8, 9, 1, 7, 8, 2, 5, 7, 8], 0) == []
    assert p.propose([1, 2, 3, 4], 5) == []  # nothing repeats
    assert p.propose([4, 4, 4], 5) == [4]  # overlapping occurrence; only one token followed
    assert p.propose([1, 2, 9, 1, 2], 5) == [9, 1, 2]  # up to the end of the sequence
    assert proposer(k=3, hi=3, lo=2).propose([1, 2, 9, 3, 2], 5) == []  # one matching token is too few


def _brute_force(ids: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(ids) - 1), lo - 1, -1):
        starts = [s for s in range(len(ids) - n) if ids[s:s + n] == ids[len(ids) - n:]]
        if starts:
            return ids[starts[-1] + n:starts[-1] + n + k]
    return []


@pytest.mark.parametrize("max_candidates", [0, 2, 10**9])
@pytest.mark.parametrize("lo, hi", [(1, 1), (1, 4), (2, 3), (3, 6)])
def test_the_proposer_with_kept_histories_equals_a_brute_force_search(lo, hi, max_candidates, monkeypatch):
    """Sequences over a 3-token vocabulary (long repeated runs, overlapping occurrences) grown a
    few tokens at a time under one key each (occurrences extended one by one, the vectorised pass
    after the first two that do not match the longest suffix, or the vectorised pass at once), and
    looked up from scratch (no key): every proposal is the brute-force search's."""
    from tritium.spec_decode.ngram import _History
    monkeypatch.setattr(_History, "MAX_CANDIDATES", max_candidates)
    p = proposer(k=4, hi=hi, lo=lo)
    rng = torch.Generator().manual_seed(lo * 10 + hi)
    seqs = {key: [] for key in range(6)}
    checked = 0
    for _ in range(60):
        for key, ids in seqs.items():
            ids += torch.randint(0, 3 + key, (int(torch.randint(1, 4, (1,), generator=rng)),),
                                 generator=rng).tolist()
            want = _brute_force(ids, 4, lo, hi) if len(ids) >= lo + 1 else []
            assert p.propose(ids, 9, key) == want, (key, ids)
            assert p.propose(ids, 9) == want
            assert p.propose(ids, 2, key) == want[:2]
            checked += bool(want)
    assert checked > 100  # of 360 lookups, enough that found occurrences are checked too
    # A key whose tokens are not an extension of what it held starts over; retain forgets others.
    fresh = [1, 0, 2, 2, 1, 0, 2]  # n-grams the old history holds too, at other positions
    assert p.propose(fresh, 9, key=0) == _brute_force(fresh, 4, lo, hi) != []
    p.retain({0})
    assert set(p._histories) == {0}


def test_each_proposer_provides_what_its_protocol_names():
    """backend/spec_decode/proposer.py: n-gram lookup is a TokenProposer; the draft model and
    EAGLE heads are ModelProposers, their `propose` taking the protocol's arguments."""
    import inspect

    from tritium.spec_decode.draft_model import DraftModelProposer
    from tritium.spec_decode.eagle import EagleProposer
    from tritium.spec_decode.proposer import ModelProposer, TokenProposer
    for cls, protocol in ((NgramProposer, TokenProposer), (DraftModelProposer, ModelProposer),
                          (EagleProposer, ModelProposer)):
        members = {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)
        assert members >= {"propose"}, protocol
        assert [n for n in sorted(members) if not hasattr(cls, n)] == [], cls
        assert list(inspect.signature(cls.propose).parameters) == list(
            inspect.signature(protocol.propose).parameters), cls


def test_a_run_keeps_its_proposals_up_to_the_first_wrong_one_and_counts_them():
    """verification.num_accepted (the engine's and the worker's rule) and metrics.record_verification."""
    from types import SimpleNamespace

    from tritium.engine.metrics import EngineStats
    from tritium.spec_decode.metrics import record_verification
    from tritium.spec_decode.verification import num_accepted
    rows = [SimpleNamespace(token_id=t) for t in (5, 6, 9, 8)]  # row j: the token after proposal j - 1
    assert [num_accepted(rows, proposed) for proposed in ([5, 6, 7], [5, 6, 9], [4, 6, 9], [], [5])] == [2, 3, 0, 0, 1]
    stats = EngineStats()
    record_verification(stats, 3, 2)
    record_verification(stats, 4, 0)
    record_verification(stats, 2, 1)
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_accepted_tokens_per_pos) == (3, 9, 3, [2, 1, 0, 0])


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 3},
     "speculative_config: method 'eagle' needs 'model', the directory of the EAGLE heads."),
    ({"method": "ngram"}, "speculative_config: num_speculative_tokens must be an integer in [1, 16], got None."),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "speculative_config: prompt_lookup_min (4) must not exceed prompt_lookup_max (2)."),
    ({"num_speculative_tokens": 2, "draft_model": "x"},
     "speculative_config: unknown keys ['draft_model']; valid keys: method, num_speculative_tokens, "
     "prompt_lookup_max, prompt_lookup_min, model, quantization, dtype."),
])
def test_bad_configs_are_refused(llama_dir, config, message):
    with pytest.raises(ValueError) as e:
        EngineArgs(model=llama_dir, speculative_config=config)
    assert str(e.value) == message


def test_config_from_a_model_config_string(llama_dir):
    args = EngineArgs.from_strings({"model": llama_dir, "speculative_config": '{"num_speculative_tokens": 4}'})
    assert SpeculativeConfig.from_dict(args.speculative_config) == SpeculativeConfig(4, 5, 5, "ngram", None, None, None, None)


def _plain(llama_dir, prompts, params):
    return [o.outputs[0] for o in LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=512)
            .generate(prompts, params)]


def _with_oracle(engine: LLMEngine, truth: dict[tuple[int, ...], list[int]], wrong_every: int):
    """Proposals from the known greedy continuation of each prompt, every `wrong_every`-th one
    with its second token wrong, so that verification accepts all, some or none."""
    calls = {"n": 0}

    def propose(token_ids, max_tokens, key=None):
        for prompt, out in sorted(truth.items(), key=lambda item: -len(item[0])):  # longest first
            if tuple(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                guess = out[done:done + min(3, max_tokens)]
                calls["n"] += 1
                if guess and calls["n"] % wrong_every == 0 and len(guess) > 1:
                    guess = [guess[0], (guess[1] + 1) % 500] + guess[2:]
                return list(guess)
        raise AssertionError("a sequence of no known prompt")
    engine.proposer.propose = propose


def test_verified_tokens_equal_plain_greedy_and_hugging_face(llama_dir):
    from hf_reference import hf_greedy_generate
    from transformers import AutoModelForCausalLM
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (9, 24, 15)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    penalized = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3)
    params = [greedy, greedy, penalized]
    want = [o.token_ids for o in _plain(llama_dir, prompts, params)]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32)
    assert want[:2] == hf_greedy_generate(hf, prompts[:2], 20)
    llm = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=512, speculative_config=NGRAM)
    _with_oracle(llm.engine, {tuple(p): w for p, w in zip(prompts, want)}, wrong_every=3)
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in got] == want
    assert all(o.finish_reason == "length" for o in got)
    st = llm.engine.get_stats()
    # Each greedy request: proposals of 3 from its 2nd token on; a wrong one accepts 1 of 3, a
    # right one all 3 (+1 token of its own): 19 tokens after the first take a few steps each.
    assert st.spec_decode_num_drafts > 0
    assert st.spec_decode_num_accepted_tokens > st.spec_decode_num_draft_tokens // 2
    assert st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens  # some were wrong
    assert st.generation_tokens == 60


def test_stops_inside_an_accepted_run_and_length_limits(llama_dir):
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, 500, (12,), generator=gen).tolist()
    free = _plain(llama_dir, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].token_ids
    stop_at = free[7]  # a stop token met mid-run: later accepted tokens must go
    first = free.index(stop_at)
    cases = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_at]),
             SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)]  # not a multiple of 4
    for params in cases:
        want = _plain(llama_dir, [prompt], params)[0]
        llm = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=512, speculative_config=NGRAM)
        _with_oracle(llm.engine, {tuple(prompt): free}, wrong_every=10**9)  # always right
        got = llm.generate([prompt], params)[0].outputs[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert len(want.token_ids) == 11
    assert _plain(llama_dir, [prompt], cases[0])[0].token_ids == free[:first + 1]


def test_ngram_speculation_through_preemption_equals_plain_decoding(llama_dir):
    """The real proposer on prompts that repeat themselves, in a cache so small that sequences
    are preempted and recomputed (proposals dropped before anyone is preempted for them)."""
    gen = torch.Generator().manual_seed(5)
    base = [torch.randint(3, 500, (10,), generator=gen).tolist() for _ in range(4)]
    prompts = [b * 3 for b in base]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in _plain(llama_dir, prompts, params)]
    tight = LLM(llama_dir, device="cpu", dtype="float32", block_size=16, num_kv_blocks=12,
                max_num_batched_tokens=64, speculative_config=NGRAM)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert got == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.get_stats().spec_decode_num_drafts > 0
    # The proposer keeps the histories of running sequences only: none once all have finished.
    assert tight.engine.proposer._histories == {}


def test_verification_steps_of_a_few_sequences_run_through_the_prefill_graphs(llama_dir):
    """On the GPU a verification step of at most SPEC_GRAPH_MAX_SEQS sequences replays a
    verification graph (its decodes as one-token chunks; chunks of at most k + 1 tokens) that
    returns every verified row; here its padded buffers (32 sequence slots, 3 used) run eagerly.
    Tokens equal plain decoding's; steps without proposals stay decodes."""
    from tritium.worker.cuda_graph import SPEC_GRAPH_MAX_SEQS, PrefillGraphs
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (11, 26, 7)]
    params = SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)
    want = [o.token_ids for o in _plain(llama_dir, prompts, params)]
    llm = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=512, speculative_config=NGRAM)
    graphs = PrefillGraphs(llm.engine.executor.worker.model, 64, 512, torch.device("cpu"), capture=False,
                           rows_per_seq=NGRAM["num_speculative_tokens"] + 1, max_seqs=SPEC_GRAPH_MAX_SEQS,
                           max_chunk=NGRAM["num_speculative_tokens"] + 1)
    assert graphs.max_rows == SPEC_GRAPH_MAX_SEQS * 4 == 128
    calls = []
    run = graphs.run
    graphs.run = lambda batch, rows=None: calls.append((batch.num_decodes, rows)) or run(batch, rows)
    llm.engine.executor.runner.verify_graphs = graphs
    # Every third request's proposals wrong from the second token on, and none for the 7-token
    # prompt's request (a decode, as a one-token chunk, beside the others' verifications).
    _with_oracle(llm.engine, {tuple(p): w for p, w in zip(prompts[:2], want[:2])}, wrong_every=3)
    oracle = llm.engine.proposer.propose
    llm.engine.proposer.propose = lambda ids, n, key=None: [] if ids[:7] == prompts[2] else oracle(ids, n)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    verified = [rows for decodes, rows in calls if rows is not None]
    assert verified and all(d == 0 for d, _ in calls)
    assert any(len(rows) > 3 for rows in verified)  # several rows of one sequence


def test_a_batch_larger_than_a_verification_graph_decodes_plainly_and_pipelined(llama_dir):
    """Above max_speculating_seqs running sequences (8 on the GPU: one prefill graph) nothing is
    proposed and steps overlap as without speculation; once fewer run, they speculate."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (8,), generator=gen).tolist() * 3 for _ in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 6, 30, 30)]
    want = [o.token_ids for o in _plain(llama_dir, prompts, params)]
    llm = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=512, speculative_config=NGRAM)
    engine = llm.engine
    engine.max_speculating_seqs = 2
    proposed_with, propose = [], engine.proposer.propose
    engine.proposer.propose = lambda ids, n, key=None: proposed_with.append(len(engine.scheduler.running)) or propose(ids, n, key)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert proposed_with and max(proposed_with) == 2


def test_requests_arriving_mid_speculation_stop_it_without_losing_a_token(llama_dir):
    """A step verified proposals; the next one, with more sequences than max_speculating_seqs,
    must take it first (its token count is known only then) before decoding pipelined."""
    from tritium.engine.request import accumulate
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 500, (6,), generator=gen).tolist() * 3 for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in _plain(llama_dir, prompts, params)]
    engine = LLMEngine(EngineArgs(model=llama_dir, device="cpu", dtype="float32", num_kv_blocks=512,
                                  speculative_config=NGRAM))
    engine.max_speculating_seqs = 1
    _with_oracle(engine, {tuple(p): w for p, w in zip(prompts, want)}, wrong_every=10**9)
    engine.add_request("r0", prompts[0], params)
    got: dict = {}
    for step in range(100):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            got[out.request_id] = accumulate(got.get(out.request_id), out)
        if step == 3:  # r0 has verified proposals by now
            assert engine.get_stats().spec_decode_num_accepted_tokens > 0
            engine.add_request("r1", prompts[1], params)
            engine.add_request("r2", prompts[2], params)
    assert [got[f"r{i}"].outputs[0].token_ids for i in range(3)] == want


def test_logprobs_of_verified_tokens_equal_plain_decodings(llama_dir):
    """Each accepted token's logprob, rank and top alternatives come from the logits at its own
    position in the verification step."""
    gen = torch.Generator().manual_seed(14)
    prompt = torch.randint(3, 500, (10,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    want = _plain(llama_dir, [prompt], params)[0]
    llm = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=512, speculative_config=NGRAM)
    _with_oracle(llm.engine, {tuple(prompt): want.token_ids}, wrong_every=3)
    got = llm.generate([prompt], params)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 4
    assert len(got.logprobs) == len(want.logprobs) == 16
    for mine, theirs in zip(got.logprobs, want.logprobs):
        assert sorted(mine) == sorted(theirs)  # the same token ids: the sampled one and the top 2
        for t in mine:
            assert mine[t].rank == theirs[t].rank
            assert mine[t].logprob == pytest.approx(theirs[t].logprob, abs=1e-5)
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("draft", [0, 5, 11])
def test_rejection_sampling_of_a_proposal_keeps_the_distribution(draft):
    """A sampled row verifying proposal d emits d with probability p(d), else a draw from p
    without d: each token's frequency over 40,000 rows is its probability, whether d is the
    likeliest token, a middling one or the least likely."""
    from types import SimpleNamespace

    from tritium.layers.sampler import Sampler
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, generator=g) * 1.5
    p = torch.softmax(logits[0], -1)
    order = p.argsort(descending=True).tolist()
    d = {0: order[0], 5: order[5], 11: order[11]}[draft]
    n = 40_000
    rows = [SimpleNamespace(params=SamplingParams(temperature=1.0), token_ids=[1, 2, 3], num_prompt_tokens=3,
                            index=0, generator=None, grammar=None)] * n
    md = Sampler.prepare(rows, 12, torch.device("cpu"), drafts=[d] * n)
    assert md.drafts is not None
    tokens = Sampler()(logits.expand(n, -1).clone(), rows, md).token_ids
    freq = torch.bincount(tokens, minlength=12).double() / n
    assert (freq - p.double()).abs().max() < 0.012, (freq, p)


def test_sampled_requests_speculate_by_rejection_sampling(llama_dir, monkeypatch):
    """At a temperature low enough that sampling is all but greedy (but not the greedy path),
    proposals of the greedy continuation are verified by rejection sampling and the tokens are
    the greedy ones."""
    from tritium.spec_decode import verification
    gen = torch.Generator().manual_seed(16)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (12, 9)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in _plain(llama_dir, prompts, greedy)]
    cold = SamplingParams(temperature=1e-3, max_tokens=16, ignore_eos=True)
    llm = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=512, speculative_config=NGRAM)
    _with_oracle(llm.engine, {tuple(p): w for p, w in zip(prompts, want)}, wrong_every=3)
    verified = []
    real = verification.verify_drafts
    monkeypatch.setattr(verification, "verify_drafts",
                        lambda probs, *a: verified.append(probs.shape[0]) or real(probs, *a))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, cold)]
    assert got == want
    assert verified and llm.engine.get_stats().spec_decode_num_accepted_tokens > 4


def test_seeded_requests_speculate_and_draw_the_tokens_they_draw_without(llama_dir):
    """A seeded row's draw for a token is keyed by (seed, sample index, token position), so a
    verification row draws what plain decoding draws at that position, and keeps a proposal it
    equals: with proposals right and partly wrong, seeded requests at temperature 1 (two
    samples each, n=2) give exactly the tokens they give without speculation."""
    gen = torch.Generator().manual_seed(19)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (12, 9)]
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=s, n=2, max_tokens=20, ignore_eos=True)
              for s in (11, 12)]
    plain = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=512).generate(prompts, params)
    want = [[c.token_ids for c in o.outputs] for o in plain]
    assert want[0][0] != want[0][1]  # the samples differ (a real draw, not greedy)
    llm = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=512, speculative_config=NGRAM)
    # Proposals: the first sample's continuation (so the second sample's are mostly wrong).
    _with_oracle(llm.engine, {tuple(p): w[0] for p, w in zip(prompts, want)}, wrong_every=3)
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    assert got == want
    st = llm.engine.get_stats()
    assert 8 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens


def test_position_independent_logits_adjustments_speculate_and_keep_plain_tokens(llama_dir):
    """logit_bias and allowed_token_ids change every position alike: their requests speculate,
    each verification row adjusted as plain decoding's would be, and the tokens equal plain
    decoding's with the same parameters (which the adjustments change)."""
    gen = torch.Generator().manual_seed(23)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (10, 13)]
    free = [o.token_ids for o in _plain(llama_dir, prompts, SamplingParams(temperature=0, max_tokens=16,
                                                                          ignore_eos=True))]
    biased = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                            logit_bias={free[0][3]: -100.0, 7: 0.5})
    allowed = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                             allowed_token_ids=sorted(set(free[1][::2]) | {3, 4, 5}))
    params = [biased, allowed]
    want = [o.token_ids for o in _plain(llama_dir, prompts, params)]
    assert want[0] != free[0] and want[1] != free[1]  # the adjustments matter
    llm = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=512, speculative_config=NGRAM)
    _with_oracle(llm.engine, {tuple(p): w for p, w in zip(prompts, want)}, wrong_every=3)
    asked = []  # for each proposal asked for: which request's
    propose = llm.engine.proposer.propose
    llm.engine.proposer.propose = lambda ids, n, key=None: asked.append(int(ids[:13] == prompts[1])) or propose(ids, n)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert asked.count(0) > 2 and asked.count(1) > 2  # both requests speculated
    st = llm.engine.get_stats()
    assert 8 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens  # some were wrong


@pytest.mark.parametrize("wrong_every", [3, pytest.param(10**9, marks=pytest.mark.long)])  # every proposal right: make test-long
def test_bad_words_of_several_tokens_speculate_matched_against_the_proposals(llama_dir, wrong_every):
    """Two-token bad words taken from the free output, at several positions (so the word's
    first token is the last known token, a proposal in the middle of a run, or the last one):
    a verification row whose context (the proposals before it) ends with the first token bans
    the second, and no other row does, so the tokens equal plain decoding's with the ban
    (which changes the output)."""
    engine = LLMEngine(EngineArgs(model=llama_dir, device="cpu", dtype="float32", num_kv_blocks=512))
    tok = engine.tokenizer
    gen = torch.Generator().manual_seed(27)
    prompt = torch.randint(3, 500, (11,), generator=gen).tolist()
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    free = _plain(llama_dir, [prompt], SamplingParams(**greedy))[0].token_ids
    pairs = [free[i:i + 2] for i in range(2, len(free) - 1)
             if tok.encode(tok.decode(free[i:i + 2]).lstrip(), add_special_tokens=False) == free[i:i + 2]]
    assert len(pairs) >= 3
    for pair in pairs[:6]:
        params = SamplingParams(bad_words=[tok.decode(pair)], **greedy)
        want = _plain(llama_dir, [prompt], params)[0].token_ids
        assert want != free and all(want[i:i + 2] != pair for i in range(len(want) - 1))
        llm = LLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=512, speculative_config=NGRAM)
        _with_oracle(llm.engine, {tuple(prompt): want}, wrong_every=wrong_every)
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == want, pair
        assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 8
