"""Must-show 6: hot reload. In explicit mode, unload/load cycles with requests in between leave
no threads, stub processes or memory behind (two in CI, ten under `make test-long`); requests in flight at unload each get one FINAL
(an error); a changed engine argument takes effect after a reload, also in poll mode."""
import os
import re

import pytest

from triton_server import (TEST_ENGINE_ARGS, StreamCollector, grpc_inputs, http_request, start_server,
                           stub_pids, wait_until, write_config, write_model_repository)

# The server process may grow a little (allocator pools, gRPC buffers); growth beyond this over
# the cycles would be a leak. Each load starts a fresh stub process, whose memory must not grow
# from one load to the next either. (Measured here: +1 MB over ten cycles.)
RSS_TOLERANCE_MB = 16
THREAD_TOLERANCE = 2
LONG_PROMPT = "word " * 100  # about 100 tokens: fits the served max_model_len, not 64
# The streams in flight at unload must still be running when the unload is noticed (the stub
# looks every 0.25 s): 240 tokens took 0.5 s on a CPU and finished first in CI. 2000 tokens take
# ~4.5 s, and cost nothing when the unload comes in time, as it aborts them.
IN_FLIGHT_TOKENS = 2000
# The tiny model's longest max_model_len; no drain: the unload aborts the streams at once.
ENGINE_ARGS = {**TEST_ENGINE_ARGS, "max_model_len": "2048", "drain_timeout_s": "0"}


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def explicit_server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("explicit")
    repo = write_model_repository(str(tmp / "repo"), {"model": tiny_model, **ENGINE_ARGS})
    server = start_server(repo, str(tmp / "tritonserver.log"), "--model-control-mode=explicit",
                          "--load-model=llm")
    server.repo, server.model = repo, tiny_model
    yield server
    server.stop_in_background()


def _control(server, action: str) -> None:
    status, body = http_request(f"{server.http_url}/v2/repository/models/llm/{action}", {}, timeout=240)
    assert status == 200, body


def _generate(server, prompt: str, max_tokens: int = 8) -> tuple[int, str]:
    return http_request(f"{server.http_url}/v2/models/llm/generate",
                        {"text_input": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                         "exclude_input_in_output": True, "return_num_output_tokens": True})


def _cycle(server, in_flight: int) -> float:
    """Unload with `in_flight` streams running, check each ends once with the unload error and
    the stub exits; load again and serve a request."""
    stream = StreamCollector(server.grpc_url)
    try:
        for i in range(in_flight):
            stream.send(f"f{i}", grpc_inputs("in flight at unload", stream=True,
                                             sampling={"max_tokens": IN_FLIGHT_TOKENS, "ignore_eos": True}))
        assert wait_until(lambda: all(stream.results[f"f{i}"].texts for i in range(in_flight)), 30)
        _control(server, "unload")
        assert all(r.finals == 0 for r in stream.results.values()), "a stream ended before the unload"
        errors = [stream.next_error(timeout=30) for _ in range(in_flight)]
        assert errors == ["The model is being unloaded. The request did not finish within its "
                          "drain_timeout_s (0 s)."] * in_flight
        assert all(r.finals == 0 for r in stream.results.values())  # the error was their FINAL
    finally:
        stream.close()
    assert wait_until(lambda: not stub_pids(server.proc.pid) and not server.is_ready("llm"), 60)
    _control(server, "load")
    stubs = stub_pids(server.proc.pid)
    assert server.is_ready("llm") and len(stubs) == 1
    status, body = _generate(server, "after reload")
    assert status == 200, body
    return _rss_mb(stubs[0])


def _check_cycles(server, cycles: int) -> None:
    pid = server.proc.pid
    first_stub = _cycle(server, in_flight=2)  # warm-up: the server's pools reach their size
    threads, rss = _threads(pid), _rss_mb(pid)
    stub_rss = [_cycle(server, in_flight=2) for _ in range(cycles)]
    grown = _rss_mb(pid) - rss
    print(f"tritonserver after {cycles} cycles: threads {threads} -> {_threads(pid)}, "
          f"RSS {rss:.0f} MB -> {rss + grown:.0f} MB; stub RSS {first_stub:.0f} MB -> {stub_rss[-1]:.0f} MB")
    assert abs(_threads(pid) - threads) <= THREAD_TOLERANCE
    assert grown <= RSS_TOLERANCE_MB
    assert max(stub_rss) - first_stub <= RSS_TOLERANCE_MB
    assert len(stub_pids(pid)) == 1


def test_unload_load_cycles_leave_nothing_behind(explicit_server):
    _check_cycles(explicit_server, 2)


@pytest.mark.long
def test_ten_unload_load_cycles_leave_nothing_behind(explicit_server):
    _check_cycles(explicit_server, 10)


def test_changed_parameter_takes_effect_after_reload(explicit_server):
    model_dir = os.path.join(explicit_server.repo, "llm")
    _control(explicit_server, "load")  # loaded, whatever the test before left behind
    assert _generate(explicit_server, LONG_PROMPT)[0] == 200
    try:
        write_config(model_dir, {"model": explicit_server.model, **ENGINE_ARGS, "max_model_len": "64"})
        _control(explicit_server, "unload")
        # The unload logs where the stub's sender and receiver threads spent their time.
        line = re.compile(r"tritium: sender thread: [1-9]\d* rounds, \d+ streamed responses, [\d.]+ s busy, "
                          r"of which [\d.]+ s in send\(\) and [\d.]+ s publishing metrics before [1-9]\d* rounds with a "
                          r"final response; engine receiver thread: [1-9]\d* messages, "
                          r"[1-9]\d* outputs, [\d.]+ s busy")
        assert wait_until(lambda: line.search(explicit_server.log_tail(400)), 30)
        _control(explicit_server, "load")
        status, body = _generate(explicit_server, LONG_PROMPT)
        assert status == 400 and "but max_model_len is 64" in body
    finally:
        write_config(model_dir, {"model": explicit_server.model, **ENGINE_ARGS})
        _control(explicit_server, "load")  # a loaded model reloads when its config changed
    assert _generate(explicit_server, LONG_PROMPT)[0] == 200


def test_poll_mode_picks_up_an_edited_config(tiny_model, tmp_path):
    repo = write_model_repository(str(tmp_path / "repo"), {"model": tiny_model, **TEST_ENGINE_ARGS})
    server = start_server(repo, str(tmp_path / "tritonserver.log"), "--model-control-mode=poll",
                          "--repository-poll-secs=1")
    try:
        assert _generate(server, LONG_PROMPT)[0] == 200
        write_config(os.path.join(repo, "llm"), {"model": tiny_model, **TEST_ENGINE_ARGS, "max_model_len": "64"})
        assert wait_until(lambda: "but max_model_len is 64" in _generate(server, LONG_PROMPT)[1], 120, 0.25)
        assert server.is_ready("llm")
        assert wait_until(lambda: len(stub_pids(server.proc.pid)) == 1, 30)  # the old stub exits
        # The new instance publishes the metrics (2.51 crashed here when two instances shared
        # a series: see MetricsPublisher).
        assert _generate(server, "after reload", max_tokens=8)[0] == 200
        assert wait_until(lambda: server.metric("vllm:generation_tokens_total", model="llm") >= 8, 10)
        assert server.proc.poll() is None
    finally:
        server.stop_in_background()
