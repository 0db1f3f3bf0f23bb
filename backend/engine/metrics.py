"""Engine statistics for metrics endpoints (vLLM's metric names map one to one)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class EngineStats:
    """A snapshot. Gauges are current; counters are cumulative since engine start; the latency
    lists hold the samples observed since the previous `get_stats()` call (one consumer)."""

    num_running: int = 0
    num_waiting: int = 0  # swapped ones not included (vLLM's: they are num_swapped)
    num_swapped: int = 0  # preempted by swap: waiting with their KV blocks in host memory
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use by running requests
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found, on the device or in the host tier
    num_preemptions: int = 0
    # Preemption by swap (swap_space): the host pool's usage (vLLM's cpu_cache_usage_perc), KV
    # blocks copied to host memory and back, and preemptions that swapped (of num_preemptions).
    cpu_cache_usage: float = 0.0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    num_swapped_preemptions: int = 0
    # The prefix cache's host tier (swap_space with prefix caching), counted as vLLM counts a KV
    # connector's: prompt tokens looked up there (those the device did not hold) and found there
    # (also a part of prefix_cache_hits); evicted device blocks copied to it, and hits copied back.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    num_blocks_offloaded: int = 0
    num_blocks_reloaded: int = 0
    # Disaggregated prefill, on a consumer: reads of prompts' blocks from a producer, the blocks
    # and bytes read, and the seconds from each read's start to its end.
    kv_transfers: int = 0
    kv_transfer_blocks: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    prompt_tokens: int = 0  # whole prompts of requests that produced a token (as vLLM counts)
    generation_tokens: int = 0
    request_success: dict[str, int] = field(default_factory=dict)  # finish reason -> count
    # Overload control and deadlines: requests refused because max_waiting_requests were waiting
    # (counted by the driver that refused them), and requests ended by their deadline (also
    # counted in request_success as "abort").
    num_requests_rejected: int = 0
    num_requests_timed_out: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    time_per_output_token: list[float] = field(default_factory=list)  # per decode step of a request
    e2e_request_latency: list[float] = field(default_factory=list)
    # One sample per finished request (vLLM V1's per-request histograms).
    request_prompt_tokens: list[int] = field(default_factory=list)
    request_generation_tokens: list[int] = field(default_factory=list)  # over its n samples
    request_params_n: list[int] = field(default_factory=list)
    request_params_max_tokens: list[int] = field(default_factory=list)  # max_model_len when unset
    request_queue_time: list[float] = field(default_factory=list)  # arrival -> first scheduled
    request_prefill_time: list[float] = field(default_factory=list)  # first scheduled -> first token
    request_decode_time: list[float] = field(default_factory=list)  # first token -> last token
    request_inference_time: list[float] = field(default_factory=list)  # first scheduled -> last token
    # One sample per engine step that brought results: the prompt and generation tokens it added
    # to prompt_tokens + generation_tokens (vLLM's iteration_tokens_total).
    iteration_tokens: list[int] = field(default_factory=list)
    # Speculative decoding (vLLM's spec_decode counters, counted by backend/spec_decode/metrics.py):
    # verification steps of a sequence with proposed tokens, tokens proposed, and proposed tokens accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # Proposals accepted by their position in the run (vLLM's num_accepted_tokens_per_pos): entry
    # j counts runs that kept proposal j.
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # LoRA (vLLM's lora_requests_info): device slots (0: no LoRA), and the adapters of running
    # and of waiting requests, comma-separated.
    max_lora: int = 0
    running_lora_adapters: str = ""
    waiting_lora_adapters: str = ""

    # The sample lists `LLMEngine.get_stats()` hands over and starts again.
    SAMPLE_FIELDS = ("time_to_first_token", "time_per_output_token", "e2e_request_latency",
                     "request_prompt_tokens", "request_generation_tokens", "request_params_n",
                     "request_params_max_tokens", "request_queue_time", "request_prefill_time",
                     "request_decode_time", "request_inference_time", "iteration_tokens")

    def merged_after(self, older: "EngineStats") -> "EngineStats":
        """This snapshot (the newer: its gauges and counters) with `older`'s samples first."""
        for name in self.SAMPLE_FIELDS:
            setattr(self, name, getattr(older, name) + getattr(self, name))
        return self


class StatsMailbox:
    """Engine statistics as they come from the engine loop: answers to GetStats, and the
    snapshots the loop sends ahead of outputs that finish requests. Snapshots not yet taken
    merge (the newest gauges and counters, every latency sample), so none is lost."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._stats: EngineStats | None = None
        self._arrived = 0

    def put(self, stats: EngineStats) -> None:
        with self._cond:
            self._stats = stats if self._stats is None else stats.merged_after(self._stats)
            self._arrived += 1
            self._cond.notify_all()

    def take(self) -> EngineStats | None:
        """What arrived since the last take, without asking the engine (None: nothing)."""
        with self._cond:
            stats, self._stats = self._stats, None
            return stats

    def ask(self, send: Callable[[], None], stopped: Callable[[], bool], timeout: float | None) -> EngineStats | None:
        """`send` a GetStats, wait for a snapshot that arrives after it (or `stopped()`), take."""
        with self._cond:
            before = self._arrived
        send()
        with self._cond:
            self._cond.wait_for(lambda: self._arrived > before or stopped(), timeout)
            stats, self._stats = self._stats, None
            return stats

    def wake(self) -> None:
        """Wake an `ask` waiting for an engine that stopped."""
        with self._cond:
            self._cond.notify_all()
