"""Model families through a real tritonserver: one repository serves tiny Mixtral, Qwen2-MoE and
Qwen3-MoE models, a Mistral with a 16-token sliding window (its blocks behind the window given
back as it grows), a Gemma 2 (windows of 16, soft-caps) and a Gemma 3 (each in its own engine
process), with prefix caching and chunked prefill on. Greedy
streams over gRPC (the vLLM backend's request interface) and the OpenAI frontend's completions
give Hugging Face's greedy tokens (float32, CPU), past the windows; the vllm: metrics count each
model's tokens."""
from __future__ import annotations

import concurrent.futures
import json

import pytest
import torch
from tiny_moe import MOE_FAMILIES
from triton_server import (TEST_ENGINE_ARGS, StreamCollector, grpc_inputs, http_request, start_server,
                           wait_until, write_model_repository)

MAX_NEW = 24
# Sliding-window families beside the MoE ones: (build_model spec, seed).
WINDOWED = {"mistral_window": (dict(arch="mistral", sliding_window=16), 12),
            "gemma2": (dict(arch="gemma2", num_hidden_layers=4, attn_logit_softcapping=5.0,
                            final_logit_softcapping=3.0), 13),
            # Gemma 3: local layers rotate with their own base, global ones with linear scaling.
            "gemma3": (dict(arch="gemma3", num_hidden_layers=4, layer_types=[
                "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                    "rope_theta": 1000000.0}}), 14)}
FAMILIES = {**MOE_FAMILIES, **WINDOWED}
DISAGGREGATED = {"llm_prefill": "kv_producer", "llm_decode": "kv_consumer"}
TEXTS = ["The scheduler computes the next word for every user while others run. A client streams",
         "The scheduler computes the next word for every user while others run. A kernel",
         "x", "GPU cache block token stream prefill decode kernel café 日本"]


def _hf_greedy(model_dir: str) -> tuple:
    """(tokenizer, the prompts' token ids, Hugging Face's greedy tokens for each)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.engine.hf_reference import hf_greedy_generate
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    # Eager attention: transformers' default (SDPA) drops Gemma 2's attention soft-cap.
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return tok, prompts, hf_greedy_generate(hf, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def moe_stack(tmp_path_factory):
    """(server, frontend, {family: (model dir, tokenizer, prompts' token ids, HF's greedy tokens)})."""
    from scripts.build_default_model import build_model
    from frontend_server import start_frontend

    tmp = tmp_path_factory.mktemp("families")
    repo, built = str(tmp / "repo"), {}
    for name, (spec, seed) in FAMILIES.items():
        built[name] = build_model(str(tmp / name), seed=seed, **spec)
        write_model_repository(repo, {"model": built[name], **TEST_ENGINE_ARGS, "enable_prefix_caching": "true",
                                      "max_num_batched_tokens": "32"}, name=name)
    # Disaggregated prefill: a prefill and a decode instance of one model, NIXL between them.
    for name, role in DISAGGREGATED.items():
        write_model_repository(repo, {"model": built["qwen3_moe"], **TEST_ENGINE_ARGS, "enable_prefix_caching": "true",
                                      "kv_transfer_config": json.dumps({"kv_connector": "NixlConnector",
                                                                        "kv_role": role})}, name=name)
    # Its entry point: a model that sends each request to the prefill instance, then the decode one.
    for name, prefill in (("llm_disagg", "llm_prefill"), ("llm_disagg_broken", "no_such_model")):
        write_model_repository(repo, {"disaggregated_prefill": json.dumps(
            {"prefill_model": prefill, "decode_model": "llm_decode"})}, name=name)
    # Hugging Face's references are computed while the server loads its models, on one thread:
    # for models this small, threads that wait for each other (on a busy CPU, for whole time
    # slices) cost more than they share.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        starting = pool.submit(start_server, repo, str(tmp / "tritonserver.log"), wait_for="qwen3_moe")
        try:
            models = {name: (model_dir, *_hf_greedy(model_dir)) for name, model_dir in built.items()}
        except BaseException:
            starting.result().stop()
            raise
        finally:
            torch.set_num_threads(threads)
        server = starting.result()
    frontend = start_frontend(server.grpc_url, str(tmp / "frontend.log"), "--model", "qwen3_moe",
                              "--model", "llm_disagg", "--model", "llm_prefill", "--model", "llm_decode")
    yield server, frontend, models
    frontend.stop()
    server.stop_in_background()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_grpc_streams_give_hf_greedy_tokens(moe_stack, family):
    server, _, models = moe_stack
    _, tok, prompts, ref = models[family]
    sampling = {"temperature": 0, "max_tokens": MAX_NEW, "min_tokens": MAX_NEW}
    stream = StreamCollector(server.grpc_url)
    try:
        # All four at once: the two sharing a prefix meet the prefix cache, the 32-token budget
        # chunks the longer prompts beside the others' decodes.
        for i, ids in enumerate(prompts):
            stream.send(f"{family}-{i}", grpc_inputs(input_ids=ids, sampling=sampling, stream=True,
                                                     return_num_output_tokens=True), model=family)
        for i, expected in enumerate(ref):
            got = stream.wait(f"{family}-{i}")
            assert got.finals == 1 and got.after_final == 0
            assert got.text == tok.decode(expected, skip_special_tokens=True), f"{family} prompt {i}"
            assert sum(got.num_output_tokens) == MAX_NEW
    finally:
        stream.close()
    generated = server.metric("vllm:generation_tokens_total", model_name=family)
    assert generated >= MAX_NEW * len(prompts)


def test_openai_completions_give_hf_greedy_tokens(moe_stack):
    _, frontend, models = moe_stack
    _, _, prompts, ref = models["qwen3_moe"]
    assert _completion_ids(frontend, "qwen3_moe", prompts[:2]) == ref[:2]


def _completion_ids(frontend, model: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy OpenAI completions of MAX_NEW tokens each, as token ids (each ended by length)."""
    status, body = http_request(frontend.url + "/v1/completions", {
        "model": model, "prompt": prompts, "max_tokens": MAX_NEW, "min_tokens": MAX_NEW,
        "temperature": 0, "return_tokens_as_token_ids": True, "logprobs": 0})
    assert status == 200, body
    choices = sorted(json.loads(body)["choices"], key=lambda c: c["index"])
    assert [c["finish_reason"] for c in choices] == ["length"] * len(prompts)
    return [[int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] for c in choices]


def test_disaggregated_prefill_through_triton_gives_hf_greedy_tokens(moe_stack):
    """The proxy's two calls over gRPC: the prefill instance computes each prompt (max_tokens=1)
    and returns kv_transfer_params; the decode instance reads the prompt's blocks through NIXL
    and streams HF's greedy tokens; the prefill instance frees its blocks once they are read."""
    server, _, models = moe_stack
    _, tok, prompts, ref = models["qwen3_moe"]
    stream = StreamCollector(server.grpc_url)
    try:
        produced = []
        for i, ids in enumerate(prompts):
            stream.send(f"p{i}", grpc_inputs(input_ids=ids, sampling={
                "temperature": 0, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}),
                model="llm_prefill")
            got = stream.wait(f"p{i}")
            assert got.finals == 1 and len(got.kv_transfer_params) == 1, got
            produced.append(got.kv_transfer_params[0])
            assert produced[-1]["remote_num_tokens"] == len(ids)
        for i, (ids, params) in enumerate(zip(prompts, produced)):
            stream.send(f"d{i}", grpc_inputs(input_ids=ids, stream=True, sampling={
                "temperature": 0, "max_tokens": MAX_NEW, "min_tokens": MAX_NEW, "kv_transfer_params": params}),
                model="llm_decode")
        for i, expected in enumerate(ref):
            got = stream.wait(f"d{i}")
            assert got.finals == 1 and not got.kv_transfer_params
            assert got.text == tok.decode(expected, skip_special_tokens=True), f"prompt {i}"
    finally:
        stream.close()
    # The engine's statistics reach Triton's metrics on a publishing thread's interval. The first
    # two prompts share their opening words: when the first one's blocks are in the decode
    # engine's prefix cache before the second is scheduled, the second needs no read (the
    # connector skips it), so one transfer fewer is right too.
    transfers = lambda: server.metric("tritium:kv_transfers_total", model_name="llm_decode")  # noqa: E731
    assert wait_until(lambda: transfers() >= len(prompts) - 1, 10) and transfers() <= len(prompts), transfers()
    assert server.metric("tritium:kv_transfer_bytes_total", model_name="llm_decode") > 0
    # The idle prefill engine hears of each read and lets the blocks go (back to its prefix cache).
    assert wait_until(lambda: server.metric("vllm:kv_cache_usage_perc", model_name="llm_prefill") == 0, 10)


def test_the_disaggregated_entry_point_routes_prefill_then_decode(moe_stack):
    """One model clients call as any other: it prefills on llm_prefill, decodes on llm_decode
    and streams HF's greedy tokens; a router whose prefill model is missing fails its requests
    clearly."""
    server, _, models = moe_stack
    _, tok, prompts, ref = models["qwen3_moe"]
    stream = StreamCollector(server.grpc_url)
    try:
        before = server.metric("tritium:kv_transfers_total", model_name="llm_decode")
        for i, ids in enumerate(prompts):
            stream.send(f"e{i}", grpc_inputs(input_ids=ids, stream=True, sampling={
                "temperature": 0, "max_tokens": MAX_NEW, "min_tokens": MAX_NEW}), model="llm_disagg")
        for i, expected in enumerate(ref):
            got = stream.wait(f"e{i}")
            assert got.finals == 1 and got.after_final == 0
            assert got.text == tok.decode(expected, skip_special_tokens=True), f"prompt {i}"
        stream.send("broken", grpc_inputs(input_ids=prompts[0], sampling={"max_tokens": 4}), model="llm_disagg_broken")
        error = stream.next_error()
        assert error.startswith("The prefill model no_such_model failed: "), error
    finally:
        stream.close()
    assert wait_until(lambda: server.metric("tritium:kv_transfers_total", model_name="llm_decode") > before, 10)


def test_openai_completions_through_the_disaggregated_entry_point(moe_stack):
    """The OpenAI frontend serves the entry point as any model (its description comes from the
    decode model): completions give HF's greedy tokens."""
    _, frontend, models = moe_stack
    _, _, prompts, ref = models["qwen3_moe"]
    assert _completion_ids(frontend, "llm_disagg", prompts[:2]) == ref[:2]


def test_a_request_cancelled_while_its_blocks_are_read_frees_them_on_both_instances(moe_stack):
    """The proxy's two calls, with the prefill engine stopped between them: the decode instance's
    read cannot end (on a CPU, UCX's reads need the serving side's progress thread), and the
    client cancels the request meanwhile. The decode instance keeps the blocks NIXL may still
    write into; once the prefill engine runs again the read ends, both instances free every block
    and the pair serves HF's greedy tokens."""
    import os
    import signal

    from triton_server import engine_pids, wait_until
    server, _, models = moe_stack
    _, tok, prompts, ref = models["qwen3_moe"]
    ids = tok("A prompt no other test sends, long enough to fill a few blocks of the cache")["input_ids"]
    [pid] = engine_pids(server.proc.pid, "llm_prefill")
    stream = StreamCollector(server.grpc_url)
    cancelled = StreamCollector(server.grpc_url)
    stopped = False
    try:
        stream.send("p", grpc_inputs(input_ids=ids, sampling={
            "temperature": 0, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}),
            model="llm_prefill")
        [params] = stream.wait("p").kv_transfer_params
        reads = server.metric("tritium:kv_transfers_total", model_name="llm_decode")
        os.kill(pid, signal.SIGSTOP)
        stopped = True
        cancelled.send("c", grpc_inputs(input_ids=ids, stream=True, sampling={
            "temperature": 0, "max_tokens": MAX_NEW, "kv_transfer_params": params}), model="llm_decode")
        assert wait_until(lambda: server.metric("tritium:kv_transfers_total", model_name="llm_decode") == reads + 1, 30)
        cancelled.close(cancel=True)
        assert wait_until(lambda: server.metric("vllm:num_requests_running", model_name="llm_decode") == 0
                          and server.metric("vllm:num_requests_waiting", model_name="llm_decode") == 0, 30)
        assert server.metric("vllm:kv_cache_usage_perc", model_name="llm_decode") > 0  # held for the read
        os.kill(pid, signal.SIGCONT)
        stopped = False
        for model in ("llm_decode", "llm_prefill"):
            assert wait_until(lambda: server.metric("vllm:kv_cache_usage_perc", model_name=model) == 0, 30), model
        stream.send("again", grpc_inputs(input_ids=prompts[0], stream=True, sampling={
            "temperature": 0, "max_tokens": MAX_NEW, "min_tokens": MAX_NEW}), model="llm_disagg")
        got = stream.wait("again")
        assert got.finals == 1 and got.text == tok.decode(ref[0], skip_special_tokens=True)
        assert stream.errors.empty()
    finally:
        if stopped:  # a stopped engine would hold the server's shutdown
            os.kill(pid, signal.SIGCONT)
        stream.close()


def test_a_killed_prefill_engine_fails_its_request_clearly_and_the_pair_serves_again(moe_stack):
    """The prefill instance's engine dies while a request waits on it: the request through the
    entry point fails naming the prefill model, the supervisor restarts that engine, and the pair
    serves HF's greedy tokens again; nothing runs on either instance afterwards and neither holds
    a block."""
    import os
    import signal
    import time

    from triton_server import engine_pids, wait_until
    server, _, models = moe_stack
    _, tok, prompts, ref = models["qwen3_moe"]
    [pid] = engine_pids(server.proc.pid, "llm_prefill")
    stream, killed = StreamCollector(server.grpc_url), False
    try:
        # Stopped first, so that the request is surely inside the prefill engine when it dies.
        os.kill(pid, signal.SIGSTOP)
        stream.send("k", grpc_inputs(input_ids=prompts[0], stream=True, sampling={
            "temperature": 0, "max_tokens": MAX_NEW}), model="llm_disagg")
        time.sleep(1.0)  # the router hands it to llm_prefill within milliseconds
        os.kill(pid, signal.SIGKILL)
        killed = True
        error = stream.next_error()
        # (Had the request come late, it would meet the restart: the same failure, said so.)
        assert error.startswith(("The prefill model llm_prefill failed: The engine process exited unexpectedly",
                                 "The prefill model llm_prefill failed: The engine is restarting")), error
        # Requests meet "the engine is restarting" until it serves again.
        assert wait_until(lambda: server.metric("tritium:engine_restarts_total", model_name="llm_prefill") == 1, 60)
        for i, ids in enumerate(prompts[:2]):
            stream.send(f"again{i}", grpc_inputs(input_ids=ids, stream=True, sampling={
                "temperature": 0, "max_tokens": MAX_NEW, "min_tokens": MAX_NEW}), model="llm_disagg")
        for i, expected in enumerate(ref[:2]):
            got = stream.wait(f"again{i}", 120)
            assert got.finals == 1 and got.after_final == 0
            assert got.text == tok.decode(expected, skip_special_tokens=True), f"prompt {i}"
        assert stream.errors.empty()
    finally:
        if not killed:  # a stopped engine would hold the server's shutdown
            os.kill(pid, signal.SIGKILL)
        stream.close()
    for model in ("llm_prefill", "llm_decode"):
        assert wait_until(lambda: server.metric("vllm:num_requests_running", model_name=model) == 0, 30), model
    for model in ("llm_decode", "llm_prefill"):
        assert wait_until(lambda: server.metric("vllm:kv_cache_usage_perc", model_name=model) == 0, 30), model


def test_vllms_disaggregation_proxy_flow_through_the_openai_frontend(moe_stack):
    """vLLM's toy proxy over HTTP: the request goes to llm_prefill with max_tokens 1, stream off
    and the proxy's kv_transfer_params, whose response returns the parameters for the decode
    instance; the original request goes to llm_decode with them, which reads the prompt's blocks
    and gives HF's greedy tokens. A chat completion goes the same way; a kv_transfer_params that
    is not an object, or one for several prompts, is a 400 naming it."""
    from transformers import AutoModelForCausalLM

    from tests.engine.hf_reference import hf_greedy_generate
    server, frontend, models = moe_stack
    model_dir, tok, _, _ = models["qwen3_moe"]
    # Prompts no other test sends: blocks in the decode instance's prefix cache are not read.
    prompts = [tok(t)["input_ids"] for t in ("A proxy hands the prompt's blocks from one engine to the next",
                                             "Decode reads what prefill wrote and then streams")]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    ref = hf_greedy_generate(hf, prompts, MAX_NEW)

    def proxied(path: str, request: dict) -> dict:
        # As toy_proxy_server.py, but with a model name per instance (one frontend serves both).
        prefill = {**request, "model": "llm_prefill", "stream": False, "max_tokens": 1, "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}}
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        for name in ("stream_options", "min_tokens", "min_completion_tokens"):
            prefill.pop(name, None)
        status, body = http_request(frontend.url + path, prefill)
        assert status == 200, body
        params = json.loads(body)["kv_transfer_params"]
        assert isinstance(params, dict) and params["do_remote_prefill"] is True, body
        status, body = http_request(frontend.url + path, {**request, "model": "llm_decode",
                                                          "kv_transfer_params": params})
        assert status == 200, body
        reply = json.loads(body)
        assert reply["kv_transfer_params"] is None  # the decode instance returns none
        return reply

    reads = server.metric("tritium:kv_transfers_total", model_name="llm_decode")
    for ids, expected in zip(prompts, ref):
        reply = proxied("/v1/completions", {
            "model": "qwen3_moe", "prompt": ids, "max_tokens": MAX_NEW, "min_tokens": MAX_NEW,
            "temperature": 0, "return_tokens_as_token_ids": True, "logprobs": 0})
        [choice] = reply["choices"]
        assert choice["finish_reason"] == "length"
        assert [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]] == expected
    assert server.metric("tritium:kv_transfers_total", model_name="llm_decode") == reads + len(prompts)
    blocks = server.metric("tritium:kv_transfer_blocks_total", model_name="llm_decode")
    reply = proxied("/v1/chat/completions", {
        "model": "qwen3_moe", "messages": [{"role": "user", "content": "Which engine computed my prompt?"}],
        "temperature": 0, "max_completion_tokens": 8, "min_tokens": 8})
    assert reply["choices"][0]["message"]["content"]
    assert server.metric("tritium:kv_transfer_blocks_total", model_name="llm_decode") > blocks
    for fields, message in (({"prompt": prompts[0], "kv_transfer_params": [1]},
                             "kv_transfer_params: Input should be a valid dictionary"),
                            ({"prompt": prompts, "kv_transfer_params": {"do_remote_decode": True}},
                             "kv_transfer_params is for one prompt, got 2 prompts: send each in a "
                             "request of its own")):
        status, body = http_request(frontend.url + "/v1/completions", {"model": "llm_prefill", **fields})
        assert status == 400, body
        error = json.loads(body)["error"]
        assert (error["message"], error["param"]) == (message, "kv_transfer_params")
