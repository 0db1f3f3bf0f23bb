"""Issue 24: "a model can stay in UNLOADING forever" after client-cancelled streams. Rounds of
gRPC streams that finish, are cancelled, or whose client goes away without a word, and HTTP
streams whose client disconnects, interleaved with unloads and loads: every unload must complete
within a bound and leave no process, shared-memory region or server thread behind. CI runs two
rounds; `make test-long` runs ten, or TRITIUM_STRESS_ROUNDS (e.g. 300; TRITIUM_STRESS_SECONDS
bounds it in time), and TRITIUM_STRESS_REPORT=<path> writes its report as JSON after every round. Models are loaded and
unloaded over gRPC (docs/operations.md, "Reloading", says why not HTTP)."""
import json
import os
import random
import socket
import statistics
import time

import pytest
import tritonclient.grpc as grpcclient

from triton_server import (TEST_ENGINE_ARGS, StreamCollector, descendants, grpc_inputs, http_request,
                           start_server, stub_pids, wait_until, write_model_repository)

CI_ROUNDS = 2
LONG_ROUNDS = int(os.environ.get("TRITIUM_STRESS_ROUNDS", "10"))
BUDGET_S = float(os.environ.get("TRITIUM_STRESS_SECONDS", "inf"))  # stop starting rounds after this
REPORT = os.environ.get("TRITIUM_STRESS_REPORT")
DRAIN_S = 2.0
UNLOAD_BOUND_S = DRAIN_S + 25.0  # the drain, then finalize's bounded steps, on a busy CPU
# Server threads may vary a little with gRPC's pollers; a leak grows by rounds, not by a few.
THREAD_SLACK = 8


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unload_stress")
    repo = write_model_repository(str(tmp / "repo"), {"model": tiny_model, **TEST_ENGINE_ARGS,
                                                     "drain_timeout_s": str(DRAIN_S)})
    srv = start_server(repo, str(tmp / "tritonserver.log"), "--model-control-mode=explicit",
                       "--load-model=llm")
    yield srv
    srv.stop_in_background()


def _shm_regions(pids: list[int]) -> set[str]:
    """The shared-memory files these processes have mapped (the python backend's regions)."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
                found |= {line.split()[-1] for line in f if "/dev/shm/" in line}
        except OSError:
            continue
    return found


def _status(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {"threads": int(fields["Threads"]), "rss_kib": int(fields["VmRSS"].split()[0])}


def _control(server, action: str) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        getattr(client, f"{action}_model")("llm")
    finally:
        client.close()


def _http_stream_that_leaves(server, max_tokens: int) -> socket.socket:
    """A generate_stream request whose client reads the first event; the caller closes it."""
    body = json.dumps({"text_input": "leave", "stream": True,
                       "parameters": {"max_tokens": max_tokens, "ignore_eos": True}}).encode()
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
    sock.sendall(b"POST /v2/models/llm/generate_stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    got = b""
    while b"data:" not in got:
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk
    return sock


def _round(server, rng: random.Random) -> dict:
    finishing = StreamCollector(server.grpc_url)
    cancelled = StreamCollector(server.grpc_url)
    gone = grpcclient.InferenceServerClient(server.grpc_url)
    gone.start_stream(callback=lambda result, error: None)
    streams = rng.randint(1, 4)
    for i in range(streams):
        finishing.send(f"f{i}", grpc_inputs("finish", stream=True, sampling={"max_tokens": rng.randint(1, 60)}))
        cancelled.send(f"c{i}", grpc_inputs("cancel", stream=True, sampling={"max_tokens": 1000, "ignore_eos": True}))
        gone.async_stream_infer("llm", grpc_inputs("gone", stream=True,
                                                   sampling={"max_tokens": 1000, "ignore_eos": True}),
                                request_id=f"g{i}", enable_empty_final_response=True)
    leaving = [_http_stream_that_leaves(server, 1000) for _ in range(rng.randint(1, 2))]
    time.sleep(rng.uniform(0.0, 0.5))
    regions = _shm_regions(descendants(server.proc.pid))
    assert regions, "the model instance maps no shared memory: nothing to check"
    cancelled.close(cancel=True)
    gone.close()  # the channel goes away without cancelling its stream
    for sock in leaving:
        sock.close()
    start = time.monotonic()
    _control(server, "unload")
    finishing.close()
    assert wait_until(lambda: not stub_pids(server.proc.pid) and not server.is_ready("llm"), UNLOAD_BOUND_S)
    took = time.monotonic() - start
    assert took < UNLOAD_BOUND_S, f"unload took {took:.1f} s"
    # Everything the instance had is gone: its processes and its shared memory.
    assert wait_until(lambda: not descendants(server.proc.pid), 10), descendants(server.proc.pid)
    assert wait_until(lambda: not any(os.path.exists(r) for r in regions), 10), regions
    unloaded = _status(server.proc.pid)
    _control(server, "load")
    return {"streams": 3 * streams + len(leaving), "unload_s": took, **unloaded}


def _summary(rounds: list[dict], wall_s: float) -> dict:
    unload_s = sorted(r["unload_s"] for r in rounds)
    return {"rounds": len(rounds), "streams": sum(r["streams"] for r in rounds), "wall_s": round(wall_s, 1),
            "unload_s_median": statistics.median(unload_s),
            "unload_s_p99": unload_s[min(len(unload_s) - 1, int(0.99 * len(unload_s)))],
            "unload_s_max": unload_s[-1], "bound_s": UNLOAD_BOUND_S,
            "server_threads_unloaded_first_last": [rounds[0]["threads"], rounds[-1]["threads"]],
            "server_rss_kib_unloaded_first_last": [rounds[0]["rss_kib"], rounds[-1]["rss_kib"]]}


def _stress(server, wanted: int) -> None:
    rng = random.Random(24)
    started = time.monotonic()
    rounds: list[dict] = []
    while len(rounds) < wanted and time.monotonic() - started < BUDGET_S:
        rounds.append(_round(server, rng))
        if REPORT:  # after every round: a run cut short still leaves its report
            with open(REPORT, "w", encoding="utf-8") as f:
                json.dump({"summary": _summary(rounds, time.monotonic() - started), "rounds": rounds}, f, indent=1)
    summary = _summary(rounds, time.monotonic() - started)
    print(json.dumps(summary))
    # Server threads between loads do not grow with the rounds.
    assert rounds[-1]["threads"] <= rounds[0]["threads"] + THREAD_SLACK, summary
    status, body = http_request(f"{server.http_url}/v2/models/llm/generate",
                                {"text_input": "after", "max_tokens": 4})
    assert status == 200, body


def test_unloads_complete_whatever_the_clients_do(server):
    _stress(server, CI_ROUNDS)


@pytest.mark.long
def test_unloads_complete_over_many_rounds(server):
    _stress(server, LONG_ROUNDS)
