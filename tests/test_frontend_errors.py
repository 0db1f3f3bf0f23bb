"""The OpenAI frontend's reliability: every bad input gets a 400 (or 404) in OpenAI's error shape
with a clear message while another stream carries on; a client that goes away cancels its
Triton request (its KV blocks freed); an API key is enforced."""
import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from openai import OpenAI

from tritium.frontend.errors import OpenAIError
from tritium.frontend.triton_gateway import GenerationRequest, TritonGateway
from frontend_server import start_frontend
from triton_server import StreamCollector, grpc_inputs, wait_until

LABELS = {"model": "llm", "version": "1"}


@pytest.fixture(scope="module")
def stack(chat_stack):
    server, frontend, _, tmp = chat_stack
    return server, frontend, tmp


CHAT = {"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMP = {"model": "llm", "prompt": "Hi", "max_tokens": 4}

# (endpoint, body, status, param, message)
BAD = [
    ("chat", {**CHAT, "temperature": -0.5}, 400, "temperature", "temperature must be non-negative, got -0.5."),
    ("chat", '{"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
     400, "temperature", "temperature: Input should be a finite number"),
    ("comp", '{"model": "llm", "prompt": "Hi", "top_p": Infinity}', 400, "top_p",
     "top_p: Input should be a finite number"),
    ("comp", {**COMP, "top_p": 1.5}, 400, "top_p", "top_p must be in (0, 1], got 1.5."),
    ("comp", {**COMP, "presence_penalty": 2.5}, 400, "presence_penalty",
     "presence_penalty must be in [-2, 2], got 2.5."),
    ("chat", {**CHAT, "frequency_penalty": -3}, 400, "frequency_penalty",
     "frequency_penalty must be in [-2, 2], got -3.0."),
    ("comp", {**COMP, "repetition_penalty": 0}, 400, "repetition_penalty",
     "repetition_penalty must be in (0, 2], got 0.0."),
    ("comp", {**COMP, "max_tokens": -1}, 400, "max_tokens", "max_tokens must be at least 1, got -1."),
    ("chat", {**CHAT, "logit_bias": {"abc": 1}}, 400, "logit_bias",
     "sampling parameter 'logit_bias' must be an object of token ids to numbers, got {'abc': 1.0}."),
    ("chat", {**CHAT, "logit_bias": {"100000": 1}}, 400, "logit_bias",
     "logit_bias: token id 100000 is out of vocabulary (valid ids are 0 to 511)."),
    ("comp", {**COMP, "logit_bias": {"5": 101}}, 400, "logit_bias",
     "logit_bias: the bias of token 5 must be in [-100, 100], got 101.0"),
    ("comp", {**COMP, "n": 65}, 400, "n", "n=65 is larger than max_num_seqs=64."),
    ("comp", {**COMP, "n": 0}, 400, "n", "n: n must be at least 1, got 0"),
    ("chat", {**CHAT, "model": "gpt-4"}, 404, "model", "The model `gpt-4` does not exist."),
    ("chat", '{"model": "llm", "messages": [', 400, None,
     "the request body is not valid JSON: Expecting value: line 1 column 31 (char 30)"),
    ("chat", {**CHAT, "max_tokens": "many"}, 400, "max_tokens",
     "max_tokens: Input should be a valid integer, unable to parse string as an integer"),
    ("chat", {**CHAT, "messages": "Hi"}, 400, "messages", "messages: Input should be a valid list"),
    ("chat", {**CHAT, "messages": []}, 400, "messages", "messages: messages must not be empty"),
    ("comp", {**COMP, "prompt": ""}, 400, "prompt", "prompt must not be empty"),
    ("chat", {**CHAT, "response_format": {"type": "json_schema",
                                          "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     400, "structured_outputs", 'structured_outputs: invalid json: Unsupported type "bogus"'),
    ("chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice",
     "tool_choice names the function 'g', which is not among the request's tools"),
    ("chat", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", "top_logprobs needs logprobs=true"),
    ("comp", {**COMP, "logprobs": 21}, 400, "logprobs", "logprobs must be in [0, 20], got 21."),
]


def post(url: str, endpoint: str, body) -> httpx.Response:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=60)


def test_bad_inputs_get_clear_errors_while_a_stream_carries_on(stack):
    server, frontend, _ = stack
    client = OpenAI(api_key="none", base_url=frontend.url + "/v1", max_retries=0)
    result = {}

    def long_stream() -> None:
        text, usage, finish = "", None, None
        for chunk in client.completions.create(model="llm", prompt="Hello", max_tokens=400,
                                               temperature=0, extra_body={"ignore_eos": True},
                                               stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            for c in chunk.choices:
                text, finish = text + c.text, c.finish_reason or finish
        result.update(text=text, usage=usage, finish=finish)

    thread = threading.Thread(target=long_stream)
    thread.start()
    try:
        for endpoint, body, status, param, message in BAD:
            for stream in (False, True):
                if stream and isinstance(body, dict):
                    body = {**body, "stream": True}
                r = post(frontend.url, endpoint, body)
                assert r.status_code == status, (body, r.text)
                error = r.json()["error"]
                assert (error["message"], error["param"]) == (message, param), body
                assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    finally:
        thread.join(timeout=120)
    assert result["finish"] == "length" and result["usage"].completion_tokens == 400
    good = post(frontend.url, "chat", {**CHAT, "ignore_eos": True})  # (an early end token is no failure here)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 4


def aborted(server) -> float:
    try:
        return server.metric("vllm:request_success_total", finished_reason="abort", **LABELS)
    except KeyError:
        return 0.0


def running(server) -> float:
    return server.metric("vllm:num_requests_running", **LABELS)


LONG = {"model": "llm", "prompt": "Once", "max_tokens": 1000, "ignore_eos": True}


def test_a_streaming_client_that_disconnects_frees_its_request(stack):
    server, frontend, _ = stack
    before = aborted(server)
    with httpx.stream("POST", frontend.url + "/v1/completions", json={**LONG, "stream": True},
                      timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if len(events) == 3:
                break
        assert all(e["choices"][0]["finish_reason"] is None for e in events)  # mid-stream
    # The connection is closed: the frontend cancels the gRPC stream, the engine aborts (a
    # request that had run to its end would count as finished by length, not aborted).
    assert wait_until(lambda: running(server) == 0 and aborted(server) == before + 1, 10), \
        (running(server), aborted(server), before)


def test_a_waiting_client_that_disconnects_frees_its_request(stack):
    server, frontend, _ = stack
    before = aborted(server)
    body = json.dumps(LONG).encode()
    sock = socket.create_connection(("127.0.0.1", frontend.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    time.sleep(0.5)  # the request runs (~2 s for 1000 tokens here); the client gives up
    sock.close()
    assert wait_until(lambda: running(server) == 0 and aborted(server) == before + 1, 10), \
        (running(server), aborted(server), before)


def test_api_key(stack):
    server, _, tmp = stack
    keyed = start_frontend(server.grpc_url, str(tmp / "keyed.log"), "--api-key", "sesame")
    try:
        r = httpx.post(keyed.url + "/v1/completions", json=COMP)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        client = OpenAI(api_key="sesame", base_url=keyed.url + "/v1", max_retries=0)
        # ignore_eos: the shared server's sampler may draw the end token early, depending on
        # what ran before on it; the key is what this checks.
        answer = client.completions.create(**COMP, extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 4
    finally:
        keyed.stop()


def test_error_kinds_reach_the_frontend_and_plain_clients_see_the_message(stack):
    """The frontend asks the model for its errors as JSON (return_error_details) and answers by
    kind, with the parameter; a tritonclient stream that does not ask gets the message alone."""
    server, frontend, _ = stack
    r = post(frontend.url, "comp", {**COMP, "top_p": 1.5})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "top_p must be in (0, 1], got 1.5.", "type": "invalid_request_error",
                                 "param": "top_p", "code": 400}
    plain, asking = StreamCollector(server.grpc_url), StreamCollector(server.grpc_url)
    try:
        plain.send("p", grpc_inputs("x", sampling={"top_p": 1.5}))
        assert plain.next_error(timeout=30) == "top_p must be in (0, 1], got 1.5."
        asking.send("a", grpc_inputs("x", sampling={"top_p": 1.5}), parameters={"return_error_details": True})
        assert json.loads(asking.next_error(timeout=30)) == {
            "kind": "invalid_argument", "parameter": "top_p", "message": "top_p must be in (0, 1], got 1.5."}
        # Triton's request timeout (us) ends a running request: kind "timeout"
        asking.send("t", grpc_inputs("x", stream=True, sampling={"max_tokens": 1000, "ignore_eos": True}),
                    parameters={"return_error_details": True}, timeout=300_000)
        error = json.loads(asking.next_error(timeout=30))
        assert (error["kind"], error["parameter"]) == ("timeout", None), error
        assert error["message"].startswith("Request timed out: its deadline passed while it was running"), error
        plain.send("t", grpc_inputs("x", stream=True, sampling={"max_tokens": 1000, "ignore_eos": True}),
                   timeout=300_000)
        assert plain.next_error(timeout=30).startswith("Request timed out: its deadline passed while it was running")
    finally:
        plain.close()
        asking.close()
    assert post(frontend.url, "comp", COMP).status_code == 200


def test_tritonservers_own_stream_errors_are_answered_from_readiness(stack):
    """An error that tritonserver itself sends on the stream is a plain message, not the model's
    JSON: a model that is not ready (here one Triton does not have, as after an unload) is 503."""
    server, _, _ = stack

    async def generate(model: str):
        gateway = TritonGateway(server.grpc_url)
        try:
            with pytest.raises(OpenAIError) as info:
                async for _ in gateway.generate(GenerationRequest(model, "r", "Hi", {"max_tokens": 2}, False)):
                    pass
            return info.value
        finally:
            await gateway.close()

    missing = asyncio.run(generate("nope"))
    assert (missing.status, missing.param) == (503, None)
    assert "unknown model" in missing.message and not missing.message.startswith("{"), missing.message
