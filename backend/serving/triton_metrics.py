"""Engine statistics as vLLM's Prometheus metrics, for Triton's custom-metrics API.

`MetricsTracker.update(stats)` turns an EngineStats snapshot into metric operations (set a gauge,
increment a counter by the delta since the previous snapshot, observe samples);
`MetricsPublisher` applies them to pb_utils metrics. The names are vLLM's, with the `_total`
suffix its Prometheus client gives counters, so existing dashboards work.
"""
from __future__ import annotations

import collections
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from tritium.engine.metrics import EngineStats


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    description: str
    buckets: tuple[float, ...] = ()


# Bucket bounds as vLLM's.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# vLLM sizes its token-count buckets 1, 2, 5, 10, ... up to max_model_len; these go to 10^6.
_TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(6) for m in (1, 2, 5)) + (1e6,)
_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
# vLLM's buckets for iteration_tokens_total.
_ITERATION_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
                      8192.0, 16384.0)
# vLLM's request_latency_buckets, for the per-request phase times.
_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                  120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    MetricSpec("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    MetricSpec("vllm:num_requests_swapped", "gauge", "Number of requests swapped to CPU."),
    MetricSpec("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    MetricSpec("vllm:gpu_cache_usage_perc", "gauge",
               "KV-cache usage. 1 means 100 percent usage (older name of vllm:kv_cache_usage_perc)."),
    MetricSpec("vllm:prefix_cache_queries_total", "counter",
               "Prefix cache queries, in terms of number of queried tokens."),
    MetricSpec("vllm:prefix_cache_hits_total", "counter",
               "Prefix cache hits, in terms of number of cached tokens."),
    MetricSpec("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions."),
    MetricSpec("vllm:cpu_cache_usage_perc", "gauge",
               "CPU KV-cache usage (swap_space's host blocks). 1 means 100 percent usage."),
    MetricSpec("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts."),
    MetricSpec("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens."),
    MetricSpec("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens."),
    MetricSpec("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
               "Accepted tokens per draft position."),
    MetricSpec("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed."),
    MetricSpec("vllm:generation_tokens_total", "counter", "Number of generation tokens processed."),
    MetricSpec("vllm:request_success_total", "counter",
               "Count of successfully processed requests, by finished_reason."),
    MetricSpec("vllm:time_to_first_token_seconds", "histogram",
               "Histogram of time to first token in seconds.", _TTFT_BUCKETS),
    MetricSpec("vllm:time_per_output_token_seconds", "histogram",
               "Histogram of time per output token in seconds.", _TPOT_BUCKETS),
    MetricSpec("vllm:e2e_request_latency_seconds", "histogram",
               "Histogram of end to end request latency in seconds.", _E2E_BUCKETS),
    MetricSpec("vllm:request_prompt_tokens", "histogram",
               "Number of prefill tokens processed.", _TOKEN_BUCKETS),
    MetricSpec("vllm:request_generation_tokens", "histogram",
               "Number of generation tokens processed.", _TOKEN_BUCKETS),
    MetricSpec("vllm:request_params_n", "histogram", "Histogram of the n request parameter.", _N_BUCKETS),
    MetricSpec("vllm:request_params_max_tokens", "histogram",
               "Histogram of the max_tokens request parameter.", _TOKEN_BUCKETS),
    MetricSpec("vllm:request_queue_time_seconds", "histogram",
               "Histogram of time spent in WAITING phase for request.", _PHASE_BUCKETS),
    MetricSpec("vllm:request_prefill_time_seconds", "histogram",
               "Histogram of time spent in PREFILL phase for request.", _PHASE_BUCKETS),
    MetricSpec("vllm:request_decode_time_seconds", "histogram",
               "Histogram of time spent in DECODE phase for request.", _PHASE_BUCKETS),
    MetricSpec("vllm:request_inference_time_seconds", "histogram",
               "Histogram of time spent in RUNNING phase for request.", _PHASE_BUCKETS),
    MetricSpec("vllm:iteration_tokens_total", "histogram",
               "Histogram of number of tokens per engine_step.", _ITERATION_BUCKETS),
    # With LoRA adapters only, as vLLM's: labels name the adapters of running and of waiting
    # requests and the device's slots; each label set's value is the last time it was current,
    # so the current one is the series of the largest value.
    MetricSpec("vllm:lora_requests_info", "gauge", "Running stats on lora requests."),
    # Tritium's own (vLLM has no names for them).
    MetricSpec("tritium:num_requests_rejected_total", "counter",
               "Requests refused because max_waiting_requests requests were already waiting."),
    MetricSpec("tritium:num_requests_timed_out_total", "counter",
               "Requests ended because their deadline (Triton's request timeout) passed."),
    MetricSpec("tritium:engine_restarts_total", "counter",
               "Engine processes started after the model's first one died."),
    MetricSpec("tritium:num_swapped_preemptions_total", "counter",
               "Preemptions that swapped the request's KV blocks to host memory (of vllm:num_preemptions_total)."),
    MetricSpec("tritium:kv_blocks_swapped_out_total", "counter", "KV cache blocks copied to host memory."),
    MetricSpec("tritium:kv_blocks_swapped_in_total", "counter", "KV cache blocks copied back from host memory."),
    MetricSpec("tritium:kv_transfers_total", "counter",
               "Disaggregated prefill: prompts whose KV blocks this instance read from a prefill instance."),
    MetricSpec("tritium:kv_transfer_blocks_total", "counter", "KV cache blocks read from prefill instances."),
    MetricSpec("tritium:kv_transfer_bytes_total", "counter", "Bytes of KV cache read from prefill instances."),
    MetricSpec("tritium:kv_transfer_seconds_total", "counter",
               "Seconds from the start of each KV read from a prefill instance to its end, summed."),
    MetricSpec("vllm:external_prefix_cache_queries_total", "counter",
               "External prefix cache queries from the prefix cache's host tier, in terms of number "
               "of queried tokens (those the device did not hold)."),
    MetricSpec("vllm:external_prefix_cache_hits_total", "counter",
               "External prefix cache hits from the prefix cache's host tier, in terms of number of "
               "cached tokens (also counted in vllm:prefix_cache_hits_total)."),
    MetricSpec("tritium:kv_blocks_offloaded_total", "counter",
               "KV cache blocks evicted from the device and copied to the prefix cache's host tier."),
    MetricSpec("tritium:kv_blocks_reloaded_total", "counter",
               "KV cache blocks copied back from the prefix cache's host tier for a prefix hit."),
)
LORA_INFO = "vllm:lora_requests_info"
# Finish reasons that get a request_success series from the start, so that rates are defined.
FINISH_REASONS = ("stop", "length", "abort")

# (metric name, operation "set" | "increment" | "observe", value, extra labels)
MetricOp = tuple[str, str, float, dict[str, str]]
# Histogram samples applied per publish (each is an IPC round trip of the Triton stub, holding
# its GIL from the response sender): the rest wait for the next publish, so that many requests
# finishing together never stall the responses for one long publish.
MAX_OBSERVES_PER_PUBLISH = 256

_GAUGES = (("vllm:num_requests_running", "num_running"), ("vllm:num_requests_waiting", "num_waiting"),
           ("vllm:num_requests_swapped", "num_swapped"),
           ("vllm:kv_cache_usage_perc", "kv_cache_usage"), ("vllm:gpu_cache_usage_perc", "kv_cache_usage"),
           ("vllm:cpu_cache_usage_perc", "cpu_cache_usage"))
_COUNTERS = (("vllm:prefix_cache_queries_total", "prefix_cache_queries"),
             ("vllm:prefix_cache_hits_total", "prefix_cache_hits"),
             ("vllm:num_preemptions_total", "num_preemptions"),
             ("vllm:spec_decode_num_drafts_total", "spec_decode_num_drafts"),
             ("vllm:spec_decode_num_draft_tokens_total", "spec_decode_num_draft_tokens"),
             ("vllm:spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens"),
             ("vllm:prompt_tokens_total", "prompt_tokens"),
             ("vllm:generation_tokens_total", "generation_tokens"),
             ("tritium:num_requests_rejected_total", "num_requests_rejected"),
             ("tritium:num_requests_timed_out_total", "num_requests_timed_out"),
             ("tritium:num_swapped_preemptions_total", "num_swapped_preemptions"),
             ("tritium:kv_blocks_swapped_out_total", "num_blocks_swapped_out"),
             ("tritium:kv_blocks_swapped_in_total", "num_blocks_swapped_in"),
             ("vllm:external_prefix_cache_queries_total", "external_prefix_cache_queries"),
             ("vllm:external_prefix_cache_hits_total", "external_prefix_cache_hits"),
             ("tritium:kv_blocks_offloaded_total", "num_blocks_offloaded"),
             ("tritium:kv_blocks_reloaded_total", "num_blocks_reloaded"),
             ("tritium:kv_transfers_total", "kv_transfers"),
             ("tritium:kv_transfer_blocks_total", "kv_transfer_blocks"),
             ("tritium:kv_transfer_bytes_total", "kv_transfer_bytes"),
             ("tritium:kv_transfer_seconds_total", "kv_transfer_seconds"))
_HISTOGRAMS = (("vllm:time_to_first_token_seconds", "time_to_first_token"),
               ("vllm:time_per_output_token_seconds", "time_per_output_token"),
               ("vllm:e2e_request_latency_seconds", "e2e_request_latency"),
               ("vllm:request_prompt_tokens", "request_prompt_tokens"),
               ("vllm:request_generation_tokens", "request_generation_tokens"),
               ("vllm:request_params_n", "request_params_n"),
               ("vllm:request_params_max_tokens", "request_params_max_tokens"),
               ("vllm:request_queue_time_seconds", "request_queue_time"),
               ("vllm:request_prefill_time_seconds", "request_prefill_time"),
               ("vllm:request_decode_time_seconds", "request_decode_time"),
               ("vllm:request_inference_time_seconds", "request_inference_time"),
               ("vllm:iteration_tokens_total", "iteration_tokens"))


class MetricsTracker:
    """Remembers the previous snapshot's counters, so each update increments by the delta."""

    def __init__(self) -> None:
        self._counters: dict[str, float] = {}
        self._generation = 0

    def update(self, stats: EngineStats) -> list[MetricOp]:
        """stats may carry `engine_restarts` and `engine_generation` (EngineSupervisor sets
        them): a new engine's counters start from zero, and count on from there."""
        generation = getattr(stats, "engine_generation", 0)
        if generation != self._generation:
            self._generation = generation
            restarts = self._counters.get("tritium:engine_restarts_total", 0.0)
            self._counters = {"tritium:engine_restarts_total": restarts}
        ops: list[MetricOp] = [(name, "set", float(getattr(stats, field)), {})
                               for name, field in _GAUGES]
        ops += self._increment("tritium:engine_restarts_total", "tritium:engine_restarts_total",
                               float(getattr(stats, "engine_restarts", 0)), {})
        for name, field in _COUNTERS:
            ops += self._increment(name, name, float(getattr(stats, field)), {})
        for reason, count in sorted(stats.request_success.items()):
            ops += self._increment(f"vllm:request_success_total/{reason}", "vllm:request_success_total",
                                   float(count), {"finished_reason": reason})
        per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            ops += self._increment(f"{per_pos}/{position}", per_pos, float(count), {"position": str(position)})
        for name, field in _HISTOGRAMS:
            ops += [(name, "observe", float(v), {}) for v in getattr(stats, field)]
        if stats.max_lora:
            ops.append((LORA_INFO, "set", time.time(), {
                "running_lora_adapters": stats.running_lora_adapters,
                "waiting_lora_adapters": stats.waiting_lora_adapters, "max_lora": str(stats.max_lora)}))
        return ops

    def _increment(self, key: str, name: str, total: float, labels: dict[str, str]) -> list[MetricOp]:
        delta = total - self._counters.get(key, 0.0)
        self._counters[key] = total
        # A counter that went backwards means a new engine; Prometheus counters never decrease.
        return [(name, "increment", delta, labels)] if delta > 0 else []


class MetricsPublisher:
    """The pb_utils metric families and metrics of one model instance.

    `pb_utils` is handed in (only model.py imports it). A family must outlive its metrics, so
    `close()` drops the metrics first. Tritonserver 2.51 frees a Prometheus series shared by two
    instances (same name and labels) as soon as either deletes its metric, and the other then
    writes to freed memory and crashes the server; during a reload (poll mode, or loading a
    loaded model) the new instance starts before the old one ends. So an instance creates its
    metrics only while it holds a lock that the previous one releases after deleting its own.
    """

    def __init__(self, pb_utils: Any, labels: dict[str, str], lock_name: str) -> None:
        self._pb = pb_utils
        # model_name: vLLM's label, which its dashboards select on; Triton's model and version stay.
        self._labels = {**labels, "model_name": labels["model"]}
        self._lock = _AbstractSocketLock(lock_name)
        self._tracker = MetricsTracker()
        self._pending: collections.deque[MetricOp] = collections.deque()  # samples not yet observed
        self._families: dict[str, Any] = {}
        self._metrics: dict[tuple, Any] = {}
        self._specs = {spec.name: spec for spec in METRICS}
        self.is_open = False

    def open(self) -> bool:
        """Create the metrics, unless the previous instance still has its own. True when open."""
        if self.is_open or not self._lock.try_acquire():
            return self.is_open
        kinds = {"counter": self._pb.MetricFamily.COUNTER, "gauge": self._pb.MetricFamily.GAUGE,
                 "histogram": self._pb.MetricFamily.HISTOGRAM}
        for spec in METRICS:
            self._families[spec.name] = self._pb.MetricFamily(
                name=spec.name, description=spec.description, kind=kinds[spec.kind])
        for spec in METRICS:
            if spec.name not in ("vllm:request_success_total", LORA_INFO):  # labelled as they come
                self._metric(spec.name, {})
        for reason in FINISH_REASONS:
            self._metric("vllm:request_success_total", {"finished_reason": reason})
        self.is_open = True
        return True

    def publish(self, stats: EngineStats) -> None:
        """Apply a snapshot (after `open()`: the new series count from the engine's start)."""
        assert self.is_open, "publish before open"
        for item in self._tracker.update(stats):
            if item[1] == "observe":
                self._pending.append(item)
            else:
                self._apply(item)
        for _ in range(min(len(self._pending), MAX_OBSERVES_PER_PUBLISH)):
            self._apply(self._pending.popleft())

    def _apply(self, item: MetricOp) -> None:
        name, op, value, extra = item
        getattr(self._metric(name, extra), op)(value)

    def _metric(self, name: str, extra: dict[str, str]) -> Any:
        key = (name, tuple(sorted(extra.items())))
        if key not in self._metrics:
            spec = self._specs[name]
            kwargs = {"buckets": list(spec.buckets)} if spec.kind == "histogram" else {}
            self._metrics[key] = self._families[name].Metric(labels={**self._labels, **extra}, **kwargs)
        return self._metrics[key]

    def close(self) -> None:
        self._pending.clear()  # (samples of an unloading model's last moments)
        self._metrics.clear()
        self._families.clear()
        self.is_open = False
        self._lock.release()


_METRICS_INTERVAL_S = 0.2


class MetricsLoop:
    """A thread that publishes the engine's statistics every interval while the model lives.
    Metrics exist once the previous instance of the model has released its own (a reload)."""

    def __init__(self, pb_utils: Any, labels: dict[str, str], lock_name: str,
                 get_stats: Callable[[], EngineStats], pushed_stats: Callable[[], EngineStats | None]) -> None:
        """get_stats asks the engine (answered between steps); pushed_stats, for `flush`, returns
        what the engine sent ahead of its finished requests without asking."""
        self._pb = pb_utils
        self._publisher = MetricsPublisher(pb_utils, labels, lock_name)
        self._get_stats = get_stats
        self._pushed_stats = pushed_stats
        self._stop = threading.Event()
        # One publish at a time: the loop's and flush()'s (get_stats hands over samples once).
        self._publish_lock = threading.Lock()
        try:  # now, so that the metrics exist when the model reports ready (the loop retries)
            self._publisher.open()
        except pb_utils.TritonModelException:
            pass  # metrics are off: the loop says so and stops
        self._thread = threading.Thread(target=self._loop, name="tritium-metrics")
        self._thread.start()

    def flush(self) -> None:
        """Publish now (from another thread): counters and gauges are current when this returns,
        and histograms too unless over MAX_OBSERVES_PER_PUBLISH samples wait (heavy load), as
        of the engine's last finished request: `pushed_stats`, not an answer from the engine
        (it answers between steps, so a sender waiting for it would hold every stream's
        responses for up to a step)."""
        with self._publish_lock:
            if self._publisher.is_open and not self._stop.is_set():
                stats = self._pushed_stats()
                if stats is not None:
                    self._publisher.publish(stats)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        with self._publish_lock:
            self._publisher.close()

    def _loop(self) -> None:
        pb, waiting_logged = self._pb, False
        while not self._stop.wait(_METRICS_INTERVAL_S):
            try:
                if not self._publisher.open():
                    if not waiting_logged:
                        waiting_logged = True
                        pb.Logger.log_info("tritium: metrics start once the previous "
                                           "instance of the model has unloaded")
                    continue
                with self._publish_lock:
                    self._publisher.publish(self._get_stats())
            except pb.TritonModelException as e:  # e.g. the server runs with --allow-metrics=false
                pb.Logger.log_warn(f"tritium: no metrics: {e}")
                with self._publish_lock:
                    self._publisher.close()
                return
            except Exception:
                pb.Logger.log_error(f"tritium: metrics failed: {traceback.format_exc()}")


class _AbstractSocketLock:
    """A lock between processes of one machine: a bound abstract Unix socket. The kernel frees it
    when its process exits, however it exits, and it leaves no file behind."""

    def __init__(self, name: str) -> None:
        self._address = "\0" + name
        self._sock: socket.socket | None = None

    def try_acquire(self) -> bool:
        if self._sock is not None:
            return True
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self._address)
        except OSError:
            sock.close()
            return False
        self._sock = sock
        return True

    def release(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
