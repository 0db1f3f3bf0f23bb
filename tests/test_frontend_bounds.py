"""One request must not take a door down (issue 48: n = 10^9 grew the frontend to 22 GB before
anything checked it). Against the shared chat stack: huge n, best_of, max_tokens, logprobs, stop
lists and logit_bias get a 400 naming the field and its limit at once, the frontend's and the
model stub's memory stay flat, and the next request is served; at the OpenAI frontend and at
Triton's own door (HTTP generate and gRPC). Then seeded random oversized values, as a fuzzer
would send them."""
import json
import random
import time

import httpx
import psutil
import pytest

from tritium.frontend import limits
from triton_server import StreamCollector, grpc_inputs, http_request, stub_pids

CHAT = {"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMP = {"model": "llm", "prompt": "Hi", "max_tokens": 4}
BIG_BIAS = {str(i): 1 for i in range(100_000)}
MB = 2**20

# (endpoint, fields, param, the exact message)
HUGE = [
    ("chat", {"n": 10**9}, "n", "n must be at most 128, got 1000000000."),
    ("chat", {"n": 10**9, "stream": True}, "n", "n must be at most 128, got 1000000000."),
    ("comp", {"n": 10**9}, "n", "n must be at most 128, got 1000000000."),
    ("comp", {"best_of": 10**9}, "best_of", "best_of must be at most 128, got 1000000000."),
    ("chat", {"max_tokens": 10**12}, "max_tokens",
     "max_tokens must be at most 1024 (the model's max_model_len), got 1000000000000."),
    ("chat", {"max_tokens": None, "max_completion_tokens": 10**12}, "max_completion_tokens",
     "max_completion_tokens must be at most 1024 (the model's max_model_len), got 1000000000000."),
    ("comp", {"max_tokens": 10**12, "stream": True}, "max_tokens",
     "max_tokens must be at most 1024 (the model's max_model_len), got 1000000000000."),
    ("chat", {"logprobs": True, "top_logprobs": 10**9}, "top_logprobs",
     "top_logprobs must be in [0, 20], got 1000000000."),
    ("comp", {"logprobs": 10**9}, "logprobs", "logprobs must be in [0, 20], got 1000000000."),
    ("chat", {"stop": ["x"] * 100_000}, "stop", "stop may hold at most 64 strings, got 100000."),
    ("comp", {"logit_bias": BIG_BIAS}, "logit_bias", "logit_bias may hold at most 1024 entries, got 100000."),
]


@pytest.fixture(scope="module")
def stack(chat_stack):
    return chat_stack[:2]


def post(url: str, endpoint: str, body: dict) -> tuple[httpx.Response, float]:
    """The response and how long it took (the body is encoded before the clock starts)."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    content = json.dumps(body).encode()
    start = time.monotonic()
    r = httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)
    return r, time.monotonic() - start


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def served(frontend) -> None:
    r, _ = post(frontend.url, "chat", CHAT)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and 1 <= r.json()["usage"]["completion_tokens"] <= 4


def test_huge_sizes_are_refused_at_once_and_the_frontend_stays_flat(stack):
    _, frontend = stack
    served(frontend)  # what a first request allocates is not growth
    before = rss(frontend.proc.pid)
    for endpoint, fields, param, message in HUGE:
        r, took = post(frontend.url, endpoint, {**(CHAT if endpoint == "chat" else COMP), **fields})
        assert r.status_code == 400, (fields.keys(), r.text[:300])
        assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                      "code": 400}}
        assert took < 1.0, f"{param}: {took:.2f} s"
    grown = rss(frontend.proc.pid) - before
    assert grown < 100 * MB, f"the frontend grew by {grown / MB:.0f} MB"
    served(frontend)


def test_a_body_over_the_limit_is_refused_as_it_is_read(stack):
    _, frontend = stack
    body = {**COMP, "prompt": "x" * limits.MAX_BODY_BYTES}
    for content in (json.dumps(body).encode(), iter([b"x" * MB] * 17)):  # with Content-Length, and chunked
        r = httpx.post(frontend.url + "/v1/completions", content=content,
                       headers={"Content-Type": "application/json"}, timeout=60)
        assert (r.status_code, r.json()["error"]["message"]) == (
            413, "the request body is larger than the limit of 16777216 bytes.")
    served(frontend)


# (sampling parameters, the exact message) at Triton's own door
TRITON_HUGE = [
    ({"n": 2_000_000}, "n must be at most 128, got 2000000."),
    ({"best_of": 10**9}, "best_of must be at most 128, got 1000000000."),
    ({"max_tokens": 10**12}, "This model's maximum context length is 1024 tokens. However, you requested "),
    ({"logprobs": 10**9}, "logprobs must be in [0, 20], got 1000000000."),
    ({"stop": ["x"] * 100_000}, "stop may hold at most 64 strings, got 100000."),
    ({"logit_bias": BIG_BIAS}, "logit_bias may hold at most 1024 entries, got 100000."),
]


def test_huge_sizes_are_refused_at_once_at_the_triton_door(stack):
    server, _ = stack
    (stub,) = stub_pids(server.proc.pid)
    generate = f"{server.http_url}/v2/models/llm/generate"
    assert http_request(generate, {"text_input": "Hi", "max_tokens": 2})[0] == 200
    before = rss(stub)
    for sampling, message in TRITON_HUGE:
        body = json.dumps({"text_input": "Hi", "sampling_parameters": json.dumps(sampling)}).encode()
        start = time.monotonic()
        status, text = http_request(generate, body)
        took = time.monotonic() - start
        assert status == 400 and json.loads(text)["error"].startswith(message), (sampling.keys(), text[:300])
        assert took < 1.0, f"{list(sampling)}: {took:.2f} s"
    # HTTP generate's top-level keys (request parameters), and gRPC.
    status, text = http_request(generate, {"text_input": "Hi", "n": 2_000_000})
    assert (status, json.loads(text)["error"]) == (400, "n must be at most 128, got 2000000.")
    stream = StreamCollector(server.grpc_url)
    try:
        start = time.monotonic()
        stream.send("huge", grpc_inputs("Hi", sampling={"n": 2_000_000}))
        assert stream.next_error(timeout=10).endswith("n must be at most 128, got 2000000.")
        assert time.monotonic() - start < 1.0
        stream.send("normal", grpc_inputs("Hi", sampling={"max_tokens": 3}, return_num_output_tokens=True))
        assert sum(stream.wait("normal", timeout=60).num_output_tokens) >= 1
    finally:
        stream.close()
    grown = rss(stub) - before
    assert grown < 100 * MB, f"the model's stub grew by {grown / MB:.0f} MB"
    assert http_request(generate, {"text_input": "Hi", "max_tokens": 2})[0] == 200


# field -> (param, a random oversized value from rng, text every refusal of it holds)
def _over(rng: random.Random, limit: int) -> int:
    return limit + rng.randint(1, limit)  # a list at most twice its limit


OVERSIZED = {
    "n": ("n", lambda rng: limits.MAX_N + rng.randint(1, 10**rng.randint(1, 12)), "at most 128"),
    "best_of": ("best_of", lambda rng: limits.MAX_N + rng.randint(1, 10**rng.randint(1, 12)), "at most 128"),
    "max_tokens": ("max_tokens", lambda rng: 1024 + rng.randint(1, 10**rng.randint(1, 15)), "at most 1024"),
    "logprobs": ("logprobs", lambda rng: rng.choice([-1, 21 + rng.randint(0, 10**9)]), "must be in [0, 20]"),
    "stop": ("stop", lambda rng: [f"s{i}" for i in range(_over(rng, limits.MAX_STOP))], "at most 64 strings"),
    "stop_chars": ("stop", lambda rng: ["x" * _over(rng, limits.MAX_STRING_CHARS)], "at most 1024 characters"),
    "logit_bias": ("logit_bias", lambda rng: {str(i): 1 for i in range(_over(rng, limits.MAX_LOGIT_BIAS))},
                   "at most 1024 entries"),
    "stop_token_ids": ("stop_token_ids", lambda rng: [2] * _over(rng, limits.MAX_TOKEN_IDS), "at most 262144 token ids"),
    "allowed_token_ids": ("allowed_token_ids", lambda rng: [2] * _over(rng, limits.MAX_TOKEN_IDS),
                          "at most 262144 token ids"),
    "bad_words": ("bad_words", lambda rng: ["w"] * _over(rng, limits.MAX_WORDS), "at most 1024 strings"),
    "guided_choice": ("guided_choice", lambda rng: ["c"] * _over(rng, limits.MAX_WORDS), "at most 1024 strings"),
    "prompt": ("prompt", lambda rng: ["p"] * _over(rng, limits.MAX_PROMPTS), "at most 128 prompts"),
    "prompt_chars": ("prompt", lambda rng: "x" * (limits.MAX_PROMPT_CHARS + rng.randint(1, 10**6)),
                     "at most 4194304 characters"),
    "messages": ("messages", lambda rng: [{"role": "user", "content": "m"}] * _over(rng, limits.MAX_MESSAGES),
                 "at most 2048 messages"),
    "tools": ("tools", lambda rng: [{"type": "function", "function": {"name": "f"}}] * _over(rng, limits.MAX_TOOLS),
              "at most 128 tools"),
}


def test_seeded_random_oversized_requests_leave_the_frontend_serving(stack):
    _, frontend = stack
    rng = random.Random(48)
    served(frontend)
    before = rss(frontend.proc.pid)
    start = time.monotonic()
    for _ in range(40):
        field = rng.choice(sorted(OVERSIZED))
        param, make, text = OVERSIZED[field]
        value = make(rng)
        endpoint = "comp" if field.startswith("prompt") else "chat" if field in ("messages", "tools") \
            else rng.choice(["chat", "comp"])
        name = {"stop_chars": "stop", "prompt_chars": "prompt"}.get(field, field)
        if endpoint == "chat" and name in ("logprobs", "best_of"):  # completions' fields, in chat's words
            name, param = {"logprobs": ("top_logprobs", "top_logprobs"), "best_of": ("n", "n")}[name]
        body = {**(CHAT if endpoint == "chat" else COMP), name: value, "stream": rng.random() < 0.5}
        if name == "top_logprobs":
            body["logprobs"] = True
        r, _ = post(frontend.url, endpoint, body)
        assert r.status_code == 400, (endpoint, field, r.text[:300])
        error = r.json()["error"]
        assert error["param"] == param and text in error["message"], (endpoint, field, error)
    assert time.monotonic() - start < 20
    assert frontend.proc.poll() is None
    grown = rss(frontend.proc.pid) - before
    assert grown < 100 * MB, f"the frontend grew by {grown / MB:.0f} MB"
    served(frontend)
