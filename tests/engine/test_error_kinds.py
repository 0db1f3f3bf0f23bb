"""Typed request errors through the engine's process (issue 33): an output's error crosses the
socket with its kind; a refused request raises an error that names its parameter."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tritium import EngineArgs, EngineProcess, ErrorKind, ParameterError, RequestError, SamplingParams
from tritium.engine.request import accumulate
from tritium.errors import request_error

LONG = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)


class Collector:
    def __init__(self) -> None:
        self.total = None
        self.done = threading.Event()

    def __call__(self, out) -> None:
        self.total = accumulate(self.total, out)
        if out.finished:
            self.done.set()


def _error(c: Collector) -> RequestError:
    assert c.done.wait(60)
    error = c.total.error
    assert isinstance(error, RequestError), repr(error)
    return error


def test_errors_keep_their_kind_across_the_engine_process(llama_dir):
    engine = EngineProcess(EngineArgs(model=llama_dir, max_model_len=1200, max_num_seqs=4))
    try:
        with pytest.raises(ParameterError) as info:
            engine.add_request("n", [1, 2], SamplingParams(n=5), Collector())
        assert (info.value.parameter, str(info.value)) == ("n", "n=5 is larger than max_num_seqs=4.")
        with pytest.raises(ParameterError) as info:
            engine.add_request("g", [1, 2], SamplingParams(structured_outputs={"regex": "[0-9"}), Collector())
        error = request_error(info.value)
        assert (error.kind, error.parameter) == (ErrorKind.INVALID_ARGUMENT, "structured_outputs")
        assert error.startswith("structured_outputs: invalid regex")
        with pytest.raises(ValueError, match=r"^The prompt is empty\.$") as info:
            engine.add_request("e", "", SamplingParams(), Collector())
        assert (request_error(info.value).kind, request_error(info.value).parameter) == (
            ErrorKind.INVALID_ARGUMENT, None)

        late = Collector()
        engine.add_request("late", [8, 9], LONG, late, deadline=time.time() + 0.3)
        error = _error(late)
        assert (error.kind, error.parameter) == (ErrorKind.TIMEOUT, None)
        assert error.startswith("Request timed out: its deadline passed while it was running")

        running = Collector()
        engine.add_request("r", [1, 2], LONG, running)
    finally:
        engine.shutdown()
    error = _error(running)
    assert (error, error.kind) == ("The engine is shutting down.", ErrorKind.UNAVAILABLE)


def test_a_dead_engine_process_is_unavailable(llama_dir):
    engine = EngineProcess(EngineArgs(model=llama_dir, max_model_len=1200))
    c = Collector()
    try:
        engine.add_request("z", [0, 1], LONG, c)
        os.kill(engine._proc.pid, signal.SIGKILL)
        error = _error(c)
    finally:
        engine.shutdown()
    assert (error, error.kind) == ("The engine process exited unexpectedly; the request did not finish.",
                                   ErrorKind.UNAVAILABLE)
