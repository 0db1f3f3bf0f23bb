"""The OpenAI frontend at its edges, against the real tritonserver: text that is not Unicode,
wrong methods and URLs, fields named as the client named them, the response fields clients read
(system_fingerprint, refusal, usage.prompt_tokens_details.cached_tokens from the engine's prefix
cache, usage in every chunk), and /metrics on the API port. A keep-alive connection survives
every error."""
import http.client
import json
import random
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from triton_server import TEST_ENGINE_ARGS

BLOCK = int(TEST_ENGINE_ARGS["block_size"])
CHAT = {"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMP = {"model": "llm", "prompt": "Hi", "max_tokens": 4}
CHAT_PATH, COMP_PATH = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def stack(chat_stack):
    return chat_stack[:2]


@pytest.fixture(scope="module")
def client(stack):
    return OpenAI(api_key="none", base_url=stack[1].url + "/v1", max_retries=0, timeout=120)


class KeepAlive:
    """One HTTP/1.1 connection for several requests: a server that closes it after an error
    fails the next request (http.client does not reconnect a socket it believes open)."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.conn.connect()
        self.sock = self.conn.sock

    def request(self, method: str, path: str,
                body: str | None = None) -> tuple[int, Any, http.client.HTTPResponse]:
        """(status, the body: JSON decoded, else text, the response)."""
        headers = {"Content-Type": "application/json"} if body is not None else {}
        self.conn.request(method, path, body=body.encode("utf-8") if body is not None else None,
                          headers=headers)
        r = self.conn.getresponse()
        raw = r.read()
        json_body = (r.getheader("content-type") or "").startswith("application/json")
        data = json.loads(raw) if json_body else raw.decode("utf-8")
        assert self.conn.sock is self.sock, "the server closed the connection"
        assert (r.getheader("connection") or "").lower() != "close"
        return r.status, data, r


# A JSON text whose \ud800 escape decodes to a lone surrogate (json.dumps would escape it too).
LONE = '"\\ud800 x"'


def test_lone_surrogates_are_400s_naming_the_field_and_the_connection_lives(stack):
    fe = stack[1]
    c = KeepAlive(fe.port)
    cases = [
        (CHAT_PATH, '{"model": "llm", "messages": [{"role": "user", "content": %s}]}' % LONE,
         "messages.0.content"),
        (CHAT_PATH, '{"model": "llm", "messages": [{"role": "user", "content": [{"type": "text", '
         '"text": "ok"}, {"type": "text", "text": %s}]}]}' % LONE, "messages.0.content.1.text"),
        (COMP_PATH, '{"model": "llm", "prompt": %s, "max_tokens": 2}' % LONE, "prompt"),
        (COMP_PATH, '{"model": "llm", "prompt": "Hi", "stop": ["a", %s]}' % LONE, "stop.1"),
    ]
    for path, body, param in cases:
        status, data, _ = c.request("POST", path, body)
        assert status == 400, data
        assert data["error"] == {
            "message": f"{param}: the string holds an unpaired UTF-16 surrogate (U+D800 at index 0), "
                       "which is not a Unicode character",
            "type": "invalid_request_error", "param": param, "code": 400}
    # A pair of surrogates is one character (U+1F600): served.
    # ignore_eos: the shared server's sampler may draw the end token early.
    pair = '{"model": "llm", "prompt": "\\ud83d\\ude00", "max_tokens": 2, "ignore_eos": true}'
    status, data, _ = c.request("POST", COMP_PATH, pair)
    assert status == 200 and data["usage"]["completion_tokens"] == 2
    status, data, _ = c.request("POST", CHAT_PATH, json.dumps({**CHAT, "ignore_eos": True}))
    assert status == 200 and data["usage"]["completion_tokens"] == 4


def test_wrong_method_and_url_are_openai_errors(stack):
    c = KeepAlive(stack[1].port)
    status, data, r = c.request("GET", CHAT_PATH)
    assert (status, r.getheader("allow")) == (405, "POST")
    assert data["error"] == {"message": "Invalid method for URL (GET /v1/chat/completions)",
                             "type": "invalid_request_error", "param": None, "code": 405}
    status, data, _ = c.request("POST", "/v1/chat/completion", json.dumps(CHAT))
    assert status == 404
    assert data["error"] == {"message": "Invalid URL (POST /v1/chat/completion)",
                             "type": "not_found_error", "param": None, "code": 404}
    status, data, _ = c.request("POST", COMP_PATH, json.dumps(COMP))
    assert status == 200


# (path, body, param, message)
BAD = [
    (CHAT_PATH, {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "top_logprobs must be in [0, 20], got 21."),
    (CHAT_PATH, {**CHAT, "max_tokens": None, "max_completion_tokens": 0}, "max_completion_tokens",
     "max_completion_tokens must be at least 1, got 0."),
    (CHAT_PATH, {**CHAT, "stream_options": {"include_usage": True}}, "stream_options",
     "Stream options can only be defined when `stream=True`."),
    (COMP_PATH, {**COMP, "stream": False, "stream_options": {"include_usage": True}}, "stream_options",
     "Stream options can only be defined when `stream=True`."),
    (CHAT_PATH, {**CHAT, "seed": 2**64}, "seed",
     "seed must be a 64-bit signed integer, in [-9223372036854775808, 9223372036854775807], "
     "got 18446744073709551616."),
    (COMP_PATH, {**COMP, "seed": -2**63 - 1}, "seed",
     "seed must be a 64-bit signed integer, in [-9223372036854775808, 9223372036854775807], "
     "got -9223372036854775809."),
    (CHAT_PATH, {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
     "messages.0.content", "messages.0.content: part 1 is an image (type 'image_url'), and this "
     "model takes text only: send text parts or a string"),
    (CHAT_PATH, {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
     "messages.0.content", "messages.0.content: part 0 is audio (type 'input_audio'), and this "
     "model takes text only: send text parts or a string"),
    (COMP_PATH, {**COMP, "prompt": [5, 2**40]}, "prompt",
     "prompt: token id 1099511627776 is out of range (token ids are 32-bit)"),
]


@pytest.mark.parametrize("path, body, param, message", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_fields_are_named_as_the_request_names_them(stack, path, body, param, message):
    c = KeepAlive(stack[1].port)
    status, data, _ = c.request("POST", path, json.dumps(body))
    assert status == 400, data
    assert data["error"] == {"message": message, "type": "invalid_request_error", "param": param,
                             "code": 400}
    status, _, _ = c.request("POST", COMP_PATH, json.dumps(COMP))
    assert status == 200


def test_stream_options_with_stream_true_are_taken(client):
    chunks = list(client.chat.completions.create(model="llm", messages=CHAT["messages"], max_tokens=2,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 2


def _random_ids(n: int) -> list[int]:
    """A prompt no earlier request started with (its first block is new to the prefix cache)."""
    rng = random.Random(time.time_ns())
    return [rng.randrange(5, 500) for _ in range(n)]


def test_cached_tokens_come_from_the_engines_prefix_cache(client):
    ids = _random_ids(100)  # 6 full blocks of 16 before the last token, which is never cached
    first = client.completions.create(model="llm", prompt=ids, max_tokens=2, temperature=0)
    second = client.completions.create(model="llm", prompt=ids, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 100
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (100 - 1) // BLOCK * BLOCK == 96

    # The same through chat, streamed: the second request finds the first one's blocks.
    messages = [{"role": "user", "content": " ".join(f"w{t}" for t in _random_ids(60))}]
    usages = []
    for _ in range(2):
        stream = client.chat.completions.create(model="llm", messages=messages, max_tokens=2,
                                                stream=True, stream_options={"include_usage": True})
        usages.append([c.usage for c in stream if c.usage is not None][-1])
    prompt_tokens = usages[0].prompt_tokens
    assert prompt_tokens > 3 * BLOCK
    assert usages[0].prompt_tokens_details.cached_tokens < prompt_tokens // 2  # the template's start only
    assert usages[1].prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // BLOCK * BLOCK


def test_the_fields_clients_read_are_there(stack, client):
    fe = stack[1]
    raw = httpx.post(fe.url + CHAT_PATH, json=CHAT, timeout=60).json()
    fingerprint = raw["system_fingerprint"]
    assert fingerprint.startswith("fp_") and len(fingerprint) == 15
    message = raw["choices"][0]["message"]
    assert message["refusal"] is None and set(message) == {"role", "content", "refusal"}
    assert set(raw["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens",
                                 "prompt_tokens_details"}
    assert isinstance(raw["usage"]["prompt_tokens_details"]["cached_tokens"], int)

    comp = client.completions.create(**COMP)
    assert comp.system_fingerprint == fingerprint  # the same model, the same configuration
    assert comp.usage.prompt_tokens_details.cached_tokens is not None

    for create, kw in ((client.chat.completions.create, {"messages": CHAT["messages"]}),
                       (client.completions.create, {"prompt": "Hi"})):
        # Under load the server folds a stream's tokens into fewer responses: count none.
        chunks = list(create(model="llm", max_tokens=3, stream=True, **kw))
        assert chunks and all(c.system_fingerprint == fingerprint for c in chunks)


def test_continuous_usage_stats_put_usage_in_every_chunk(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    for create, kw in ((client.chat.completions.create, {"messages": CHAT["messages"]}),
                       (client.completions.create, {"prompt": "Hi"})):
        chunks = list(create(model="llm", max_tokens=5, temperature=0, stream=True,
                             stream_options=options, **kw))
        assert all(c.usage is not None for c in chunks), [c.usage for c in chunks]
        prompt_tokens = chunks[-1].usage.prompt_tokens
        assert all(c.usage.prompt_tokens == prompt_tokens for c in chunks)
        assert all(c.usage.prompt_tokens_details.cached_tokens is not None for c in chunks)
        completion = [c.usage.completion_tokens for c in chunks]
        assert completion == sorted(completion) and completion[-1] == 5
    # Chat's first chunk (the role) comes before any token.
    first = next(iter(client.chat.completions.create(model="llm", messages=CHAT["messages"],
                                                      max_tokens=5, stream=True, stream_options=options)))
    assert first.choices[0].delta.role == "assistant" and first.usage.completion_tokens == 0


def _samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _requests(samples: dict, handler: str, method: str, status: str) -> float:
    key = ("http_requests_total", (("handler", handler), ("method", method), ("status", status)))
    return samples.get(key, 0.0)


def _settled_samples(url: str) -> dict:
    """The frontend's metrics once an earlier test's requests have all been counted (a stream
    its client left is counted when the server notices, which can be after that test ended)."""
    def counts(samples: dict) -> dict:  # each scrape counts itself: /metrics is left out
        return {k: v for k, v in samples.items()
                if k[0] == "http_requests_total" and ("handler", "/metrics") not in k[1]}

    samples = _samples(httpx.get(url, timeout=30).text)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        time.sleep(0.5)
        again = _samples(httpx.get(url, timeout=30).text)
        if counts(again) == counts(samples):
            return again
        samples = again
    return samples


def test_metrics_on_the_api_port(stack):
    server, fe = stack
    before = _settled_samples(fe.url + "/metrics")
    for body in (CHAT, CHAT, {**CHAT, "temperature": -1}):
        httpx.post(fe.url + CHAT_PATH, json=body, timeout=60)
    httpx.get(fe.url + CHAT_PATH, timeout=30)
    r = httpx.get(fe.url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    after = _samples(r.text)
    asked = (("POST", "200"), ("POST", "400"), ("GET", "405"))
    delta = {status: _requests(after, CHAT_PATH, method, status) - _requests(before, CHAT_PATH, method, status)
             for method, status in asked}
    assert delta == {"200": 2, "400": 1, "405": 1}
    count = ("http_request_duration_seconds_count", (("handler", CHAT_PATH), ("method", "POST")))
    assert after[count] - before.get(count, 0.0) == 3
    # The engine's vllm: families, as Triton reports them (nothing runs meanwhile), with vLLM's
    # model_name label.
    labels = {"model": "llm", "model_name": "llm", "version": "1"}
    key = ("vllm:generation_tokens_total", tuple(sorted(labels.items())))
    assert after[key] == server.metric("vllm:generation_tokens_total", **labels) > 0
    names = {family.name for family in text_string_to_metric_families(r.text)}
    assert {"vllm:num_requests_running", "vllm:time_to_first_token_seconds", "http_requests"} <= names
    assert not any(n.startswith("nv_") for n in names)  # only the engines' vllm: families


def test_an_unexpected_error_is_a_500_in_openai_shape_and_the_connection_lives(tmp_path):
    """The frontend's app (no Triton behind it) with one more route that fails as a bug would."""
    import asyncio

    import uvicorn

    from starlette.responses import StreamingResponse

    from tritium.frontend.app import FrontendConfig, create_app
    from triton_server import _free_ports

    app = create_app(FrontendConfig(triton_grpc="127.0.0.1:1", triton_metrics=""))

    @app.get("/v1/bug")
    async def bug() -> None:
        raise KeyError("a bug")

    @app.get("/v1/stream-bug")
    async def stream_bug() -> StreamingResponse:
        async def events():
            yield 'data: {"n": 1}\n\n'
            raise ValueError("a bug midway")
        return StreamingResponse(events(), media_type="text/event-stream")

    (port,) = _free_ports(1)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        c = KeepAlive(port)
        for _ in range(2):
            status, data, _ = c.request("GET", "/v1/bug")
            assert status == 500
            assert data["error"] == {"message": "internal error: KeyError: 'a bug'", "type": "server_error",
                                     "param": None, "code": 500}
        # A stream that fails midway ends with the error as its last event, then [DONE].
        status, text, _ = c.request("GET", "/v1/stream-bug")
        error = {"error": {"message": "internal error: ValueError: a bug midway", "type": "server_error",
                           "param": None, "code": 500}}
        assert (status, text) == (200, f'data: {{"n": 1}}\n\ndata: {json.dumps(error)}\n\ndata: [DONE]\n\n')
        status, text, _ = c.request("GET", "/metrics")
        assert status == 200
        assert 'http_requests_total{handler="/v1/bug",method="GET",status="500"} 2.0' in text
    finally:
        server.should_exit = True
        thread.join(timeout=30)
