"""The OpenAI frontend, driven by the official `openai` package, against the real tritonserver:
greedy outputs equal the offline engine's for the templated prompt, token for token."""
import json

import jsonschema
import pytest
from openai import OpenAI

from tritium import LLM, SamplingParams
from triton_server import TEST_ENGINE_ARGS

SYSTEM, USER = "You are brief.", "Explain PagedAttention"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def stack(chat_stack):
    return chat_stack[:3]


@pytest.fixture(scope="module")
def client(stack):
    return OpenAI(api_key="none", base_url=stack[1].url + "/v1", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(stack):
    """The offline engine with the server's engine arguments, and the tokenizer."""
    a = TEST_ENGINE_ARGS
    llm = LLM(stack[2], dtype=a["dtype"], num_kv_blocks=int(a["num_kv_blocks"]),
              block_size=int(a["block_size"]), max_model_len=int(a["max_model_len"]))
    return llm


def chat_ids(llm, messages) -> list[int]:
    """The templated prompt as token ids (the template holds the BOS: none is added)."""
    tok = llm.tokenizer.hf if hasattr(llm.tokenizer, "hf") else llm.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|><|system|>\nYou are brief.<|end_of_text|>\n")
    return tok.encode(text, add_special_tokens=False)


def greedy(llm, prompt, max_tokens=MAX_TOKENS, logprobs=None):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                 logprobs=logprobs))[0]


MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]


def test_models_and_health(stack, client):
    assert [m.id for m in client.models.list().data] == ["llm"]
    import httpx
    r = httpx.get(stack[1].url + "/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok", "models": ["llm"]})


def test_chat_equals_offline_engine_streamed_or_not(client, offline):
    ids = chat_ids(offline, MESSAGES)
    expected = greedy(offline, ids, logprobs=0)
    out = expected.outputs[0]
    assert len(out.token_ids) == MAX_TOKENS

    r = client.chat.completions.create(model="llm", messages=MESSAGES, temperature=0,
                                       max_tokens=MAX_TOKENS, logprobs=True)
    choice = r.choices[0]
    assert choice.message.content == out.text
    assert choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), MAX_TOKENS)
    # One logprob entry per generated token: exactly the engine's tokens and values.
    got = [(c.token, c.logprob) for c in choice.logprobs.content]
    want = [(offline.tokenizer.decode([t]), lp[t].logprob) for t, lp in zip(out.token_ids, out.logprobs)]
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[1] for g in got] == pytest.approx([w[1] for w in want], abs=1e-5)

    text, finish, usage = "", None, None
    for chunk in client.chat.completions.create(model="llm", messages=MESSAGES, temperature=0,
                                                max_completion_tokens=MAX_TOKENS, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert (text, finish) == (out.text, "length")
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
        (len(ids), MAX_TOKENS, len(ids) + MAX_TOKENS)


def test_completions_text_and_token_ids_equal_offline(client, offline):
    prompt = "The capital of France is"
    out = greedy(offline, prompt).outputs[0]
    r = client.completions.create(model="llm", prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
    assert r.choices[0].text == out.text
    assert r.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == MAX_TOKENS

    ids = [5, 77, 300, 12, 499, 64]
    out_ids = greedy(offline, ids).outputs[0]
    stream = client.completions.create(model="llm", prompt=ids, temperature=0, max_tokens=MAX_TOKENS,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == out_ids.text

    # Several prompts: choice i is prompt i's.
    other = greedy(offline, "Hello world").outputs[0]
    r = client.completions.create(model="llm", prompt=[prompt, "Hello world"], temperature=0,
                                  max_tokens=MAX_TOKENS)
    assert [c.text for c in r.choices] == [out.text, other.text]
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 2 * MAX_TOKENS

    # echo: the prompt, then the completion; logprobs cover both (the first token has none).
    r = client.completions.create(model="llm", prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                                  echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt + out.text
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + MAX_TOKENS
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert all(len(t) == 2 for t in lp.top_logprobs[n_prompt:])


def test_n2_stop_and_seed(client, offline):
    r = client.chat.completions.create(model="llm", messages=MESSAGES, n=2, seed=7,
                                       temperature=1.0, max_tokens=MAX_TOKENS)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 2 * MAX_TOKENS
    again = client.chat.completions.create(model="llm", messages=MESSAGES, n=2, seed=7,
                                           temperature=1.0, max_tokens=MAX_TOKENS)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]

    texts = {0: "", 1: ""}
    for chunk in client.completions.create(model="llm", prompt="Hello world", n=2, seed=3,
                                           max_tokens=MAX_TOKENS, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert all(texts.values())

    full = greedy(offline, "Once upon a time", max_tokens=24).outputs[0].text
    stop = full[10:13]
    r = client.completions.create(model="llm", prompt="Once upon a time", temperature=0,
                                  max_tokens=24, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


# The pattern keeps the random model's strings printable: xgrammar's JSON strings admit raw
# control characters, which strict JSON parsers refuse.
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,6}$"},
                                           "unit": {"enum": ["C", "F"]}},
          "required": ["city", "unit"], "additionalProperties": False}


def test_json_schema_response_validates(client):
    r = client.chat.completions.create(
        model="llm", messages=MESSAGES, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=64, temperature=0,
                                       response_format={"type": "json_object"},
                                       extra_body={"structured_outputs": {"disable_any_whitespace": True},
                                                   "stop_token_ids": []})
    assert r.choices[0].message.content.startswith("{")


def test_named_tool_call_arguments_validate(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
             {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model="llm", messages=MESSAGES, max_tokens=64, temperature=0, tools=tools,
              tool_choice=choice, extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    r = client.chat.completions.create(**kw)
    call = r.choices[0].message.tool_calls[0]
    assert (call.type, call.function.name) == ("function", "get_weather")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)

    arguments, names = "", []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                names += [tc.function.name] if tc.function.name else []
                arguments += tc.function.arguments or ""
    assert names == ["get_weather"]
    assert arguments == call.function.arguments


def test_bench_client_through_the_frontend(stack, tmp_path):
    """benchmarks/loadgen/bench.py --openai: every request streams exactly its tokens, counted per
    event."""
    import subprocess
    import sys
    from triton_server import ROOT
    out = tmp_path / "openai.json"
    subprocess.run([sys.executable, "-m", "benchmarks.loadgen.bench", "--openai", stack[1].url + "/v1",
                    "--num-requests", "8", "--input-len", "32", "--output-len", "16", "--procs", "2",
                    "--warmup", "1", "--no-progress", "--json", str(out)], cwd=ROOT, check=True, timeout=120)
    result = json.loads(out.read_text())
    assert result["runner"] == "openai-completions-stream"
    s = result["summary"]
    assert (s["completed"], s["failed"], s["output_tokens"], s["wrong_length_requests"]) == (8, 0, 128, 0)
    assert result["per_request"]["output_tokens"] == [16] * 8
