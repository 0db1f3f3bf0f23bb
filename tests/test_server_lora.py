"""Multi-LoRA through the real server, as Triton's vLLM backend is set up: `enable_lora` in the
model configuration, the adapters in 1/multi_lora.json (a relative path taken from the
server's working directory, as the vLLM backend takes it), a request's `lora_name` in its sampling parameters. Each request gets the
offline engine's text for its adapter; a name the model does not serve gets a clear error."""
import json
import os
import subprocess
import sys

import pytest

from triton_server import (ROOT, TEST_ENGINE_ARGS, StreamCollector, grpc_inputs, http_request,
                           start_server, wait_until, write_model_repository)

from tests.engine.lora_adapters import write_adapter

PROMPT = "Once upon a time, in a land far away,"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def lora_setup(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_server")
    adapters = {
        "attn": write_adapter(str(tmp / "attn"), tiny_model, ["q_proj", "k_proj", "v_proj", "o_proj"], 8, 16, seed=11),
        "mlp": write_adapter(str(tmp / "mlp"), tiny_model, ["gate_proj", "up_proj", "down_proj"], 8, 16, seed=12),
    }
    repo = write_model_repository(str(tmp / "repo"), {"model": tiny_model, **TEST_ENGINE_ARGS,
                                                      "enable_lora": "true"})
    # One path absolute, one relative to the server's working directory (where the vLLM
    # backend's vLLM looks for it: its CI lists "./weights/loras/GemmaDoll").
    listed = {"attn": adapters["attn"], "mlp": "./" + os.path.relpath(adapters["mlp"], str(tmp))}
    with open(os.path.join(repo, "llm", "1", "multi_lora.json"), "w", encoding="utf-8") as f:
        json.dump(listed, f)
    # Explicit model control, so that the last test can reload the model (new adapters).
    server = start_server(repo, str(tmp / "tritonserver.log"), "--model-control-mode=explicit",
                          "--load-model=llm", cwd=str(tmp))
    server.repo = repo
    yield server, adapters
    server.stop_in_background()


@pytest.fixture(scope="module")
def offline(tiny_model, lora_setup):
    from tritium import LLM, SamplingParams
    args = TEST_ENGINE_ARGS
    llm = LLM(tiny_model, dtype=args["dtype"], num_kv_blocks=int(args["num_kv_blocks"]),
              max_model_len=int(args["max_model_len"]), enable_lora=True, lora_modules=lora_setup[1])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return {name: llm.generate([PROMPT], params, lora_request=name)[0].outputs[0].text
            for name in (None, "attn", "mlp")}


def test_each_request_runs_with_its_adapter(lora_setup, offline):
    server, _ = lora_setup
    assert len(set(offline.values())) == 3  # the adapters change the text
    stream = StreamCollector(server.grpc_url)
    try:
        for name in ("attn", None, "mlp"):
            sampling = {"temperature": 0, "max_tokens": MAX_TOKENS}
            if name is not None:
                sampling["lora_name"] = name
            stream.send(str(name), grpc_inputs(PROMPT, sampling=sampling, stream=True))
        for name in ("attn", None, "mlp"):
            assert stream.wait(str(name)).text == offline[name], name
        assert stream.errors.empty()
    finally:
        stream.close()
    # The HTTP generate endpoint: sampling parameters as top-level keys.
    status, body = http_request(f"{server.http_url}/v2/models/llm/generate",
                                {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                 "lora_name": "mlp", "exclude_input_in_output": True})
    assert status == 200, body
    assert json.loads(body)["text_output"] == offline["mlp"]
    # The command-line client's --lora.
    cli = subprocess.run([sys.executable, "-m", "tritium.client", "--url", server.grpc_url, "--temperature", "0",
                          "--max-tokens", str(MAX_TOKENS), "--lora", "attn", PROMPT],
                         cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == offline["attn"] + "\n"


def test_the_load_generator_spreads_requests_over_adapters(lora_setup, tmp_path):
    server, _ = lora_setup

    def bench(requests: int, names: str, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "benchmarks.loadgen.bench", "--url", server.grpc_url,
                               "--num-requests", str(requests), "--input-len", "8", "--output-len", "4",
                               "--procs", "1", "--warmup", "0", "--no-progress", "--lora-names", names,
                               *extra], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    out = tmp_path / "bench.json"
    run = bench(6, "attn,mlp", "--json", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["summary"]["completed"] == 6 and result["lora_names"] == ["attn", "mlp"]
    # A name the model does not serve fails those requests, with the server's reason.
    run = bench(2, "nope")
    assert run.returncode == 2 and "LoRA nope is not supported, we currently support ['attn', 'mlp']" in run.stdout, run.stdout


def test_lora_requests_info_metric(lora_setup):
    server, _ = lora_setup
    # A series per label set, valued with the last time it was current (vLLM's): the latest one,
    # with every request done, names no adapter. (Which adapters the earlier ones name depends
    # on what the 0.2 s publishes caught running: the engine test checks the names.)
    def lines() -> list[str]:
        return [l for l in server.metrics().splitlines() if l.startswith("vllm:lora_requests_info{")]

    def latest() -> str:
        return max(lines(), key=lambda l: float(l.rsplit(" ", 1)[1]))
    # (published every 0.2 s: the last request may have ended after the last publish)
    assert wait_until(lambda: 'running_lora_adapters=""' in latest(), 10), lines()
    assert 'max_lora="2"' in latest() and 'waiting_lora_adapters=""' in latest()


def test_unknown_adapter_is_a_clear_error(lora_setup, offline):
    """...on that request alone: a stream of another adapter in flight meanwhile ends as it should."""
    server, _ = lora_setup
    stream = StreamCollector(server.grpc_url)
    try:
        stream.send("good", grpc_inputs(PROMPT, stream=True, sampling={
            "temperature": 0, "max_tokens": MAX_TOKENS, "lora_name": "attn"}))
        status, body = http_request(f"{server.http_url}/v2/models/llm/generate",
                                    {"text_input": PROMPT, "max_tokens": 4, "lora_name": "sql"})
        assert stream.wait("good").text == offline["attn"]
        assert stream.errors.empty()
    finally:
        stream.close()
    assert status == 400
    # The vLLM backend's message whole; Tritium's hint goes to the log, after the vLLM backend's line.
    assert json.loads(body)["error"] == "LoRA sql is not supported, we currently support ['attn', 'mlp']"
    assert "[vllm] LoRA sql not found. tritium: lora_name must name one of the model's adapters" in \
        open(server.log_path, encoding="utf-8").read()


@pytest.fixture(scope="module")
def lora_frontend(lora_setup, tmp_path_factory):
    """The OpenAI frontend in front of this server, serving its model under vLLM's
    --served-model-name names (an org/model name first, as Hub ids are)."""
    from frontend_server import start_frontend
    server, _ = lora_setup
    fe = start_frontend(server.grpc_url, str(tmp_path_factory.mktemp("lora_frontend") / "frontend.log"),
                        "--model", "llm", "--served-model-name", "org/tiny-base", "tiny",
                        "--triton-metrics", f"http://127.0.0.1:{server.metrics_port}/metrics")
    yield fe
    fe.stop()


def _cards(url: str) -> list[tuple]:
    """/v1/models' cards as (id, root, parent, max_model_len)."""
    status, body = http_request(url + "/v1/models")
    assert status == 200, body
    return [(c["id"], c["root"], c["parent"], c["max_model_len"]) for c in json.loads(body)["data"]]


def _complete(url: str, model: str, **fields) -> tuple[int, dict]:
    status, body = http_request(url + "/v1/completions", {"model": model, "prompt": PROMPT, "temperature": 0,
                                                         "max_tokens": MAX_TOKENS, **fields}, timeout=120)
    return status, json.loads(body)


def test_the_openai_frontend_serves_the_adapters_as_models(tiny_model, lora_setup, lora_frontend, offline):
    """As vLLM: each served name and each adapter is a model of /v1/models (an adapter's parent
    the first served name), and `model: "<adapter>"` selects the adapter as lora_name does."""
    _, adapters = lora_setup
    url = lora_frontend.url
    assert _cards(url) == [("org/tiny-base", tiny_model, None, 1024), ("tiny", tiny_model, None, 1024),
                           ("attn", adapters["attn"], "org/tiny-base", 1024),
                           ("mlp", adapters["mlp"], "org/tiny-base", 1024)]
    status, body = http_request(url + "/v1/models/org/tiny-base")
    assert status == 200 and json.loads(body)["id"] == "org/tiny-base"
    for model, reported, adapter in (("attn", "attn", "attn"), ("tiny", "org/tiny-base", None),
                                     ("org/tiny-base", "org/tiny-base", None), ("mlp", "mlp", "mlp")):
        status, r = _complete(url, model)
        assert status == 200, r
        assert (r["model"], r["choices"][0]["text"]) == (reported, offline[adapter]), model
    status, r = _complete(url, "tiny", lora_name="mlp")  # the lora_name field still works
    assert (status, r["choices"][0]["text"]) == (200, offline["mlp"])
    # The Triton model's own name is not one of the served names (as vLLM's model path is not).
    assert _complete(url, "llm") == (404, {"error": {"message": "The model `llm` does not exist.", "type":
                                                     "not_found_error", "param": "model", "code": "model_not_found"}})
    status, r = _complete(url, "attn", lora_name="mlp")
    assert (status, r["error"]["message"], r["error"]["param"]) == (
        400, "model names the LoRA adapter 'attn' and lora_name names 'mlp': give one", "lora_name")
    # The vllm: families carry vLLM's model_name label: the served name, Triton's labels kept.
    status, text = http_request(url + "/metrics")
    running = [line for line in text.splitlines() if line.startswith("vllm:num_requests_running{")]
    assert running == ['vllm:num_requests_running{model="llm",model_name="org/tiny-base",version="1"} 0']


def test_responses_take_the_served_names_and_adapters_as_chat_does(lora_frontend):
    """/v1/responses is prepared by the chat path: a served name or an adapter's is its model,
    the adapter applied (each reply is chat's for the same model, and the three differ)."""
    url, replies, max_tokens = lora_frontend.url, {}, 6
    for model, reported in (("attn", "attn"), ("tiny", "org/tiny-base"), ("mlp", "mlp")):
        status, body = http_request(url + "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "max_tokens": max_tokens}, timeout=120)
        assert status == 200, body
        replies[model] = json.loads(body)["choices"][0]["message"]["content"]
        status, body = http_request(url + "/v1/responses", {"model": model, "input": PROMPT, "temperature": 0,
                                                             "max_output_tokens": max_tokens}, timeout=120)
        assert status == 200, body
        r = json.loads(body)
        assert (r["model"], [part["text"] for item in r["output"] for part in item["content"]]) == \
            (reported, [replies[model]]), model
    assert len(set(replies.values())) == 3
    status, body = http_request(url + "/v1/responses", {"model": "llm", "input": PROMPT})
    assert (status, json.loads(body)["error"]["message"]) == (404, "The model `llm` does not exist.")


def test_an_adapter_added_to_multi_lora_json_is_served_after_a_reload(lora_setup, offline, lora_frontend):
    """How an operator adds an adapter without restarting the server: edit multi_lora.json,
    then load the model again (explicit mode; poll mode reloads by itself). The OpenAI frontend
    lists it and serves it then, without a restart either."""
    server, adapters = lora_setup
    body = {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "lora_name": "attn2",
            "exclude_input_in_output": True}
    status, text = http_request(f"{server.http_url}/v2/models/llm/generate", body)
    assert status == 400 and "LoRA attn2 is not supported" in text
    path = os.path.join(server.repo, "llm", "1", "multi_lora.json")
    with open(path, encoding="utf-8") as f:
        listed = json.load(f)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**listed, "attn2": adapters["attn"]}, f)
    status, text = http_request(f"{server.http_url}/v2/repository/models/llm/load", {}, timeout=240)
    assert status == 200, text
    status, text = http_request(f"{server.http_url}/v2/models/llm/generate", body)
    assert status == 200, text
    assert json.loads(text)["text_output"] == offline["attn"]
    status, r = _complete(lora_frontend.url, "attn2")  # an unknown name: the model is asked again
    assert (status, r["model"], r["choices"][0]["text"]) == (200, "attn2", offline["attn"])
    assert [card[0] for card in _cards(lora_frontend.url)] == ["org/tiny-base", "tiny", "attn", "mlp", "attn2"]

