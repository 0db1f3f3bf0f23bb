"""Issue 24: "a model can stay in UNLOADING forever" after client-cancelled streams. Rounds of
streams that finish, are cancelled, or whose client goes away without a word, interleaved with
unloads and loads: every unload must complete within a bound. CI runs a few rounds;
TRITIUM_STRESS_ROUNDS=50 runs a longer one."""
import os
import random
import time

import pytest
import tritonclient.grpc as grpcclient

from test_server_reload import _stubs
from triton_server import (TEST_ENGINE_ARGS, StreamCollector, grpc_inputs, http_request, start_server,
                           wait_until, write_model_repository)

ROUNDS = int(os.environ.get("TRITIUM_STRESS_ROUNDS", "3"))
DRAIN_S = 2.0
UNLOAD_BOUND_S = DRAIN_S + 25.0  # the drain, then finalize's bounded steps, on a busy CPU


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unload_stress")
    repo = write_model_repository(str(tmp / "repo"), {"model": tiny_model, **TEST_ENGINE_ARGS,
                                                     "drain_timeout_s": str(DRAIN_S)})
    srv = start_server(repo, str(tmp / "tritonserver.log"), "--model-control-mode=explicit",
                       "--load-model=llm")
    yield srv
    srv.stop()


def _control(server, action):
    status, body = http_request(f"{server.http_url}/v2/repository/models/llm/{action}", {}, timeout=240)
    assert status == 200, body


def _round(server, rng: random.Random) -> float:
    finishing = StreamCollector(server.grpc_url)
    cancelled = StreamCollector(server.grpc_url)
    gone = grpcclient.InferenceServerClient(server.grpc_url)
    gone.start_stream(callback=lambda result, error: None)
    for i in range(rng.randint(1, 4)):
        finishing.send(f"f{i}", grpc_inputs("finish", stream=True, sampling={"max_tokens": rng.randint(1, 60)}))
        cancelled.send(f"c{i}", grpc_inputs("cancel", stream=True, sampling={"max_tokens": 1000, "ignore_eos": True}))
        gone.async_stream_infer("llm", grpc_inputs("gone", stream=True,
                                                   sampling={"max_tokens": 1000, "ignore_eos": True}),
                                request_id=f"g{i}", enable_empty_final_response=True)
    time.sleep(rng.uniform(0.0, 0.5))
    cancelled.close(cancel=True)
    gone.close()  # the channel goes away without cancelling its stream
    start = time.monotonic()
    status, body = http_request(f"{server.http_url}/v2/repository/models/llm/unload", {}, timeout=UNLOAD_BOUND_S + 30)
    finishing.close()
    assert status == 200, body
    assert wait_until(lambda: not _stubs(server.proc.pid) and not server.is_ready("llm"), UNLOAD_BOUND_S)
    took = time.monotonic() - start
    assert took < UNLOAD_BOUND_S, f"unload took {took:.1f} s"
    _control(server, "load")
    return took


def test_unloads_complete_whatever_the_clients_do(server):
    rng = random.Random(24)
    took = [_round(server, rng) for _ in range(ROUNDS)]
    print(f"{ROUNDS} unloads: longest {max(took):.1f} s")
    status, body = http_request(f"{server.http_url}/v2/models/llm/generate",
                                {"text_input": "after", "max_tokens": 4})
    assert status == 200, body
