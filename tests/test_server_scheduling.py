"""Engine arguments that shape serving, through the real server: scheduling_policy="priority"
runs waiting requests in priority order (the `priority` of sampling_parameters, lower first),
stream_interval groups the streamed tokens, and speculative_config (a draft model) gives plain
greedy decoding's text with proposals verified."""
import json

import pytest

from triton_server import TEST_ENGINE_ARGS, StreamCollector, grpc_inputs, start_server, wait_until, write_model_repository

INTERVAL = 4
BLOCKER_TOKENS = 1000  # ~2 s on a CPU: the others queue up behind it meanwhile


@pytest.fixture(scope="module")
def priority_server(tiny_model, tmp_path_factory):
    """One server for the module's two models, which load side by side: "llm" schedules by
    priority, "spec" decodes speculatively (spec_server)."""
    tmp = tmp_path_factory.mktemp("priority")
    repo = str(tmp / "repo")
    # One sequence at a time, so that the order requests run in is the order they finish in.
    write_model_repository(repo, {"model": tiny_model, **TEST_ENGINE_ARGS, "max_num_seqs": "1",
                                  "scheduling_policy": "priority", "stream_interval": str(INTERVAL)})
    # A draft model (the target as its own: every proposal right) through config.pbtxt.
    write_model_repository(repo, {"model": tiny_model, **TEST_ENGINE_ARGS, "speculative_config": json.dumps(
        {"model": tiny_model, "num_speculative_tokens": 3})}, name="spec")
    server = start_server(repo, str(tmp / "tritonserver.log"), wait_for="spec")
    yield server
    server.stop_in_background()


def test_waiting_requests_run_in_priority_order(priority_server):
    stream = StreamCollector(priority_server.grpc_url)
    try:
        stream.send("blocker", grpc_inputs("hold the only slot", stream=True,
                                           sampling={"max_tokens": BLOCKER_TOKENS, "ignore_eos": True}))
        assert wait_until(lambda: stream.results["blocker"].texts, 30)
        for name, priority in (("p2", 2), ("p0", 0), ("p1", 1), ("p0-later", 0)):
            stream.send(name, grpc_inputs(f"request {name}", stream=True,
                                          sampling={"max_tokens": 8, "ignore_eos": True, "priority": priority}))
        for name in ("blocker", "p0", "p0-later", "p1", "p2"):
            stream.wait(name)
        assert stream.results["blocker"].finals == 1, "the blocker ended before the others queued"
        # Lower priority first; equal priorities in arrival order; the running one is not preempted.
        assert stream.finish_order == ["blocker", "p0", "p0-later", "p1", "p2"]
        assert stream.errors.empty()
    finally:
        stream.close()


def test_stream_interval_groups_streamed_tokens(priority_server):
    stream = StreamCollector(priority_server.grpc_url)
    try:
        stream.send("s", grpc_inputs("group these", stream=True, return_num_output_tokens=True,
                                     sampling={"max_tokens": 30, "ignore_eos": True}))
        counts = stream.wait("s").num_output_tokens
    finally:
        stream.close()
    assert sum(counts) == 30
    # The first token goes at once; then at least INTERVAL per response (more when the sender
    # fell behind and folded two), the rest with the finish.
    assert (counts[0] == 1 or counts[0] >= 1 + INTERVAL) and all(n >= INTERVAL for n in counts[1:-1])
    assert 1 < len(counts) <= 1 + -(-(30 - 1) // INTERVAL)


@pytest.fixture(scope="module")
def spec_server(priority_server):
    """The server whose model "spec" has a draft model."""
    return priority_server


def test_speculative_decoding_gives_plain_greedy_text(spec_server, llm_server):
    prompt = "the cache keeps the blocks and the cache keeps the blocks and the cache keeps the"
    sampling = {"max_tokens": 40, "ignore_eos": True, "temperature": 0}
    texts = []
    for server, model in ((spec_server, "spec"), (llm_server, "llm")):
        stream = StreamCollector(server.grpc_url)
        try:
            stream.send("g", grpc_inputs(prompt, stream=True, sampling=sampling), model=model)
            texts.append("".join(stream.wait("g").texts))
            assert stream.errors.empty()
        finally:
            stream.close()
    assert texts[0] == texts[1] and texts[0]
    labels = {"model": "spec", "version": "1"}
    assert wait_until(lambda: spec_server.metric("vllm:spec_decode_num_drafts_total", **labels) > 0, 5)
    proposed = spec_server.metric("vllm:spec_decode_num_draft_tokens_total", **labels)
    assert proposed == spec_server.metric("vllm:spec_decode_num_accepted_tokens_total", **labels) > 0
    assert spec_server.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0", **labels) > 0
