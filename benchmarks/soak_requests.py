"""The soak test's requests (benchmarks/soak.py): each kind on its own connection, and what came
back for it, as an Outcome: how it ended, its terminal responses, anything after the first."""
from __future__ import annotations

import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field

from tests.triton_server import TritonServer, grpc_inputs, http_request

REQUEST_WAIT_S = 90.0  # a request with no terminal response by then counts as "no final"
MALFORMED = ({"sampling": "{not json"}, {"sampling": {"temperature": -1.0}},
             {"sampling": {"max_tokens": 100000}}, {"sampling": {"no_such_parameter": 1}})


@dataclass
class Outcome:
    kind: str
    ended: str = ""  # final | error | cancelled | disconnected | no final
    finals: int = 0
    errors: list[str] = field(default_factory=list)
    after_terminal: int = 0  # responses after the first FINAL or error: must stay 0
    responses: int = 0
    finish_reason: str = ""  # the last one streamed (return_finish_reason)
    seconds: float = 0.0

    @property
    def terminals(self) -> int:
        return self.finals + len(self.errors)


def grpc_request(url: str, kind: str, inputs: list, *, timeout_us: int | None = None,
                 cancel_after_s: float | None = None) -> Outcome:
    """One request on its own stream (2.51's stream errors carry no request id): its outcome."""
    import tritonclient.grpc as grpcclient

    out, lock, done = Outcome(kind), threading.Lock(), threading.Event()

    def callback(result, error) -> None:
        with lock:
            if out.terminals:
                out.after_terminal += 1
            if error is not None:
                out.errors.append(str(error))
                done.set()
                return
            out.responses += 1
            response = result.get_response()
            if any(o.name == "finish_reason" for o in response.outputs):
                reason = result.as_numpy("finish_reason")[0].decode()
                out.finish_reason = reason or out.finish_reason
            if response.parameters["triton_final_response"].bool_param:
                out.finals += 1
                done.set()

    start = time.monotonic()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=callback)
        client.async_stream_infer("llm", inputs, enable_empty_final_response=True, timeout=timeout_us)
        if cancel_after_s is not None and not done.wait(cancel_after_s):
            client.stop_stream(cancel_requests=True)  # its local CANCELLED error is not the server's
            with lock:
                out.ended, out.errors, out.after_terminal = "cancelled", [], 0
        else:
            done.wait(REQUEST_WAIT_S)
            client.stop_stream()  # returns once the server ended the stream: stragglers are counted
        with lock:
            if not out.ended:
                out.ended = "final" if out.finals and not out.errors else "error" if out.terminals else "no final"
    finally:
        client.close()
    out.seconds = time.monotonic() - start
    return out


def http_generate(base: str, prompt: str, max_tokens: int) -> Outcome:
    out, start = Outcome("good"), time.monotonic()
    status, body = http_request(base + "/v2/models/llm/generate",
                                {"text_input": prompt, "max_tokens": max_tokens, "temperature": 0,
                                 "ignore_eos": True}, timeout=REQUEST_WAIT_S)
    if status == 200 and "text_output" in json.loads(body):
        out.finals, out.responses, out.ended = 1, 1, "final"
    else:
        out.errors, out.ended = [f"HTTP {status}: {body[:200]}"], "error"
    out.seconds = time.monotonic() - start
    return out


def http_disconnect(http_port: int, rng: random.Random) -> Outcome:
    """generate_stream, then the connection closed after the first event (the client is gone)."""
    out, start = Outcome("disconnect"), time.monotonic()
    body = json.dumps({"text_input": "disconnect", "stream": True,
                       "parameters": {"max_tokens": 400, "ignore_eos": True}}).encode()
    with socket.create_connection(("127.0.0.1", http_port), timeout=30) as s:
        s.sendall(b"POST /v2/models/llm/generate_stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b"data:" not in got and len(got) < 1 << 16:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
            if b"\r\n" in got and not got.startswith(b"HTTP/1.1 200"):  # refused (e.g. unloaded)
                out.errors, out.ended = [got.split(b"\r\n")[0].decode(errors="replace")], "error"
                break
        time.sleep(rng.uniform(0.0, 0.2))
        out.responses = got.count(b"data:")
    out.ended, out.seconds = out.ended or "disconnected", time.monotonic() - start
    return out


def run_request(kind: str, server: TritonServer, rng: random.Random) -> Outcome:
    prompt = " ".join(rng.choice(("soak", "tritium", "serving", "tokens", "engine")) for _ in range(rng.randint(1, 40)))
    if kind == "good":
        k = rng.randint(1, 32)
        if rng.random() < 0.3:
            return http_generate(server.http_url, prompt, k)
        return grpc_request(server.grpc_url, kind, grpc_inputs(
            prompt, sampling={"max_tokens": k, "temperature": rng.choice((0.0, 0.8)), "ignore_eos": True},
            stream=True))
    if kind == "malformed":
        return grpc_request(server.grpc_url, kind, grpc_inputs(prompt, **rng.choice(MALFORMED)))
    if kind == "cancel":
        return grpc_request(server.grpc_url, kind, grpc_inputs(
            prompt, sampling={"max_tokens": 400, "ignore_eos": True}, stream=True),
            cancel_after_s=rng.uniform(0.05, 0.5))
    if kind == "disconnect":
        return http_disconnect(server.http_port, rng)
    if kind == "deadline":  # Triton's request timeout, in microseconds
        return grpc_request(server.grpc_url, kind, grpc_inputs(
            prompt, sampling={"max_tokens": 400, "ignore_eos": True}, stream=True, return_finish_reason=True),
            timeout_us=300_000)
    raise ValueError(kind)
