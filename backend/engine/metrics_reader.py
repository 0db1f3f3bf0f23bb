"""The engine's metrics as vLLM's `LLM.get_metrics()` returns them (vllm.v1.metrics.reader):
typed values named as the Prometheus metrics, counters without their `_total` suffix."""
from __future__ import annotations

from dataclasses import dataclass, field

from .metrics import EngineStats


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    """A counter per position (vLLM's spec_decode_num_accepted_tokens_per_pos)."""
    values: list[int] = field(default_factory=list)


def metrics_from_stats(stats: EngineStats) -> list[Metric]:
    """Gauges now and counters since start (latency histograms are served by the servers)."""
    out: list[Metric] = [
        Gauge("vllm:num_requests_running", value=stats.num_running),
        Gauge("vllm:num_requests_waiting", value=stats.num_waiting),
        Gauge("vllm:num_requests_swapped", value=stats.num_swapped),
        Gauge("vllm:kv_cache_usage_perc", value=stats.kv_cache_usage),
        Counter("vllm:num_preemptions", value=stats.num_preemptions),
        Gauge("vllm:cpu_cache_usage_perc", value=stats.cpu_cache_usage),
        Counter("tritium:num_swapped_preemptions", value=stats.num_swapped_preemptions),
        Counter("tritium:kv_blocks_swapped_out", value=stats.num_blocks_swapped_out),
        Counter("tritium:kv_blocks_swapped_in", value=stats.num_blocks_swapped_in),
        Counter("vllm:prompt_tokens", value=stats.prompt_tokens),
        Counter("vllm:generation_tokens", value=stats.generation_tokens),
        Counter("vllm:prefix_cache_queries", value=stats.prefix_cache_queries),
        Counter("vllm:prefix_cache_hits", value=stats.prefix_cache_hits),
        Counter("vllm:external_prefix_cache_queries", value=stats.external_prefix_cache_queries),
        Counter("vllm:external_prefix_cache_hits", value=stats.external_prefix_cache_hits),
        Counter("tritium:kv_blocks_offloaded", value=stats.num_blocks_offloaded),
        Counter("tritium:kv_blocks_reloaded", value=stats.num_blocks_reloaded),
        Counter("vllm:spec_decode_num_drafts", value=stats.spec_decode_num_drafts),
        Counter("vllm:spec_decode_num_draft_tokens", value=stats.spec_decode_num_draft_tokens),
        Counter("vllm:spec_decode_num_accepted_tokens", value=stats.spec_decode_num_accepted_tokens),
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos",
               values=list(stats.spec_decode_num_accepted_tokens_per_pos)),
    ]
    out += [Counter("vllm:request_success", {"finished_reason": reason}, count)
            for reason, count in sorted(stats.request_success.items())]
    return out
