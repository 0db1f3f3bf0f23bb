"""Several sender threads in the stub (TRITIUM_SENDER_THREADS=4): every stream still gets all of
its text in order and exactly one FINAL, cancellations land whichever thread owns the request,
and a bad request still gets its error while others stream."""
import pytest

from backend import LLM, SamplingParams
from triton_server import (TEST_ENGINE_ARGS, StreamCollector, grpc_inputs, start_server, wait_until,
                           write_model_repository)

PROMPTS = ["Hello world", "The capital of France is", "Once upon a time, in a land far away,"]
MAX_TOKENS = 24
LABELS = {"model": "llm", "version": "1"}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sender_threads")
    repo = write_model_repository(str(tmp / "repo"), {"model": tiny_model, **TEST_ENGINE_ARGS})
    server = start_server(repo, str(tmp / "tritonserver.log"), env={"TRITIUM_SENDER_THREADS": "4"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(tiny_model):
    args = TEST_ENGINE_ARGS
    llm = LLM(tiny_model, dtype=args["dtype"], num_kv_blocks=int(args["num_kv_blocks"]),
              block_size=int(args["block_size"]), max_model_len=int(args["max_model_len"]))
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


def _idle(server) -> bool:
    return (server.metric("vllm:num_requests_running", **LABELS) == 0
            and server.metric("vllm:kv_cache_usage_perc", **LABELS) == 0)


def test_48_streams_over_four_senders_equal_the_offline_engine(server, offline):
    stream = StreamCollector(server.grpc_url)
    try:
        for i in range(48):
            stream.send(f"g{i}", grpc_inputs(PROMPTS[i % 3], stream=True, return_num_output_tokens=True,
                                             sampling={"temperature": 0, "max_tokens": MAX_TOKENS}))
        stream.send("bad", grpc_inputs("x", sampling={"top_p": 1.5}))
        for i in range(48):
            r = stream.wait(f"g{i}", timeout=300)
            assert r.text == offline[PROMPTS[i % 3]], i  # in order: the text is the engine's
            assert sum(r.num_output_tokens) == MAX_TOKENS and (r.finals, r.after_final) == (1, 0), i
        assert "top_p must be in (0, 1], got 1.5." in str(stream.next_error(timeout=30))
        assert stream.errors.empty()
    finally:
        stream.close()


def test_cancellation_lands_on_every_sender(server):
    assert wait_until(lambda: _idle(server), 10)
    aborts = server.metric("vllm:request_success_total", finished_reason="abort", **LABELS)
    stream = StreamCollector(server.grpc_url)
    # Four requests in a row: one for each sender thread.
    for i in range(4):
        stream.send(f"long{i}", grpc_inputs(f"cancel me {i}", stream=True,
                                            sampling={"max_tokens": 1000, "ignore_eos": True}))
    assert wait_until(lambda: all(len(stream.results[f"long{i}"].texts) >= 2 for i in range(4)), 30)
    # The published gauges show them running (they lag the engine by up to 0.2 s).
    assert wait_until(lambda: server.metric("vllm:num_requests_running", **LABELS) == 4, 10)
    stream.close(cancel=True)
    assert wait_until(lambda: _idle(server), 10)
    assert server.metric("vllm:request_success_total", finished_reason="abort", **LABELS) == aborts + 4
