"""The response sender's coalescing rule (issue 27): while a send() is slow, a request's queued
tokens go out folded into one response; every token arrives once, in order, and the request
ends with exactly one FINAL. Against a stand-in for triton_python_backend_utils (the real one
exists only inside the Triton stub; the server tests cover it)."""
import threading
import time
from types import SimpleNamespace

import numpy as np

from tritium.outputs import CompletionOutput, RequestOutput
from tritium.serving.response_sender import InFlight, ResponseSender
from tritium.serving.triton_request import ResponseBuilder, parse_request

FINAL = 1


class StalledSender:
    """A client whose first send() blocks until released (a slow client, a busy stub)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.sent: list[tuple[dict, int]] = []
        self.done = threading.Event()

    def send(self, response, flags: int = 0) -> None:
        self.entered.set()
        if not self.sent:
            self.release.wait(10)
        self.sent.append((response, flags))
        if flags & FINAL:
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


def _pb() -> SimpleNamespace:
    log = SimpleNamespace(log_info=lambda m: None, log_warn=lambda m: None, log_error=lambda m: None)
    return SimpleNamespace(
        InferenceResponse=lambda output_tensors=None, error=None: {"tensors": {t[0]: t[1] for t in output_tensors or []},
                                                                   "error": error},
        Tensor=lambda name, array: (name, array), TritonError=SimpleNamespace(UNAVAILABLE=14, INTERNAL=13),
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL, Logger=log, is_model_ready=lambda **_: True)


def _delta(i: int, last: bool) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], [CompletionOutput(0, f"<{i}>", [100 + i], -1.0, None,
                                                              "length" if last else None)], last)


def test_a_stalled_sender_folds_the_backlog_and_loses_nothing():
    client, n = StalledSender(), 50
    sender = ResponseSender(_pb(), SimpleNamespace(abort=lambda rid: None), ("llm", "1"))
    request = parse_request({"text_input": np.array([b"Hi"], dtype=object), "stream": np.array([True]),
                             "sampling_parameters": np.array([b'{"max_tokens": 50}'], dtype=object)})
    sender.track(InFlight("r", client, ResponseBuilder(request)))
    try:
        sender.on_output("r", _delta(0, False))
        assert client.entered.wait(10)  # the thread is now inside the first send(), stalled
        start = time.perf_counter()
        for i in range(1, n):  # the engine goes on producing: handing over never waits on the client
            sender.on_output("r", _delta(i, i == n - 1))
        handed_over_s = time.perf_counter() - start
        client.release.set()
        assert client.done.wait(10)
    finally:
        sender.stop(timeout=10)
    texts = ["".join(r["tensors"]["text_output"].astype(str)) for r, _ in client.sent]
    assert "".join(texts) == "".join(f"<{i}>" for i in range(n))  # every token once, in order
    assert [flags for _, flags in client.sent].count(FINAL) == 1 and client.sent[-1][1] == FINAL
    assert len(client.sent) < n / 5, texts  # the backlog left in a few responses, not one per token
    assert max(t.count("<") for t in texts) > 1
    assert handed_over_s < 1.0
