"""Structured outputs (vLLM's structured_outputs / guided_decoding) with xgrammar: a random
model's output follows the choice, regex, JSON schema or grammar it is given, also sampled, with
n > 1, next to unguided requests that stay as they were; bad specs get clear errors."""
from __future__ import annotations

import json
import re
import sys
import time

import pytest
import torch

from tritium import LLM, SamplingParams
from tritium.layers.sampler import unpack_bitmask
from tritium.engine.structured_output import check_spec

xgr = pytest.importorskip("xgrammar")

CHOICES = ["yes", "no", "maybe so", 'say "hi"']
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}


# A fixed KV cache: on a GPU an engine sized by memory would take 90% of it, and some tests
# start a second engine while the module's is alive.
ENGINE = dict(max_model_len=512, num_kv_blocks=256)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, **ENGINE)


def _texts(llm, prompt, **params) -> list[str]:
    outs = llm.generate([prompt], SamplingParams(**params))[0].outputs
    assert all(c.finish_reason == "stop" for c in outs), [c.finish_reason for c in outs]
    return [c.text for c in outs]


def test_unguided_output_is_none_of_the_forms(llm):
    """What the checks below tell apart: the random model on its own writes none of them."""
    text = llm.generate(["Answer:"], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    assert text not in CHOICES
    assert not re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text)
    with pytest.raises(ValueError):
        json.loads(text)


def test_choice_greedy_and_sampled(llm):
    spec = {"structured_outputs": {"choice": CHOICES}, "max_tokens": 30}
    assert _texts(llm, "Answer:", temperature=0, **spec)[0] in CHOICES
    sampled = _texts(llm, "Answer:", n=6, temperature=1.5, seed=7, **spec)
    assert all(t in CHOICES for t in sampled), sampled
    assert len(set(sampled)) > 1, sampled  # each sample walks its own grammar


def test_greedy_fast_path_masks_as_the_general_path_does(llm):
    """Greedy guided rows without logprobs take the one-pass argmax, masked first; with
    logprobs, the general path: the same tokens, and logprobs of the masked distribution."""
    spec = {"regex": r"[a-z]{3,6}( [a-z]{3,6}){2}"}
    fast = llm.generate(["Words:"], SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec))
    general = llm.generate(["Words:"], SamplingParams(temperature=0, max_tokens=40, logprobs=0,
                                                      structured_outputs=spec))
    assert fast[0].outputs[0].token_ids == general[0].outputs[0].token_ids
    assert re.fullmatch(spec["regex"], fast[0].outputs[0].text)
    # A grammar that leaves one token: all the probability is its own.
    only = llm.generate(["Brace:"], SamplingParams(temperature=0, max_tokens=5, logprobs=0,
                                                   structured_outputs={"grammar": 'root ::= "{"'}))[0].outputs[0]
    assert only.text == "{" and only.finish_reason == "stop"
    assert abs(only.logprobs[0][only.token_ids[0]].logprob) < 1e-6


def test_regex_and_grammar(llm):
    for seed in range(3):
        text = _texts(llm, "Code:", temperature=1.0, seed=seed, max_tokens=30,
                      structured_outputs={"regex": r"[0-9]{3}-[a-z]{2,4}"})[0]
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
        text = _texts(llm, "Shout:", temperature=1.0, seed=seed, max_tokens=30,
                      structured_outputs={"grammar": 'root ::= ("ab" | "c")+ "!"'})[0]
        assert re.fullmatch(r"(ab|c)+!", text), text


def test_json_schema_and_json_object(llm):
    for seed in range(3):
        text = _texts(llm, "JSON:", temperature=0.8, seed=seed, max_tokens=200,
                      structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})[0]
        value = json.loads(text)  # strict: no control characters in strings either
        assert set(value) == {"name", "age", "tags"}, text
        assert re.fullmatch("[a-z]{1,8}", value["name"]) and 0 <= value["age"] <= 150, text
        assert len(value["tags"]) <= 3 and all(isinstance(t, bool) for t in value["tags"]), text
        assert text == json.dumps(value)  # no whitespace beyond the standard separators
    # As a JSON string, the way a server receives it.
    value = json.loads(_texts(llm, "JSON:", temperature=0.8, seed=9, max_tokens=200,
                              structured_outputs={"json": json.dumps(SCHEMA), "disable_any_whitespace": True})[0])
    assert set(value) == {"name", "age", "tags"}
    # Any whitespace (the default): this random model likes tabs, so a short object is asked for.
    assert isinstance(json.loads(_texts(llm, "Any:", temperature=0.8, seed=1, max_tokens=200,
                                        structured_outputs={"json_object": True})[0]), dict)
    assert json.loads(_texts(llm, "One:", temperature=0.8, seed=1, max_tokens=200, structured_outputs={
        "json": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                 "additionalProperties": False}})[0]).keys() == {"a"}


def test_guided_requests_leave_the_others_unchanged(llama_dir):
    """A batch with guided and unguided requests (and a KV cache small enough to preempt): the
    unguided greedy outputs are those of a run without the guided ones."""
    prompts = [list(range(5 + i, 25 + i)) for i in range(4)]
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = LLM(llama_dir, max_model_len=512, num_kv_blocks=14, block_size=8).generate(prompts, plain)
    llm = LLM(llama_dir, max_model_len=512, num_kv_blocks=14, block_size=8)
    guided = SamplingParams(temperature=0.9, seed=3, max_tokens=40,
                            structured_outputs={"regex": r"[a-z]+( [a-z]+)*\."})
    mixed = llm.generate(prompts + prompts[:2], [plain] * 4 + [guided] * 2)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    for o in mixed[4:]:
        c = o.outputs[0]
        assert re.fullmatch(r"[a-z]+( [a-z]+)*\.?", c.text), c.text  # complete, or cut by max_tokens
        assert c.finish_reason == ("stop" if c.text.endswith(".") else "length")
    assert llm.engine.scheduler.num_preemptions > 0


def test_a_token_off_the_grammar_ends_that_request_alone(llama_dir, monkeypatch):
    """Should a sampled token ever break its grammar (here a mask that allows everything), that
    request ends with an error naming the token, and the others in its batch carry on."""
    from tritium import EngineArgs, LLMEngine
    from tritium.engine.structured_output import Grammar
    engine = LLMEngine(EngineArgs(model=llama_dir, **ENGINE))
    prompt = list(range(5, 25))
    first = LLM(llama_dir, **ENGINE).generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    monkeypatch.setattr(Grammar, "fill_bitmask", lambda self, bitmask, row: bitmask[row].fill_(-1))
    engine.add_request("guided", prompt, SamplingParams(temperature=0, max_tokens=8,
                                                        structured_outputs={"choice": ["zz"]}))
    engine.add_request("plain", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    token = first[0].outputs[0].token_ids[0]
    assert outs["guided"][-1].error == (f"structured_outputs: the grammar allows no continuation "
                                        f"(sampled token {token}).")
    assert outs["guided"][-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in outs["plain"]) == 8
    assert outs["plain"][-1].error is None


def test_conflicting_allowed_ids_leave_the_grammar_to_decide(llm):
    """allowed_token_ids that the grammar never allows: the grammar decides alone."""
    text = _texts(llm, "Answer:", temperature=0, max_tokens=30, allowed_token_ids=[2],
                  structured_outputs={"choice": CHOICES})[0]
    assert text in CHOICES


@pytest.mark.parametrize("spec, message", [
    ("json", "structured_outputs must be an object with one of json, regex, choice, grammar, "
             "json_object, got 'json'."),
    ({}, "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; got none."),
    ({"regex": "a", "choice": ["a"]},
     "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; got regex, choice."),
    ({"regex": "a", "whitespace_pattern": " "},
     "structured_outputs: unknown field 'whitespace_pattern'. Valid fields: json, regex, choice, grammar, "
     "json_object, disable_any_whitespace, backend."),
    ({"choice": []}, "structured_outputs: choice must be a non-empty list of non-empty strings, got []."),
    ({"json": "{not json"}, "structured_outputs: json is not a valid JSON schema: Expecting property name "
                            "enclosed in double quotes: line 1 column 2 (char 1)."),
    ({"json_object": "yes"}, "structured_outputs: json_object must be true, got 'yes'."),
    ({"regex": "a", "backend": "outlines"}, "structured_outputs: backend 'outlines' is not available; "
                                            "the engine uses xgrammar ('auto' or 'xgrammar')."),
])
def test_bad_specs(spec, message):
    with pytest.raises(ValueError) as info:
        check_spec(spec)
    assert str(info.value) == message


def test_bad_content_and_combinations(llm):
    with pytest.raises(ValueError) as info:
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "([0-9]"}))
    assert str(info.value) == ("structured_outputs: invalid regex: Regex parsing error at position 7: "
                               "The parenthesis is not closed.")
    with pytest.raises(ValueError, match=r"^structured_outputs: invalid grammar: "):
        llm.generate(["x"], SamplingParams(structured_outputs={"grammar": "root ::= ("}))
    with pytest.raises(ValueError) as info:
        SamplingParams(structured_outputs={"choice": ["a"]}, ignore_eos=True)
    assert str(info.value) == ("structured_outputs cannot be combined with ignore_eos: the output ends "
                               "with EOS where the grammar is complete.")
    with pytest.raises(ValueError, match=r"^structured_outputs cannot be combined with min_tokens"):
        SamplingParams(structured_outputs={"choice": ["a"]}, min_tokens=2)
    # The older name, as servers receive it; not both.
    assert SamplingParams.from_dict({"guided_decoding": '{"choice": ["a"]}'}).structured_outputs == {
        "choice": ["a"], "disable_any_whitespace": False}
    with pytest.raises(ValueError, match=r"^Give structured_outputs or guided_decoding"):
        SamplingParams.from_dict({"guided_decoding": {"choice": ["a"]}, "structured_outputs": {"choice": ["a"]}})


def test_the_vocabulary_is_read_before_the_first_request(llama_dir):
    """At start-up, on a thread of its own, not in the first structured request's step."""
    manager = LLM(llama_dir, **ENGINE).engine.input_processor.structured
    deadline = time.monotonic() + 60
    while not manager.warm and time.monotonic() < deadline:
        time.sleep(0.05)
    assert manager.warm


def test_a_process_exiting_during_the_warm_up_waits_for_it(llama_dir, monkeypatch):
    """The warm-up thread is not a daemon: an engine process shut down while xgrammar builds its
    compiler (CI saw one) must not kill that thread inside C++, which aborts the process."""
    import threading
    from tritium.engine import structured_output
    from tritium.engine.tokenizer import load_tokenizer
    started = []

    class Recorded(threading.Thread):
        def start(self):
            started.append(self)
            super().start()
    monkeypatch.setattr(structured_output.threading, "Thread", Recorded)
    structured_output.StructuredOutputManager(load_tokenizer(llama_dir), 512, (1,), llama_dir).warm_up_in_background()
    assert [t.name for t in started] == ["tritium-grammar-warm-up"] and not started[0].daemon
    started[0].join(60)


def test_without_xgrammar_a_structured_request_is_refused(llama_dir, monkeypatch):
    from tritium.engine.structured_output import StructuredOutputManager
    from tritium.engine.tokenizer import load_tokenizer
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if not installed
    manager = StructuredOutputManager(load_tokenizer(llama_dir), 512, (1,), llama_dir)
    manager.warm_up_in_background()  # quietly does nothing
    with pytest.raises(ValueError) as info:
        manager.compile(check_spec({"choice": ["a"]}))
    assert str(info.value) == "structured_outputs needs the xgrammar package, which is not installed."


def test_unpacked_bitmask_matches_xgrammar():
    vocab = 77  # not a multiple of 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 3), dtype=torch.int32)
    logits = torch.zeros(3, vocab)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    assert torch.equal(unpack_bitmask(bitmask, vocab), logits == 0)


def test_json_object_starts_an_object_only(llm):
    """json_object is any JSON object, not any JSON value (on a GPU the random model once
    opened an array): a fresh grammar allows "{" and no "[", digit or quote."""
    from tritium.engine.structured_output import Grammar
    tok = llm.tokenizer
    manager = llm.engine.input_processor.structured
    grammar = Grammar(manager.compile(check_spec({"json_object": True})))
    words = torch.zeros(1, (512 + 31) // 32, dtype=torch.int32)
    grammar.fill_bitmask(words, 0)
    allowed = unpack_bitmask(words, 512)[0]
    ids = {ch: tok.convert_tokens_to_ids(ch) for ch in ("{", "[", "1", '"')}
    assert allowed[ids["{"]] and not any(allowed[ids[ch]] for ch in ("[", "1", '"')), ids


@pytest.mark.parametrize("temperature", [0, 1e-3])
def test_guided_requests_speculate_and_keep_plain_tokens(llama_dir, temperature):
    """A verification row's mask is its grammar's after the proposals before it (the matcher
    advanced through them and rolled back); a proposal the grammar rejects cannot be sampled,
    so the rows after it are dropped. Regex and JSON-schema requests, proposals right and
    partly wrong (a wrong one mostly off the grammar), greedy and sampled at a temperature of
    1e-3 (rejection sampling): the tokens are plain greedy decoding's."""
    from test_spec_decode import NGRAM, _with_oracle
    specs = [{"regex": r"[a-z]{3,6}( [a-z]{3,6}){4}\."}, {"json": SCHEMA, "disable_any_whitespace": True}]
    prompts = [[1, 17, 42, 99, 7], [1, 23, 5, 88]]
    greedy = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=s) for s in specs]
    want = [o.outputs[0] for o in LLM(llama_dir, **ENGINE).generate(prompts, greedy)]
    assert all(w.finish_reason == "stop" for w in want)
    llm = LLM(llama_dir, speculative_config=NGRAM, **ENGINE)
    _with_oracle(llm.engine, {tuple(p): w.token_ids for p, w in zip(prompts, want)}, wrong_every=3)
    params = [SamplingParams(temperature=temperature, max_tokens=120, structured_outputs=s) for s in specs]
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.text for g in got] == [w.text for w in want]
    st = llm.engine.get_stats()
    assert 10 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens


def test_verification_masks_follow_the_proposals_and_leave_the_matcher_in_place(llm):
    """Grammar.fill_bitmasks: row j's mask is a fresh matcher's after proposals[:j]; past a
    proposal the grammar rejects, rows repeat the mask before it; the matcher is where it was."""
    from tritium.layers.sampler import bitmask_words
    from tritium.engine.structured_output import Grammar
    tok = llm.engine.tokenizer
    ids = {c: tok.encode(c, add_special_tokens=False) for c in "abc"}
    assert all(len(v) == 1 for v in ids.values())
    a, b, c = ids["a"][0], ids["b"][0], ids["c"][0]
    compiled = llm.engine.input_processor.structured.compile({"regex": "a(b|c)b+"})
    words = bitmask_words(llm.engine.executor.vocab_size)

    def mask_after(tokens):
        g = Grammar(compiled)
        for t in tokens:
            assert g.accept(t)
        m = torch.zeros((1, words), dtype=torch.int32)
        g.fill_bitmask(m, 0)
        return m[0]

    g = Grammar(compiled)
    assert g.accept(a)
    got = torch.zeros((5, words), dtype=torch.int32)
    g.fill_bitmasks(got, 1, [c, b, a])  # rows 1-4: after a; a c; a c b; then a is rejected
    assert torch.equal(got[1], mask_after([a])) and torch.equal(got[2], mask_after([a, c]))
    assert torch.equal(got[3], mask_after([a, c, b])) and not torch.equal(got[2], got[3])
    assert torch.equal(got[4], got[3])  # the row after the rejected proposal
    again = torch.zeros((1, words), dtype=torch.int32)
    g.fill_bitmask(again, 0)
    assert torch.equal(again[0], mask_after([a]))  # rolled back to where it was
