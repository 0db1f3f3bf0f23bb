"""EngineStats -> vLLM metric operations, and engine arguments from a model config (no server)."""
import os

import pytest

from backend.metrics import EngineStats
from backend.triton_config import engine_args_from_model_config
from backend.triton_metrics import METRICS, MetricsTracker


def test_counters_increment_by_deltas_and_gauges_are_set():
    tracker = MetricsTracker()
    ops = tracker.update(EngineStats(num_running=3, num_waiting=1, kv_cache_usage=0.25,
                                     prompt_tokens=10, generation_tokens=4, prefix_cache_queries=10,
                                     request_success={"length": 2}, time_to_first_token=[0.1, 0.2]))
    assert ("vllm:num_requests_running", "set", 3.0, {}) in ops
    assert ("vllm:num_requests_waiting", "set", 1.0, {}) in ops
    assert ("vllm:kv_cache_usage_perc", "set", 0.25, {}) in ops
    assert ("vllm:gpu_cache_usage_perc", "set", 0.25, {}) in ops
    assert ("vllm:prompt_tokens_total", "increment", 10.0, {}) in ops
    assert ("vllm:request_success_total", "increment", 2.0, {"finished_reason": "length"}) in ops
    assert [op for op in ops if op[1] == "observe"] == [
        ("vllm:time_to_first_token_seconds", "observe", 0.1, {}),
        ("vllm:time_to_first_token_seconds", "observe", 0.2, {})]
    assert not any(op[0] == "vllm:prefix_cache_hits_total" for op in ops)  # zero delta: nothing

    ops = tracker.update(EngineStats(prompt_tokens=15, generation_tokens=4,
                                     request_success={"length": 2, "stop": 1}))
    increments = [op for op in ops if op[1] == "increment"]
    assert increments == [("vllm:prompt_tokens_total", "increment", 5.0, {}),
                          ("vllm:request_success_total", "increment", 1.0, {"finished_reason": "stop"})]


def test_metric_names_are_vllms():
    names = {m.name for m in METRICS}
    assert names == {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:request_success_total", "vllm:time_to_first_token_seconds",
        "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds"}
    for m in METRICS:
        assert (m.kind == "histogram") == bool(m.buckets)
        assert list(m.buckets) == sorted(m.buckets)


def _model_dir(tmp_path, name="m"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text("{}", encoding="utf-8")
    return d


def test_engine_args_resolve_relative_paths_against_the_root(tmp_path):
    _model_dir(tmp_path)
    args = engine_args_from_model_config(
        {"model": {"string_value": "m"}, "block_size": {"string_value": "32"},
         "enable_prefix_caching": {"string_value": "false"}, "max_model_len": {"string_value": "128"}},
        str(tmp_path))
    assert args.model == os.path.join(str(tmp_path), "m")
    assert (args.block_size, args.enable_prefix_caching, args.max_model_len) == (32, False, 128)
    absolute = engine_args_from_model_config({"model": str(tmp_path / "m")}, "/nonexistent")
    assert absolute.model == str(tmp_path / "m")


@pytest.mark.parametrize("params, message", [
    ({}, "the model configuration needs a 'model' parameter: the path of a Hugging Face model directory."),
    ({"model": "m", "max_num_seq": "4"}, "Unknown engine argument 'max_num_seq'. Valid arguments: "),
    ({"model": "m", "block_size": "big"}, "engine argument block_size: cannot parse 'big' as int."),
    ({"model": "missing"}, "model: directory "),
])
def test_bad_engine_arguments(tmp_path, params, message):
    _model_dir(tmp_path)
    with pytest.raises(ValueError) as e:
        engine_args_from_model_config(params, str(tmp_path))
    assert str(e.value).startswith(message)
