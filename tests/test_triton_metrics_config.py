"""EngineStats -> vLLM metric operations, and engine arguments from a model config (no server)."""
import os

import pytest

from tritium.engine.metrics import EngineStats
from tritium.serving.triton_config import engine_args_from_model_config
from tritium.serving.triton_metrics import MAX_OBSERVES_PER_PUBLISH, METRICS, MetricsTracker


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
                                     request_success={"length": 2, "stop": 1},
                                     request_prompt_tokens=[5], request_params_n=[2],
                                     request_decode_time=[0.5, 1.5]))
    assert [op for op in ops if op[1] == "observe"] == [
        ("vllm:request_prompt_tokens", "observe", 5.0, {}), ("vllm:request_params_n", "observe", 2.0, {}),
        ("vllm:request_decode_time_seconds", "observe", 0.5, {}),
        ("vllm:request_decode_time_seconds", "observe", 1.5, {})]
    increments = [op for op in ops if op[1] == "increment"]
    assert increments == [("vllm:prompt_tokens_total", "increment", 5.0, {}),
                          ("vllm:request_success_total", "increment", 1.0, {"finished_reason": "stop"})]


def test_metric_names_are_vllms():
    names = {m.name for m in METRICS}
    assert names == {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total", "vllm:cpu_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "vllm:request_success_total", "vllm:time_to_first_token_seconds",
        "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
        "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_n",
        "vllm:request_params_max_tokens", "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds", "vllm:iteration_tokens_total", "vllm:lora_requests_info",
        # Tritium's own, where vLLM has no name
        "tritium:num_requests_rejected_total", "tritium:num_requests_timed_out_total",
        "tritium:engine_restarts_total", "tritium:num_swapped_preemptions_total",
        "tritium:kv_blocks_swapped_out_total", "tritium:kv_blocks_swapped_in_total",
        "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total", "tritium:kv_blocks_offloaded_total",
        "tritium:kv_blocks_reloaded_total", "tritium:kv_transfers_total", "tritium:kv_transfer_blocks_total",
        "tritium:kv_transfer_bytes_total", "tritium:kv_transfer_seconds_total"}
    for m in METRICS:
        assert (m.kind == "histogram") == bool(m.buckets)
        assert list(m.buckets) == sorted(m.buckets)


def test_a_restarted_engine_counts_on_from_zero():
    from tritium.engine.metrics import EngineStats
    tracker = MetricsTracker()

    def counters(rejected, timed_out, restarts, generation):
        stats = EngineStats(num_requests_rejected=rejected, num_requests_timed_out=timed_out)
        stats.engine_restarts, stats.engine_generation = restarts, generation
        return [op for op in tracker.update(stats) if op[1] == "increment"]

    assert counters(3, 1, 0, 0) == [("tritium:num_requests_rejected_total", "increment", 3.0, {}),
                                    ("tritium:num_requests_timed_out_total", "increment", 1.0, {})]
    # a new engine (generation 1) starts its counts at zero: they add to the series
    assert counters(2, 0, 1, 1) == [("tritium:engine_restarts_total", "increment", 1.0, {}),
                                    ("tritium:num_requests_rejected_total", "increment", 2.0, {})]
    assert counters(2, 0, 1, 1) == []


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


def test_lora_adapters_from_multi_lora_json_or_the_parameter(tmp_path):
    """As Triton's vLLM backend: 1/multi_lora.json next to model.py when enable_lora is on, its
    relative adapter paths taken from the server's working directory (as vLLM takes them); a
    lora_modules parameter's, like `model`'s, from the root."""
    _model_dir(tmp_path)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    version = tmp_path / "llm" / "1"
    version.mkdir(parents=True)
    (version / "multi_lora.json").write_text('{"sql": "a", "doc": "%s"}' % (tmp_path / "b"), encoding="utf-8")
    on = {"model": "m", "enable_lora": "true"}
    args = engine_args_from_model_config(on, str(tmp_path), version_dir=str(version), cwd=str(tmp_path))
    assert args.lora_modules == {"sql": str(tmp_path / "a"), "doc": str(tmp_path / "b")}
    with pytest.raises(ValueError, match="adapter 'sql': directory '/nonexistent/a' does not exist"):
        engine_args_from_model_config(on, str(tmp_path), version_dir=str(version), cwd="/nonexistent")
    # The file is read only with enable_lora; a lora_modules parameter takes its place.
    assert engine_args_from_model_config({"model": "m"}, str(tmp_path), version_dir=str(version)).lora_modules is None
    args = engine_args_from_model_config({**on, "lora_modules": '{"x": "b"}'}, str(tmp_path), version_dir=str(version))
    assert args.lora_modules == {"x": str(tmp_path / "b")}
    with pytest.raises(ValueError, match=r"^enable_lora: no adapters to serve; list them in 1/multi_lora\.json "
                                         r"or a lora_modules parameter\.$"):
        engine_args_from_model_config(on, str(tmp_path), version_dir=str(tmp_path))
    (version / "multi_lora.json").write_text('["a"]', encoding="utf-8")
    with pytest.raises(ValueError, match=r"^lora_modules must map adapter names to directories, got \['a'\]\.$"):
        engine_args_from_model_config(on, str(tmp_path), version_dir=str(version), cwd=str(tmp_path))


@pytest.mark.parametrize("params, message", [
    ({}, "the model configuration needs a 'model' parameter (or 'model' in 1/model.json): the path of "
         "a Hugging Face model directory."),
    ({"model": "m", "max_num_seq": "4"}, "Unknown engine argument 'max_num_seq'. Valid arguments: "),
    ({"model": "m", "block_size": "big"}, "engine argument block_size: cannot parse 'big' as int."),
    ({"model": "missing"}, "model: directory "),
])
def test_bad_engine_arguments(tmp_path, params, message):
    _model_dir(tmp_path)
    with pytest.raises(ValueError) as e:
        engine_args_from_model_config(params, str(tmp_path))
    assert str(e.value).startswith(message)


class _FakeMetric:
    def __init__(self, labels, buckets=None):
        self.labels, self.buckets, self.value, self.observed = labels, buckets, 0.0, []

    def set(self, v):
        self.value = v

    def increment(self, v):
        self.value += v

    def observe(self, v):
        self.observed.append(v)


class _FakePbUtils:
    """Just the parts of triton_python_backend_utils that MetricsPublisher uses."""

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
        created: list = []

        def __init__(self, name, description, kind):
            self.name, self.kind, self.metrics = name, kind, []
            _FakePbUtils.MetricFamily.created.append(self)

        def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' name
            self.metrics.append(_FakeMetric(labels, buckets))
            return self.metrics[-1]


def test_publisher_waits_for_the_previous_instance_and_applies_deltas():
    from tritium.serving.triton_metrics import MetricsPublisher

    labels = {"model": "llm", "version": "1"}
    old = MetricsPublisher(_FakePbUtils, labels, f"tritium-test-{os.getpid()}")
    new = MetricsPublisher(_FakePbUtils, labels, f"tritium-test-{os.getpid()}")
    assert old.open() and not new.open()
    old.close()
    assert new.open()
    families = {f.name: f for f in _FakePbUtils.MetricFamily.created[-len(METRICS):]}
    assert {f.kind for f in families.values()} == {"counter", "gauge", "histogram"}
    new.publish(EngineStats(generation_tokens=7, num_running=2, e2e_request_latency=[0.5],
                            request_success={"stop": 1}))
    assert families["vllm:generation_tokens_total"].metrics[0].value == 7.0
    assert families["vllm:num_requests_running"].metrics[0].value == 2.0
    # vLLM's model_name label beside Triton's model and version (vLLM's dashboards select on it).
    assert families["vllm:num_requests_running"].metrics[0].labels == {**labels, "model_name": "llm"}
    e2e = families["vllm:e2e_request_latency_seconds"].metrics[0]
    assert e2e.observed == [0.5] and e2e.buckets[0] == 0.3
    success = {m.labels["finished_reason"]: m.value for m in families["vllm:request_success_total"].metrics}
    assert success == {"stop": 1.0, "length": 0.0, "abort": 0.0}
    new.publish(EngineStats(generation_tokens=10))
    assert families["vllm:generation_tokens_total"].metrics[0].value == 10.0  # by deltas
    # Histogram samples go at most MAX_OBSERVES_PER_PUBLISH a publish, in order; counters at once.
    new.publish(EngineStats(generation_tokens=11, e2e_request_latency=[float(i) for i in range(600)]))
    assert families["vllm:generation_tokens_total"].metrics[0].value == 11.0
    assert e2e.observed == [0.5] + [float(i) for i in range(MAX_OBSERVES_PER_PUBLISH)]
    new.publish(EngineStats(generation_tokens=11, e2e_request_latency=[1000.0]))
    new.publish(EngineStats(generation_tokens=11))
    assert e2e.observed == [0.5] + [float(i) for i in range(600)] + [1000.0]
    new.close()


def test_lora_requests_info_series_of_the_current_adapters_is_the_latest():
    from tritium.serving.triton_metrics import LORA_INFO, MetricsPublisher

    assert not any(op[0] == LORA_INFO for op in MetricsTracker().update(EngineStats()))  # no LoRA
    publisher = MetricsPublisher(_FakePbUtils, {"model": "llm"}, f"tritium-lora-{os.getpid()}")
    assert publisher.open()
    family = next(f for f in _FakePbUtils.MetricFamily.created[-len(METRICS):] if f.name == LORA_INFO)
    assert family.kind == "gauge" and family.metrics == []  # created when there is something to say
    publisher.publish(EngineStats(max_lora=2, running_lora_adapters="sql", waiting_lora_adapters="doc"))
    publisher.publish(EngineStats(max_lora=2, running_lora_adapters="doc,sql"))
    assert [m.labels for m in family.metrics] == [
        {"model": "llm", "model_name": "llm", "running_lora_adapters": "sql", "waiting_lora_adapters": "doc",
         "max_lora": "2"},
        {"model": "llm", "model_name": "llm", "running_lora_adapters": "doc,sql", "waiting_lora_adapters": "",
         "max_lora": "2"}]
    assert family.metrics[1].value >= family.metrics[0].value > 1.7e9  # times of the updates
    publisher.close()
