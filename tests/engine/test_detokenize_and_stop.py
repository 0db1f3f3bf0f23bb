"""Incremental detokenization (multi-byte characters) and stop strings / stop tokens."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from tritium import LLM, LLMEngine, EngineArgs, SamplingParams
from tritium.engine.tokenizer import IncrementalDetokenizer, detokenize_many, find_stop_string, partial_stop_suffix_len

TEXT = "Café 日本語のテキスト 🚀 naïve ∑ x² — Ελληνικά and 한국어 🧠✨ done."


@pytest.fixture(scope="module")
def tok(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def stream(tok, prompt_ids, ids):
    d = IncrementalDetokenizer(tok, prompt_ids)
    pieces = [d.add_token(t) for t in ids]
    pieces.append(d.flush())
    return pieces


def test_multibyte_characters_split_across_tokens_are_emitted_whole(tok):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    # The byte-level tokenizer really does split some characters over several tokens.
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    pieces = stream(tok, tok("Hello")["input_ids"], ids)
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_pieces_concatenate_to_full_decode_for_random_ids(tok):
    rng = random.Random(3)
    for trial in range(60):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 8))]
        pieces = stream(tok, prompt, ids)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True), (trial, ids)


def test_special_tokens_are_skipped(tok):
    ids = tok("abc", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] + \
        tok(" def", add_special_tokens=False)["input_ids"]
    assert "".join(stream(tok, [tok.bos_token_id], ids)) == "abc def"


def test_stop_string_helpers():
    assert find_stop_string("hello world", 3, ["wor", "lo"]) == (6, "wor")
    assert find_stop_string("hello world", 2, ["lo"]) is None  # ended before the new chars
    assert partial_stop_suffix_len("the end is ne", ["near", "xyz"]) == 2
    assert partial_stop_suffix_len("abc", ["zzz"]) == 0


def _greedy(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **kw))[0].outputs[0]


def test_stop_string_truncates_and_is_never_streamed(llama_dir):
    llm = LLM(llama_dir)
    prompt = [0, 17, 99, 3]
    full = _greedy(llm, prompt)
    text = full.text
    assert len(text) > 12
    stop = text[5:9]  # spans token boundaries in general
    first = text.find(stop)
    out = _greedy(llm, prompt, stop=[stop])
    assert out.text == text[:first] and out.finish_reason == "stop" and out.stop_reason == stop
    out = _greedy(llm, prompt, stop=[stop], include_stop_str_in_output=True)
    assert out.text == text[:first + len(stop)]
    # Streaming: the deltas concatenate to the truncated text, so no partial stop string leaked.
    engine = LLMEngine(EngineArgs(model=llama_dir))
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [d.outputs[0].text for d in engine.step()]
    assert "".join(deltas) == text[:first]


def test_stop_token_ids_and_max_tokens(llama_dir):
    llm = LLM(llama_dir)
    prompt = [0, 5, 6, 7]
    full = _greedy(llm, prompt)
    stop_id = full.token_ids[4]
    cut = full.token_ids.index(stop_id)
    out = _greedy(llm, prompt, stop_token_ids=[stop_id])
    assert out.token_ids == full.token_ids[:cut + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == full.token_ids[:3] and out.finish_reason == "length"


def test_eos_stops_unless_ignored_or_below_min_tokens(llama_dir):
    llm = LLM(llama_dir)
    prompt = [0, 5, 6, 7]
    full = _greedy(llm, prompt)
    eos = full.token_ids[2]
    llm.engine.eos_token_ids = (eos,)  # pretend the model's EOS is its third greedy token
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert out.token_ids == full.token_ids[:full.token_ids.index(eos) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert _greedy(llm, prompt).token_ids == full.token_ids  # ignore_eos
    # min_tokens masks the EOS logit, so the first 5 tokens can never be the EOS.
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, min_tokens=5))[0].outputs[0]
    assert len(out.token_ids) >= 5 and eos not in out.token_ids[:5]


def test_tokenizer_falls_back_to_tokenizer_json_when_autotokenizer_cannot_import(llama_dir, monkeypatch):
    import builtins

    from tritium.engine.tokenizer import load_tokenizer
    real_import = builtins.__import__

    def failing_import(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "transformers" and fromlist and "AutoTokenizer" in fromlist:
            raise ImportError("Could not import module 'AutoTokenizer' (simulated)")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", failing_import)
    tok = load_tokenizer(llama_dir)
    monkeypatch.undo()
    ref = AutoTokenizer.from_pretrained(llama_dir)
    assert tok(TEXT)["input_ids"] == ref(TEXT)["input_ids"]
    assert tok.eos_token_id == ref.eos_token_id and tok.bos_token_id == ref.bos_token_id


def test_invisible_tokens_do_not_grow_the_window(tok):
    """Skipped special tokens and ids beyond the tokenizer's vocabulary (a model whose vocabulary
    is larger than its tokenizer's) show nothing; the window must not keep them, or each decode
    gets longer with every such token. The text is still the full decode."""
    rng = random.Random(5)
    visible = tok("abc déf 日本", add_special_tokens=False)["input_ids"]
    ids = []
    for t in visible:
        ids += [t] + [rng.choice([tok.eos_token_id, len(tok) + rng.randrange(1000)])
                      for _ in range(rng.randint(0, 300))]
    d = IncrementalDetokenizer(tok, [tok.bos_token_id])
    pieces, longest = [], 0
    for t in ids:
        pieces.append(d.add_token(t))
        longest = max(longest, len(d._ids))
    pieces.append(d.flush())
    known = [t for t in ids if t < len(tok)]
    assert "".join(pieces) == tok.decode(known, skip_special_tokens=True) == "abc déf 日本"
    assert longest <= 8, longest


def test_detokenize_many_with_several_tokens_joins_to_add_tokens_text(tok):
    """Several new tokens of a stream at once (a run the engine process folded): each stream's
    pieces, joined and flushed at the end, are add_token's, whatever the runs' lengths,
    multi-byte characters split over tokens and special or out-of-vocabulary ids included
    (what an incomplete character holds back may come out one call later or earlier)."""
    rng = random.Random(5)
    text_ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    streams = [[rng.choice([t, t, tok.eos_token_id, len(tok) + 3]) for t in text_ids] for _ in range(6)]
    streams += [[rng.randrange(len(tok)) for _ in range(40)] for _ in range(6)]
    want = []
    for ids in streams:
        d = IncrementalDetokenizer(tok, [5, 6])
        want.append("".join(d.add_token(t) for t in ids) + d.flush())
    dets = [IncrementalDetokenizer(tok, [5, 6]) for _ in streams]
    got, pos = ["" for _ in streams], [0 for _ in streams]
    while any(p < len(ids) for p, ids in zip(pos, streams)):
        live = [i for i, ids in enumerate(streams) if pos[i] < len(ids)]
        runs = []
        for i in live:
            n = rng.randint(1, 5)
            runs.append(streams[i][pos[i]:pos[i] + n])
            pos[i] += n
        for i, piece in zip(live, detokenize_many([(dets[i], run) for i, run in zip(live, runs)])):
            got[i] += piece
    assert [text + d.flush() for text, d in zip(got, dets)] == want


def test_detokenize_many_equals_add_token_one_by_one(tok):
    """The batched form (one Rust decode_batch per step for every stream) gives each stream the
    same pieces as add_token: random ids, multi-byte characters split over tokens, skipped
    special tokens and ids beyond the vocabulary, streams of different lengths and settings."""
    rng = random.Random(11)
    text_ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    streams = []
    for s in range(24):
        kind = s % 3
        if kind == 0:
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 50))]
        elif kind == 1:
            ids = list(text_ids)
        else:
            ids = [rng.choice([t, tok.eos_token_id, len(tok) + 7]) for t in text_ids]
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 8))]
        streams.append((prompt, ids, s % 4 != 0))  # some keep special tokens
    one_by_one = []
    for prompt, ids, skip in streams:
        d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        one_by_one.append([d.add_token(t) for t in ids])
    dets = [IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip) for prompt, _, skip in streams]
    batched = [[] for _ in streams]
    for step in range(max(len(ids) for _, ids, _ in streams)):
        live = [i for i, (_, ids, _) in enumerate(streams) if step < len(ids)]
        pieces = detokenize_many([(dets[i], [streams[i][1][step]]) for i in live])
        for i, piece in zip(live, pieces):
            batched[i].append(piece)
    assert batched == one_by_one
    assert any("\ufffd" in tok.decode([t]) for t in text_ids)  # the held-back case is exercised
