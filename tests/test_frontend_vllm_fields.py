"""vLLM's extra request and response fields of the OpenAI frontend: stop_reason, prompt_logprobs,
return_tokens_as_token_ids, chat echo, reasoning's two names, and the fields it refuses. The
pure parts in-process; then the shared chat_stack server, with exact values."""
import json
import os
import re
import struct

import httpx
import pytest
from tritonclient.grpc import service_pb2

from tritium.frontend.chat import echo_prefix, template_kwargs
from tritium.frontend.chat_output import ChoiceOutput, delta_dict
from tritium.frontend.errors import OpenAIError
from tritium.frontend.logprobs import CompletionLogprobs, chat_logprobs
from tritium.frontend.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from tritium.frontend.reasoning import ReasoningParser
from tritium.frontend.refused_fields import CHAT_REFUSED, COMPLETION_REFUSED
from tritium.frontend.sampling import chat_sampling, completion_sampling
from tritium.frontend.triton_gateway import parse_chunk
from triton_server import ROOT

MSG = [{"role": "user", "content": "Hi"}]


def chat_req(**fields):
    return parse_body(ChatCompletionRequest, {"model": "m", "messages": MSG, **fields})


def completion_req(**fields):
    return parse_body(CompletionRequest, {"model": "m", "prompt": "p", **fields})


def refusal(make, **fields) -> tuple[str, str | None]:
    with pytest.raises(OpenAIError) as e:
        make(**fields)
    return e.value.message, e.value.param


# --- refused fields -------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CHAT_REFUSED))
def test_every_refused_chat_field_is_a_400_naming_it(name):
    assert refusal(chat_req, **{name: "x"}) == (f"{name} is not supported by this server", name)


@pytest.mark.parametrize("name", sorted(COMPLETION_REFUSED))
def test_every_refused_completion_field_is_a_400_naming_it(name):
    assert refusal(completion_req, **{name: "x"}) == (f"{name} is not supported by this server", name)


def test_refused_fields_pass_with_their_no_op_values_only():
    chat_req(use_beam_search=False, length_penalty=1, stream_interval=1, thinking_token_budget=-1,
             return_mm_kwargs=True, vllm_xargs={}, session_id=None)
    assert refusal(chat_req, use_beam_search=True)[1] == "use_beam_search"
    assert refusal(chat_req, use_beam_search=0)[1] == "use_beam_search"  # JSON 0 is not false
    assert refusal(chat_req, stream_interval=4)[1] == "stream_interval"
    assert refusal(completion_req, prompt_embeds=["AAAA"])[1] == "prompt_embeds"
    # A chat-only field is not one of completions' (unknown there), and the other way round.
    completion_req(chat_template="{{ x }}")
    chat_req(suffix="not a chat field")


def test_the_docs_list_exactly_the_refused_fields():
    with open(os.path.join(ROOT, "docs", "openai-frontend.md"), encoding="utf-8") as f:
        rows = re.findall(r"^\| `(\w+)` \| (.+?) \| (both|chat|completions) \|$", f.read(), re.M)
    expected = []
    for name in dict.fromkeys([*CHAT_REFUSED, *COMPLETION_REFUSED]):
        where = ("both" if name in CHAT_REFUSED and name in COMPLETION_REFUSED
                 else "chat" if name in CHAT_REFUSED else "completions")
        no_op = CHAT_REFUSED.get(name, COMPLETION_REFUSED.get(name))
        expected.append((name, ", ".join(json.dumps(v) for v in no_op), where))
    assert rows == expected


# --- sampling parameters --------------------------------------------------------------------

def test_prompt_logprobs_and_what_asks_for_them():
    assert chat_sampling(chat_req(prompt_logprobs=2))["prompt_logprobs"] == 2
    assert completion_sampling(completion_req(prompt_logprobs=0))["prompt_logprobs"] == 0
    for make in (lambda **f: chat_sampling(chat_req(**f)), lambda **f: completion_sampling(completion_req(**f))):
        assert refusal(make, prompt_logprobs=0, stream=True) == (
            "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    # vLLM's: echo asks for them, with chat's top_logprobs (0 by default) or completions' logprobs.
    assert chat_sampling(chat_req(echo=True))["prompt_logprobs"] == 0
    assert chat_sampling(chat_req(echo=True, logprobs=True, top_logprobs=3))["prompt_logprobs"] == 3
    assert "prompt_logprobs" not in chat_sampling(chat_req(echo=True, stream=True))
    assert completion_sampling(completion_req(echo=True, logprobs=2))["prompt_logprobs"] == 2
    assert completion_sampling(completion_req(echo=True, logprobs=2, prompt_logprobs=5))["prompt_logprobs"] == 5
    assert "prompt_logprobs" not in completion_sampling(completion_req(echo=True))


def test_other_vllm_sampling_fields():
    assert chat_sampling(chat_req(best_of=1))["n"] == 1
    assert refusal(chat_sampling, req=chat_req(best_of=3))[1] == "best_of"
    assert "truncation_side" not in completion_sampling(completion_req(truncation_side="left"))
    assert refusal(completion_sampling, req=completion_req(truncation_side="right")) == (
        "truncation_side 'right' is not supported by this server: truncate_prompt_tokens keeps the "
        "prompt's last tokens", "truncation_side")
    assert chat_sampling(chat_req(guided_regex="a+", guided_decoding_backend="xgrammar"))[
        "structured_outputs"] == {"regex": "a+", "backend": "xgrammar"}
    assert "structured_outputs" not in chat_sampling(chat_req(guided_decoding_backend="auto"))
    assert refusal(chat_sampling, req=chat_req(guided_decoding_backend="outlines")) == (
        "guided_decoding_backend 'outlines' is not available: the engine uses xgrammar ('auto' or "
        "'xgrammar')", "guided_decoding_backend")
    assert completion_sampling(completion_req(response_format={"type": "json_object"}))[
        "structured_outputs"] == {"json_object": True}
    assert refusal(completion_sampling, req=completion_req(response_format={"type": "json_object"},
                                                           guided_regex="a"))[1] == "response_format"


def test_chat_template_gets_documents_and_reasoning_effort():
    docs = [{"title": "t", "text": "x"}]
    assert template_kwargs(chat_req(documents=docs, reasoning_effort="none")) == {
        "documents": docs, "reasoning_effort": "none", "enable_thinking": False}
    assert template_kwargs(chat_req(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})) == {
        "enable_thinking": False, "reasoning_effort": "high"}
    assert template_kwargs(chat_req()) == {}


# --- echo, reasoning, logprobs, stop_reason (output building) ----------------------------------

def test_chat_echo_prefix_follows_vllms_role_rule():
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}]
    assert echo_prefix(chat_req()) is None
    assert echo_prefix(chat_req(echo=True)) == ""  # the reply is the assistant's, the last is the user's
    assert echo_prefix(chat_req(echo=True, messages=history)) == "Once upon"
    assert echo_prefix(chat_req(echo=True, add_generation_prompt=False)) == "Hi"  # role: the last's
    assert echo_prefix(chat_req(echo=True, continue_final_message=True, messages=history[:1] + [
        {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])) == "a\nb"


def test_reasoning_under_both_names_or_dropped():
    shown = ChoiceOutput(ReasoningParser(thinking=True), None)
    delta = shown.feed("plan</think>answer")
    assert delta_dict(delta) == {"reasoning": "plan", "reasoning_content": "plan", "content": "answer"}
    shown.finish()
    assert shown.as_message() == {"role": "assistant", "content": "answer", "reasoning": "plan",
                                  "reasoning_content": "plan"}
    hidden = ChoiceOutput(ReasoningParser(thinking=True), None, include_reasoning=False)
    assert delta_dict(hidden.feed("plan</think>answer")) == {"content": "answer"}
    hidden.finish()
    assert hidden.as_message() == {"role": "assistant", "content": "answer", "reasoning": None,
                                   "reasoning_content": None}


def entry(*tokens):
    return {str(t): {"logprob": lp, "rank": r, "decoded_token": s} for t, lp, r, s in tokens}


def test_tokens_as_token_ids_as_vllm_writes_them():
    # k=1: the first sampled token (7) is outside the top one, so the engine appends it.
    entries = [entry((5, -0.05, 1, "x"), (7, -0.1, 2, "é")), entry((9, -0.5, 1, "bc"))]
    assert chat_logprobs(entries, 1, "ébc", as_ids=True) == [
        {"token": "token_id:7", "logprob": -0.1, "bytes": list("é".encode()),
         "top_logprobs": [{"token": "token_id:5", "logprob": -0.05, "bytes": list(b"token_id:5")}]},
        {"token": "token_id:9", "logprob": -0.5, "bytes": list(b"bc"),
         "top_logprobs": [{"token": "token_id:9", "logprob": -0.5, "bytes": list(b"token_id:9")}]}]
    lp = CompletionLogprobs(as_ids=True)
    lp.add_prompt([3, 7], ["", "é"], [None, entry((7, -1.5, 2, "é"), (5, -0.2, 1, "x"))], 1)
    lp.add_output(entries, 1, "ébc")
    assert lp.as_dict() == {"tokens": ["token_id:3", "token_id:7", "token_id:7", "token_id:9"],
                            "token_logprobs": [None, -1.5, -0.1, -0.5],
                            "top_logprobs": [None, {"token_id:5": -0.2}, {"token_id:5": -0.05},
                                             {"token_id:9": -0.5}],
                            "text_offset": [0, 10, 20, 30]}  # vLLM's: the strings' lengths


def _raw_bytes(values: list[str]) -> bytes:
    return b"".join(struct.pack("<I", len(v.encode())) + v.encode() for v in values)


def test_stop_reason_output_is_read_per_sample():
    response = service_pb2.ModelInferResponse()
    for name, values in (("text_output", ["a", "b", "c"]), ("finish_reason", ["stop", "stop", "length"]),
                         ("stop_reason", ['"\\n"', "42", "null"])):
        out = response.outputs.add()
        out.name, out.datatype = name, "BYTES"
        out.shape.append(len(values))
        response.raw_output_contents.append(_raw_bytes(values))
    chunk = parse_chunk(response)
    assert chunk.stop_reasons == ["\n", 42, None] and chunk.finish_reasons == ["stop", "stop", "length"]


# --- through the server ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def url(chat_stack):
    return chat_stack[1].url


def post(url: str, path: str, **body) -> dict:
    r = httpx.post(url + path, json={"model": "llm", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, **body) -> list[dict]:
    with httpx.stream("POST", url + path, json={"model": "llm", "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


PROMPT = "Once upon a time"
GREEDY = {"temperature": 0, "max_tokens": 24}


def test_completions_stop_reason_is_the_stop_string_or_token_id(url):
    full = post(url, "/v1/completions", prompt=PROMPT, **GREEDY)["choices"][0]
    assert (full["finish_reason"], full["stop_reason"]) == ("length", None)
    text = full["text"]
    stop = next(text[i:i + 2] for i in range(4, len(text)) if text[i:i + 2].strip() and
                text.index(text[i:i + 2]) == i)
    c = post(url, "/v1/completions", prompt=PROMPT, stop=[stop, "never-written"], **GREEDY)["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == (text[:text.index(stop)], "stop", stop)
    chunks = [ch["choices"][0] for ch in stream(url, "/v1/completions", prompt=PROMPT, stop=[stop], **GREEDY)]
    assert [ch["stop_reason"] for ch in chunks] == [None] * (len(chunks) - 1) + [stop]
    assert "".join(ch["text"] for ch in chunks) == c["text"]

    # A stop token: the fourth token's id (as return_tokens_as_token_ids names it).
    ids = post(url, "/v1/completions", prompt=PROMPT, logprobs=0, return_tokens_as_token_ids=True,
               **GREEDY)["choices"][0]["logprobs"]["tokens"]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in ids) and len(ids) == GREEDY["max_tokens"]
    stop_id = int(ids[3].split(":")[1])
    c = post(url, "/v1/completions", prompt=PROMPT, stop_token_ids=[stop_id], **GREEDY)["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", stop_id)


def test_chat_stop_reason_streamed_in_the_last_chunk(url):
    messages = [{"role": "user", "content": "Tell me a story"}]
    text = post(url, "/v1/chat/completions", messages=messages, **GREEDY)["choices"][0]["message"]["content"]
    stop = next(text[i:i + 2] for i in range(4, len(text)) if text[i:i + 2].strip() and
                text.index(text[i:i + 2]) == i)
    r = post(url, "/v1/chat/completions", messages=messages, stop=stop, **GREEDY)
    c = r["choices"][0]
    assert (c["message"]["content"], c["finish_reason"], c["stop_reason"]) == (text[:text.index(stop)], "stop", stop)
    assert r["prompt_logprobs"] is None
    chunks = [ch["choices"][0] for ch in stream(url, "/v1/chat/completions", messages=messages, stop=stop, **GREEDY)]
    assert [("stop_reason" in ch) for ch in chunks] == [False] * (len(chunks) - 1) + [True]
    assert (chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]) == ("stop", stop)


def test_prompt_logprobs_one_per_prompt_token_the_first_null(url):
    ids = [1, 60, 61, 62, 63, 64]
    c = post(url, "/v1/completions", prompt=ids, prompt_logprobs=2, max_tokens=2)["choices"][0]
    lp = c["prompt_logprobs"]
    assert len(lp) == len(ids) and lp[0] is None
    for token, e in zip(ids[1:], lp[1:]):  # the prompt's token, and the top 2 (it may be one)
        assert len(e) == (2 if e[str(token)]["rank"] <= 2 else 3)
        assert sorted(v["rank"] for v in e.values())[:2] == [1, 2]
    r = post(url, "/v1/chat/completions", messages=MSG, prompt_logprobs=0, max_tokens=2)
    assert len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"] and r["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in r["prompt_logprobs"][1:])  # k=0: the prompt's own token
    bad = httpx.post(url + "/v1/completions", json={"model": "llm", "prompt": "x", "prompt_logprobs": 1,
                                                    "stream": True}, timeout=60)
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "prompt_logprobs")


def test_chat_echo_prefixes_the_last_message(url):
    prefill = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "Once upon"}]
    body = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True, **GREEDY}
    plain = post(url, "/v1/chat/completions", **body)["choices"][0]["message"]["content"]
    echoed = post(url, "/v1/chat/completions", echo=True, **body)
    assert echoed["choices"][0]["message"]["content"] == "Once upon" + plain
    assert len(echoed["prompt_logprobs"]) == echoed["usage"]["prompt_tokens"]  # echo asks for them
    chunks = stream(url, "/v1/chat/completions", echo=True, **body)
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert deltas[0]["role"] == "assistant" and deltas[1] == {"content": "Once upon"}
    assert "".join(d.get("content") or "" for d in deltas) == "Once upon" + plain
    # After a generation prompt the reply is the assistant's, and the last message the user's.
    no_match = post(url, "/v1/chat/completions", messages=MSG, echo=True, **GREEDY)
    assert no_match["choices"][0]["message"]["content"] == \
        post(url, "/v1/chat/completions", messages=MSG, **GREEDY)["choices"][0]["message"]["content"]


def test_chat_token_ids_request_id_and_a_refused_field(url):
    r = post(url, "/v1/chat/completions", messages=MSG, logprobs=True, top_logprobs=1, request_id="abc",
             return_tokens_as_token_ids=True, max_tokens=3)
    assert r["id"] == "chatcmpl-abc"
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(re.fullmatch(r"token_id:\d+", c["token"]) for c in content)
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])
    bad = httpx.post(url + "/v1/chat/completions", json={"model": "llm", "messages": MSG,
                                                         "use_beam_search": True}, timeout=60)
    assert (bad.status_code, bad.json()["error"]["message"], bad.json()["error"]["param"]) == \
        (400, "use_beam_search is not supported by this server", "use_beam_search")
