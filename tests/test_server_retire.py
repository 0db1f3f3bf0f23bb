"""Issue 24: an unloaded or replaced model instance that Triton keeps alive releases its engine.

Triton 2.51's gRPC frontend holds the first request of each stream until the client closes the
stream, and Triton finalizes an instance only once every request object is gone: a client that
keeps a stream open keeps an unloaded (or reloaded) instance alive. The instance notices by
itself and stops its engine process (on a GPU: its weights and KV cache) and its metrics."""
import os

import pytest

from triton_server import (TEST_ENGINE_ARGS, StreamCollector, engine_pids, grpc_inputs, http_request,
                           start_server, stub_pids, wait_until, write_config, write_model_repository)

ENGINE_ARGS = {**TEST_ENGINE_ARGS, "drain_timeout_s": "1"}
RETIRED = "tritium: unload: no request left; stopping the engine now"


@pytest.fixture
def server(tiny_model, tmp_path):
    repo = write_model_repository(str(tmp_path / "repo"), {"model": tiny_model, **ENGINE_ARGS})
    srv = start_server(repo, str(tmp_path / "tritonserver.log"), "--model-control-mode=explicit",
                       "--load-model=llm")
    srv.repo, srv.model = repo, tiny_model
    yield srv
    srv.stop_in_background()


def _served_one(server) -> StreamCollector:
    """A stream that carried one finished request and stays open."""
    stream = StreamCollector(server.grpc_url)
    stream.send("a", grpc_inputs("hello", stream=True, sampling={"max_tokens": 8}))
    assert stream.wait("a", 60).finals == 1
    return stream


def test_unloaded_instance_stops_its_engine_while_a_stream_stays_open(server):
    pid = server.proc.pid
    stream = _served_one(server)
    running = StreamCollector(server.grpc_url)  # the unload is noticed while a request runs
    try:
        assert len(engine_pids(pid)) == 1
        running.send("long", grpc_inputs("long", stream=True, sampling={"max_tokens": 1000, "ignore_eos": True}))
        assert wait_until(lambda: running.results["long"].texts, 30)
        status, body = http_request(f"{server.http_url}/v2/repository/models/llm/unload", {})
        assert status == 200, body
        assert running.next_error(timeout=30).startswith("The model is being unloaded.")  # after the 1 s drain
        running.close()
        assert wait_until(lambda: not engine_pids(pid), 20), server.log_tail(50)
        assert RETIRED in server.log_tail(200)
        # Triton still holds the instance for the open stream: the stub lives on, idle.
        assert stub_pids(pid) and "tritium: unloaded in" not in server.log_tail(200)
    finally:
        stream.close()
    assert wait_until(lambda: not stub_pids(pid), 30)
    assert "tritium: unloaded in" in server.log_tail(200)


def test_replaced_instance_stops_its_engine_and_metrics_move_on(server):
    pid = server.proc.pid
    stream = _served_one(server)
    try:
        old_engine = engine_pids(pid)
        # A changed config makes the load a reload: a new instance serves, the old one lives on.
        write_config(os.path.join(server.repo, "llm"), {"model": server.model, **ENGINE_ARGS,
                                                        "max_model_len": "512"})
        status, body = http_request(f"{server.http_url}/v2/repository/models/llm/load", {}, timeout=240)
        assert status == 200, body
        assert wait_until(lambda: len(engine_pids(pid)) == 1 and engine_pids(pid) != old_engine, 20), \
            server.log_tail(50)
        assert RETIRED in server.log_tail(200)
        # The new instance publishes vLLM's metrics (the old one held them until it stopped).
        def tokens() -> float | None:
            try:
                return server.metric("vllm:generation_tokens_total", model="llm")
            except KeyError:  # no instance publishes them yet
                return None
        assert wait_until(lambda: tokens() is not None, 10)
        before = tokens()
        status, body = http_request(f"{server.http_url}/v2/models/llm/generate",
                                    {"text_input": "new", "max_tokens": 8, "ignore_eos": True})
        assert status == 200, body
        assert wait_until(lambda: tokens() >= before + 8, 10)
    finally:
        stream.close()
    assert wait_until(lambda: len(stub_pids(pid)) == 1, 30)
