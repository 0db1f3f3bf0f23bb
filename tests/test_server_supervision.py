"""Issue 24, serving side, on the real server: a killed engine is restarted and serves again;
a full queue answers UNAVAILABLE (503) at once; Triton's request timeout ends waiting and
running requests; an unload lets running streams finish within drain_timeout_s, then aborts."""
import json
import os
import signal
import time

import pytest

from triton_server import (TEST_ENGINE_ARGS, StreamCollector, engine_pids, grpc_inputs, http_request,
                           start_server, wait_until, write_config, write_model_repository)

# Two running requests at most, two more may wait: the third waiting one is refused.
ENGINE_ARGS = {**TEST_ENGINE_ARGS, "max_num_seqs": "2", "max_waiting_requests": "2",
               "max_model_len": "2048"}
LONG = {"max_tokens": 1500, "ignore_eos": True}  # seconds on a CPU
# Streams that must still run when an unload is noticed (the stub looks a few times a second),
# then finish within the drain: each token more is only a longer wait for them.
DRAINED_TOKENS = 1000


def _engine_pid(server_pid: int) -> int:
    pids = engine_pids(server_pid)
    assert len(pids) == 1, pids
    return pids[0]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("supervision")
    repo = write_model_repository(str(tmp / "repo"), {"model": tiny_model, **ENGINE_ARGS})
    srv = start_server(repo, str(tmp / "tritonserver.log"), "--model-control-mode=explicit",
                       "--load-model=llm")
    srv.repo, srv.model = repo, tiny_model
    yield srv
    srv.stop_in_background()


@pytest.fixture
def loaded(server):
    """The server with its model loaded: a test that unloads it need not load it again for the
    next one (each load starts an engine, seconds on a CPU)."""
    if not server.is_ready("llm"):
        write_config(os.path.join(server.repo, "llm"), {"model": server.model, **ENGINE_ARGS})
        _control(server, "load")
    return server


def _generate(server, prompt="hello", max_tokens=4, **body):
    status, text = http_request(f"{server.http_url}/v2/models/llm/generate",
                                {"text_input": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                                 "exclude_input_in_output": True, **body})
    return status, json.loads(text)


def _metric(server, name):
    return server.metric(name, model="llm", version="1")


def test_killed_engine_restarts_and_serves_again(loaded):
    server = loaded
    assert _generate(server)[0] == 200
    stream = StreamCollector(server.grpc_url)
    try:
        stream.send("a", grpc_inputs("in flight", stream=True, sampling=LONG))
        assert wait_until(lambda: stream.results["a"].texts, 30)
        old = _engine_pid(server.proc.pid)
        killed = time.monotonic()
        os.kill(old, signal.SIGKILL)
        assert stream.next_error(timeout=5) == ("The engine process exited unexpectedly; "
                                                "the request did not finish.")
        assert time.monotonic() - killed < 1.0
        # While the new engine starts, requests are refused at once (sent as UNAVAILABLE: the
        # bundled tritonserver's generate endpoint answers every response error with HTTP 400
        # whatever its code, where its /infer endpoint answers the same error with 503).
        status, body = _generate(server)
        if status != 200:
            assert status == 400 and body["error"].startswith("The engine is restarting"), body
        assert wait_until(lambda: _generate(server)[0] == 200, 60, 0.5)
    finally:
        stream.close()
    assert _engine_pid(server.proc.pid) != old
    assert server.is_ready("llm")
    assert wait_until(lambda: _metric(server, "tritium:engine_restarts_total") == 1, 10)
    assert "tritium: the engine serves again (restart 1" in server.log_tail(400)


def test_full_queue_answers_unavailable_at_once(loaded):
    server = loaded
    # A stream each: Triton 2.51 held back the later requests of one gRPC stream here.
    streams = [StreamCollector(server.grpc_url) for _ in range(4)]
    try:
        before = _metric(server, "tritium:num_requests_rejected_total")
        # Two run long enough to hold the queue full while it is checked; the two that wait
        # behind them need only a few tokens to show that an admitted request finishes.
        tokens = [1500, 1500, 8, 8]
        for i, stream in enumerate(streams):  # two run, then two wait
            stream.send(f"q{i}", grpc_inputs("queued", stream=True, return_num_output_tokens=True,
                                             sampling={"max_tokens": tokens[i], "ignore_eos": True}))
            if i < 2:  # (a request counts as waiting until its first token)
                assert wait_until(lambda: stream.results[f"q{i}"].texts, 30)
        assert wait_until(lambda: _metric(server, "vllm:num_requests_running") == 2
                          and _metric(server, "vllm:num_requests_waiting") == 2, 30)
        start = time.monotonic()
        status, body = _generate(server, max_tokens=4)
        # UNAVAILABLE, which the generate endpoint turns into 400 (see above)
        assert status == 400 and "requests are already waiting to be scheduled" in body["error"], (status, body)
        assert time.monotonic() - start < 1.0
        for i, stream in enumerate(streams):  # the admitted ones finish
            r = stream.wait(f"q{i}", 120)
            assert r.finals == 1 and sum(r.num_output_tokens) == tokens[i]
            assert stream.errors.empty()
        assert wait_until(lambda: _metric(server, "tritium:num_requests_rejected_total") >= before + 1, 10)
    finally:
        for stream in streams:
            stream.close()


def test_request_timeout_ends_running_and_waiting_requests(loaded):
    server = loaded
    before = _metric(server, "tritium:num_requests_timed_out_total")
    busy = [StreamCollector(server.grpc_url) for _ in range(2)]
    late = StreamCollector(server.grpc_url)
    try:
        for i, stream in enumerate(busy):
            stream.send(f"r{i}", grpc_inputs("busy", stream=True, sampling=LONG))
        assert wait_until(lambda: busy[0].results["r0"].texts and busy[1].results["r1"].texts, 30)
        # w waits behind the two (max_num_seqs=2) until its deadline (Triton's timeout, in us)
        late.send("w", grpc_inputs("late", stream=True, sampling=LONG), timeout=500_000)
        error = late.next_error(timeout=10)
        assert error.startswith("Request timed out: its deadline passed while it was waiting"), error
    finally:
        for stream in busy:
            stream.close(cancel=True)
        late.close()
    stream = StreamCollector(server.grpc_url)
    try:
        assert wait_until(lambda: _metric(server, "vllm:num_requests_running") == 0, 30)
        stream.send("x", grpc_inputs("run", stream=True, sampling=LONG), timeout=1_000_000)
        assert wait_until(lambda: stream.results["x"].texts, 5)
        error = stream.next_error(timeout=10)
        assert error.startswith("Request timed out: its deadline passed while it was running"), error
    finally:
        stream.close()
    assert wait_until(lambda: _metric(server, "tritium:num_requests_timed_out_total") >= before + 2, 10)


def _control(server, action):
    status, body = http_request(f"{server.http_url}/v2/repository/models/llm/{action}", {}, timeout=240)
    assert status == 200, body


def test_unload_lets_running_streams_finish(loaded):
    server = loaded
    stream = StreamCollector(server.grpc_url)
    try:
        for i in range(2):
            stream.send(f"d{i}", grpc_inputs("drain", stream=True, return_num_output_tokens=True,
                                                 sampling={"max_tokens": DRAINED_TOKENS, "ignore_eos": True}))
        assert wait_until(lambda: all(stream.results[f"d{i}"].texts for i in range(2)), 30)
        start = time.monotonic()
        _control(server, "unload")
        # The drain itself reports what was running when it began: the unload call's return
        # races the streams on a fast machine, the log line does not.
        assert wait_until(lambda: "tritium: unload: 2 running requests may finish" in server.log_tail(200), 30), \
            server.log_tail(30)
        for i in range(2):
            try:
                r = stream.wait(f"d{i}", 30)
            except TimeoutError:
                raise AssertionError(f"tokens received: {[sum(r.num_output_tokens) for r in stream.results.values()]}")
            assert r.finals == 1 and sum(r.num_output_tokens) == DRAINED_TOKENS
        assert stream.errors.empty()
        # (tritonserver finalizes a model only once the streams that used it have closed)
        stream.close()
        assert wait_until(lambda: not server.is_ready("llm") and "tritium: unloaded in" in server.log_tail(200), 60)
        assert time.monotonic() - start < 30
        assert "tritium: unload: drained in" in server.log_tail(200)
    finally:
        try:
            stream.close()
        except Exception:  # closed already
            pass
        # Left unloaded: the next test loads the model with its own config anyway, and the
        # `loaded` fixture loads it for any other.


def test_unload_aborts_what_outlives_a_tiny_grace(server):
    model_dir = os.path.join(server.repo, "llm")
    write_config(model_dir, {"model": server.model, **ENGINE_ARGS, "drain_timeout_s": "0.5"})
    _control(server, "load")
    stream = StreamCollector(server.grpc_url)
    try:
        stream.send("t", grpc_inputs("drain", stream=True, sampling=LONG))
        assert wait_until(lambda: stream.results["t"].texts, 30)
        start = time.monotonic()
        _control(server, "unload")
        assert stream.next_error(timeout=10) == ("The model is being unloaded. The request did not "
                                                 "finish within its drain_timeout_s (0.5 s).")
        assert time.monotonic() - start < 5
        assert stream.results["t"].finals == 0
    finally:
        stream.close()
        write_config(model_dir, {"model": server.model, **ENGINE_ARGS})
        _control(server, "load")
    assert _generate(server)[0] == 200
