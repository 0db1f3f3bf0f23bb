"""Tritium as a drop-in for Triton's vLLM backend, tried as its CI tries it: its current sample model
repository (a config.pbtxt of only `backend` and `instance_group`, which the backend auto-completes,
and 1/model.json; `backend: "vllm"` changed to "tritium" and the model path to the tiny model) and
its older, fully spelled-out sample, its config keys (REPORT_CUSTOM_METRICS off unless "true"),
load/unload, invalid engine arguments, models and configurations, its messages word for word,
Hugging Face's greedy tokens, per-token TPOT, metrics current at the final response, the health
check."""
import concurrent.futures
import json
import os
import re

import pytest

from triton_server import (TEST_ENGINE_ARGS, StreamCollector, engine_pids, grpc_inputs, http_request,
                           sse_events, start_server, wait_until, write_model_repository)

# The vLLM backend's current sample config.pbtxt (samples/model_repository/vllm_model), verbatim
# but for the backend's name and the license header.
SAMPLE_CONFIG = """
# Note: You do not need to change any fields in this configuration.

backend: "tritium"

# The usage of device is deferred to the vLLM engine
instance_group [
  {
    count: 1
    kind: KIND_MODEL
  }
]
"""
# What its metrics CI (ci/L0_backend_vllm/metrics_test/test.sh) appends to the sample's
# config.pbtxt to turn the vllm: metrics on; without it they are off.
REPORT_CUSTOM_METRICS_TRUE = """
parameters: {
  key: "REPORT_CUSTOM_METRICS"
  value: {
    string_value: "true"
  }
}
"""
# Its older sample (before 0e5b209, Nov 2023), which spelled out what the backend now fills in,
# verbatim but for the backend's name and the license header; and its model.json of then.
OLDER_SAMPLE_CONFIG = """
# Note: You do not need to change any fields in this configuration.

backend: "tritium"

# Disabling batching in Triton, let vLLM handle the batching on its own.
max_batch_size: 0

# We need to use decoupled transaction policy for saturating
# vLLM engine for max throughtput.
# TODO [DLIS:5233]: Allow asynchronous execution to lift this
# restriction for cases there is exactly a single response to
# a single request.
model_transaction_policy {
  decoupled: True
}
# Note: The vLLM backend uses the following input and output names.
# Any change here needs to also be made in model.py
input [
  {
    name: "text_input"
    data_type: TYPE_STRING
    dims: [ 1 ]
  },
  {
    name: "stream"
    data_type: TYPE_BOOL
    dims: [ 1 ]
  },
  {
    name: "sampling_parameters"
    data_type: TYPE_STRING
    dims: [ 1 ]
    optional: true
  }
]

output [
  {
    name: "text_output"
    data_type: TYPE_STRING
    dims: [ -1 ]
  }
]

# The usage of device is deferred to the vLLM engine
instance_group [
  {
    count: 1
    kind: KIND_MODEL
  }
]
"""
OLDER_SAMPLE_MODEL_JSON = {"model": "facebook/opt-125m", "disable_log_requests": "true", "gpu_memory_utilization": 0.5}
PROMPTS = ["The most dangerous animal is", "The capital of France is", "The future of AI is"]


def _model(repo, name, model_json, config=SAMPLE_CONFIG, parameters=None):
    os.makedirs(os.path.join(repo, name, "1"))
    params = "".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n'
                     for k, v in (parameters or {}).items())
    with open(os.path.join(repo, name, "config.pbtxt"), "w", encoding="utf-8") as f:
        f.write(config + params)
    with open(os.path.join(repo, name, "1", "model.json"), "w", encoding="utf-8") as f:
        json.dump(model_json, f)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_backend")
    repo = str(tmp / "repo")
    # The current sample's model.json: only "model" changed (facebook/opt-125m -> the tiny model).
    sample = {"model": tiny_model, "gpu_memory_utilization": 0.1, "enforce_eager": True}
    _model(repo, "vllm_model", sample, config=SAMPLE_CONFIG + REPORT_CUSTOM_METRICS_TRUE)
    # The older sample, config.pbtxt and model.json.
    _model(repo, "vllm_older", {**OLDER_SAMPLE_MODEL_JSON, "model": tiny_model}, config=OLDER_SAMPLE_CONFIG)
    # The vLLM backend's config keys that used to stop the load; REPORT_CUSTOM_METRICS unset.
    _model(repo, "vllm_no_metrics", {**sample, "max_model_len": 512}, parameters={"ENABLE_VLLM_HEALTH_CHECK": "true"})
    _model(repo, "vllm_invalid_1", {**sample, "invalid_attribute": True})
    _model(repo, "vllm_invalid_2", {**sample, "model": "./no/such/model"})
    _model(repo, "vllm_conflict", sample, parameters={"enforce_eager": "false"})
    # Configurations that contradict what the engine needs.
    _model(repo, "vllm_not_decoupled", sample, config=SAMPLE_CONFIG + "model_transaction_policy { decoupled: false }\n")
    _model(repo, "vllm_batching", sample, config=SAMPLE_CONFIG + "max_batch_size: 8\n")
    _model(repo, "vllm_string_stream", sample, config=SAMPLE_CONFIG + 'input [ { name: "stream" '
                                                                      'data_type: TYPE_STRING dims: [ 1 ] } ]\n')
    # The vLLM backend's optional image input, which Tritium does not read.
    _model(repo, "vllm_image", sample, config=SAMPLE_CONFIG + 'input [ { name: "image" data_type: TYPE_STRING '
                                                              'dims: [ -1 ] optional: true } ]\n')
    # A model directory with its own 1/model.py (backend "python") keeps working.
    write_model_repository(repo, {"model": tiny_model, **TEST_ENGINE_ARGS}, name="llm_own", own_model_py=True)
    # The models the tests load and serve are loaded at start-up, side by side (a test's own
    # load of one is then an answer, not a start): each load is seconds of a core.
    srv = start_server(repo, str(tmp / "tritonserver.log"), "--model-control-mode=explicit",
                       *(f"--load-model={m}" for m in ("vllm_model", "vllm_no_metrics", "vllm_older",
                                                       "vllm_image", "llm_own")),
                       wait_for="vllm_model", cwd=str(tmp))
    assert wait_until(lambda: srv.is_ready("vllm_no_metrics"), 120), srv.log_tail()
    yield srv
    srv.stop_in_background()


@pytest.fixture(scope="module")
def hf_greedy(tiny_model):
    """Hugging Face's 16 greedy tokens (EOS does not stop them) and their text, for each prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    out = {}
    for prompt in PROMPTS:
        x = torch.tensor([tok(prompt)["input_ids"]])
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, min_new_tokens=16,
                           do_sample=False, pad_token_id=0)[0, x.shape[1]:].tolist()
        out[prompt] = (y, tok.decode(y, skip_special_tokens=True))
    return out


def _generate(server, model, prompt, **body):
    status, text = http_request(f"{server.http_url}/v2/models/{model}/generate",
                                {"text_input": prompt, "stream": False, **body})
    return status, json.loads(text)


def _metric(server, name, model="vllm_model", **labels):
    return server.metric(name, model=model, version="1", **labels)


def test_the_sample_repository_serves(server):
    """The current sample: the backend filled in the inputs, outputs, decoupled policy and
    max_batch_size that its config.pbtxt leaves out."""
    status, text = http_request(f"{server.http_url}/v2/models/vllm_model/config")
    config = json.loads(text)
    assert status == 200 and config["model_transaction_policy"] == {"decoupled": True}
    assert config["max_batch_size"] == 0 and "input_ids" in [t["name"] for t in config["input"]]
    status, body = _generate(server, "vllm_model", PROMPTS[1], max_tokens=8, temperature=0)
    assert status == 200 and body["text_output"].startswith(PROMPTS[1])  # the prompt comes first
    status, body = _generate(server, "vllm_model", PROMPTS[1], max_tokens=8, temperature=0,
                             exclude_input_in_output=True)
    assert status == 200 and not body["text_output"].startswith(PROMPTS[1])


def test_the_current_sample_streams_hugging_faces_greedy_tokens(server, hf_greedy):
    for prompt in PROMPTS:
        status, text = http_request(f"{server.http_url}/v2/models/vllm_model/generate_stream",
                                    {"text_input": prompt, "stream": True, "return_logprobs": True,
                                     "max_tokens": 16, "ignore_eos": True, "temperature": 0, "logprobs": 0})
        events = sse_events(text)
        assert status == 200 and len(events) >= 2, text  # streamed, not one response
        # logprobs=0: each token's entry holds the sampled token only.
        token_ids = [int(tid) for e in events for step in json.loads(e["logprobs"]) or () for tid in step]
        assert token_ids == hf_greedy[prompt][0]
        assert "".join(e["text_output"] for e in events) == hf_greedy[prompt][1]


def test_the_older_spelled_out_sample_still_serves(server):
    status, text = http_request(f"{server.http_url}/v2/repository/models/vllm_older/load", {}, timeout=240)
    assert status == 200, text
    try:
        status, text = http_request(f"{server.http_url}/v2/models/vllm_older/config")
        config = json.loads(text)  # as declared: text_input and stream stay required
        assert [(t["name"], t["optional"]) for t in config["input"][:3]] == [
            ("text_input", False), ("stream", False), ("sampling_parameters", True)]
        status, body = _generate(server, "vllm_older", PROMPTS[1], max_tokens=8, temperature=0,
                                 exclude_input_in_output=True)
        reference = _generate(server, "vllm_model", PROMPTS[1], max_tokens=8, temperature=0,
                              exclude_input_in_output=True)[1]
        assert status == 200 and body["text_output"] == reference["text_output"]
        log = open(server.log_path, encoding="utf-8").read()
        assert "tritium: ignoring vLLM engine argument disable_log_requests=true" in log
    finally:
        http_request(f"{server.http_url}/v2/repository/models/vllm_older/unload", {})


def test_a_configuration_that_contradicts_the_engine_fails_the_load_naming_the_key(server):
    for model, message in [
            ("vllm_not_decoupled", "model_transaction_policy: the engine streams its responses, so the model "
                                   "must be decoupled: set model_transaction_policy { decoupled: true }"),
            ("vllm_batching", "max_batch_size: the engine batches requests itself (continuous batching), "
                              "so Triton must not: set max_batch_size: 0 or leave it out, got 8."),
            ("vllm_string_stream", "input 'stream': data_type must be TYPE_BOOL, got TYPE_STRING.")]:
        status, text = http_request(f"{server.http_url}/v2/repository/models/{model}/load", {}, timeout=120)
        assert status == 400 and message in text, (model, text)
    assert server.is_ready("vllm_model")


def test_invalid_engine_argument_and_invalid_model_fail_the_load(server):
    expected = {"vllm_invalid_1": "Unknown engine argument 'invalid_attribute'",
                "vllm_invalid_2": "no/such/model' does not exist",
                "vllm_conflict": "engine argument 'enforce_eager' is set differently"}
    # The three loads at once (each fails on its own model; a stub starting for each is most of it).
    with concurrent.futures.ThreadPoolExecutor(len(expected)) as pool:
        answers = dict(zip(expected, pool.map(
            lambda model: http_request(f"{server.http_url}/v2/repository/models/{model}/load", {}, timeout=120),
            expected)))
    for model, message in expected.items():
        status, text = answers[model]
        assert status == 400 and message in text, (model, text)
    assert server.is_ready("vllm_model")  # the others are untouched


def test_a_declared_input_tritium_does_not_read_loads_and_a_request_carrying_it_is_refused(server):
    status, text = http_request(f"{server.http_url}/v2/repository/models/vllm_image/load", {}, timeout=240)
    assert status == 200, text
    try:
        status, body = _generate(server, "vllm_image", PROMPTS[0], max_tokens=4, image=["a.png"])
        assert status == 400 and body["error"].startswith("unexpected input 'image'. Valid inputs: text_input"), body
        assert _generate(server, "vllm_image", PROMPTS[0], max_tokens=4)[0] == 200
        log = open(server.log_path, encoding="utf-8").read()
        assert "tritium: input 'image' is declared, but Tritium does not read it" in log
    finally:
        http_request(f"{server.http_url}/v2/repository/models/vllm_image/unload", {})


def test_tpot_counts_output_tokens_and_metrics_are_current_at_the_last_response(server, hf_greedy):
    """3 prompts x 2 rounds x 16 streamed tokens (Hugging Face's): vLLM records 15 inter-token
    samples per request (90); /metrics read right after the last response already counts every
    request."""
    count = "vllm:time_per_output_token_seconds_count"
    before = {n: _metric(server, n) for n in (count, "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                                               "vllm:request_prompt_tokens_sum", "vllm:iteration_tokens_total_sum")}
    success = _metric(server, "vllm:request_success_total", finished_reason="length")
    for _ in range(2):
        stream = StreamCollector(server.grpc_url)
        try:
            for i, prompt in enumerate(PROMPTS):
                stream.send(str(i), grpc_inputs(prompt, stream=True, sampling={
                    "max_tokens": 16, "ignore_eos": True, "temperature": 0}), model="vllm_model")
            for i, prompt in enumerate(PROMPTS):
                assert stream.wait(str(i)).text == hf_greedy[prompt][1]
        finally:
            stream.close()
    # No waiting: the metrics were published before each final response left.
    assert _metric(server, "vllm:request_success_total", finished_reason="length") == success + 6
    prompt_tokens = _metric(server, "vllm:prompt_tokens_total") - before["vllm:prompt_tokens_total"]
    assert prompt_tokens > 0
    assert _metric(server, "vllm:request_prompt_tokens_sum") - before["vllm:request_prompt_tokens_sum"] == prompt_tokens
    assert _metric(server, count) - before[count] == 90
    assert _metric(server, "vllm:generation_tokens_total") - before["vllm:generation_tokens_total"] == 96
    # Each step's prompt and generation tokens, as vLLM's iteration_tokens_total counts them.
    assert _metric(server, "vllm:iteration_tokens_total_sum") - before["vllm:iteration_tokens_total_sum"] == \
        prompt_tokens + 96


def test_report_custom_metrics_unset_leaves_them_off(server):
    """As the vLLM backend's metrics CI: none without REPORT_CUSTOM_METRICS, on with "true"."""
    assert _generate(server, "vllm_no_metrics", PROMPTS[0], max_tokens=4)[0] == 200
    assert not re.search(r'^vllm:\w+\{[^}]*model="vllm_no_metrics"', server.metrics(), re.M)
    assert _metric(server, "vllm:num_requests_running") == 0  # the other model's are there


def test_messages_are_the_vllm_backends(server):
    """Whole, as its CI compares them (multi_lora_test.py, enabled_stream_test.py); Tritium's
    hint is in the log, after the vLLM backend's line."""
    status, body = _generate(server, "vllm_model", PROMPTS[0], max_tokens=4, lora_name="doll")
    assert status == 400 and body["error"] == "LoRA feature is not enabled.", body
    assert "[vllm] LoRA is not enabled, please restart the backend with LoRA enabled. tritium: set enable_lora" \
        in open(server.log_path, encoding="utf-8").read()
    stream = StreamCollector(server.grpc_url)
    try:
        stream.send("0", grpc_inputs(PROMPTS[0], stream=True, exclude_input_in_output=False), model="vllm_model")
        assert stream.next_error() == \
            "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
    finally:
        stream.close()


def test_cancellation_logs_the_vllm_backends_lines(server):
    stream = StreamCollector(server.grpc_url)
    stream.send("long", grpc_inputs(PROMPTS[2], stream=True, sampling={"max_tokens": 1000, "ignore_eos": True}),
                model="vllm_model")
    assert wait_until(lambda: len(stream.results["long"].texts) >= 3, 60)
    stream.close(cancel=True)
    log = lambda: open(server.log_path, encoding="utf-8").read()  # noqa: E731
    assert wait_until(lambda: "[vllm] Successfully cancelled the request" in log(), 10), server.log_tail()
    assert "[vllm] Cancelling the request" in log()


def test_unload_and_load_again(server):
    status, _ = http_request(f"{server.http_url}/v2/repository/models/vllm_model/unload", {})
    assert status == 200 and wait_until(lambda: not server.is_ready("vllm_model"), 60)
    status, text = http_request(f"{server.http_url}/v2/repository/models/vllm_model/load", {}, timeout=240)
    assert status == 200, text
    assert _generate(server, "vllm_model", PROMPTS[0], max_tokens=4)[0] == 200


def test_a_model_with_its_own_model_py(server):
    status, text = http_request(f"{server.http_url}/v2/repository/models/llm_own/load", {}, timeout=240)
    assert status == 200, text
    try:
        status, body = _generate(server, "llm_own", PROMPTS[0], max_tokens=4, return_num_output_tokens=True)
        assert status == 200 and body["num_output_tokens"] == 4, body
    finally:
        http_request(f"{server.http_url}/v2/repository/models/llm_own/unload", {})


def test_health_check_unloads_a_model_whose_engine_died(server):
    """ENABLE_VLLM_HEALTH_CHECK: the next request is refused with the vLLM backend's words and the
    model is unloaded."""
    pid, = engine_pids(server.proc.pid, "vllm_no_metrics")
    os.kill(pid, 9)

    def dead() -> bool:  # gone, or a zombie its parent has not reaped yet
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return True
    assert wait_until(dead, 10)
    # The adapter notices the death asynchronously: a request that races it fails with the
    # engine's own error; the next ones get the health check's answer.
    errors = [_generate(server, "vllm_no_metrics", PROMPTS[0], max_tokens=4)[1]["error"]]
    if errors[0].startswith(("The engine process exited", "The engine is")):
        errors.append(_generate(server, "vllm_no_metrics", PROMPTS[0], max_tokens=4)[1]["error"])
    assert errors[-1] == "Model is unavailable due to unhealthy vLLM engine", errors
    assert wait_until(lambda: not server.is_ready("vllm_no_metrics"), 60)
    assert server.is_ready("vllm_model")
