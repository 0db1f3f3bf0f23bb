"""The engine's configuration, resolved: typed frozen parts with vLLM's names, one per concern.

`EngineArgs` (config.py) is what a user sets and where every default is written;
`EngineArgs.create_engine_config` resolves it once against the model into an `EngineConfig`, and
each component is built from the parts it needs (docs/architecture.md, "Configuration"). The
parts have no defaults of their own: a part is always made whole by that one resolution.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

@dataclass(frozen=True)
class ModelConfig:
    """The model and how it is loaded; max_model_len resolved against its config.json and
    architecture (the engine's process resolves it, where the model is inspected)."""
    model: str
    tokenizer: str  # the model's directory when `tokenizer` is not set
    dtype: str
    seed: int
    load_format: str
    quantization: str | None  # as set; the worker reads the checkpoint's own (worker/device.py)
    max_model_len: int
    max_logprobs: int
    hf_config: dict[str, Any]


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: its blocks, how many, their dtype and scales, prefix caching."""
    block_size: int
    gpu_memory_utilization: float
    num_kv_blocks: int | None  # None: sized by memory
    enable_prefix_caching: bool
    kv_cache_dtype: str
    k_scale: float
    v_scale: float
    swap_space: float  # GiB of host memory per device for swapped-out blocks; 0: none


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler and the request drivers read (resolved: the token budget is set)."""
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    # While others wait, one prompt's chunk takes at most this many tokens of a step; 0: half
    # the token budget.
    long_prefill_token_threshold: int
    policy: str  # EngineArgs.scheduling_policy
    stream_interval: int
    max_waiting_requests: int | None
    # How a preempted sequence gives up its blocks: "recompute", "swap", or "auto" (swap when
    # recomputing would cost more than one prompt chunk: backend/core/kv_swap.py).
    preemption_mode: str


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    # "uni", "mp", or an Executor subclass's qualified name (`Executor.get_class`)
    distributed_executor_backend: str


@dataclass(frozen=True)
class DeviceConfig:
    device: str  # auto, cpu or cuda; the worker resolves auto (worker/device.py)


@dataclass(frozen=True)
class CompilationConfig:
    """CUDA graphs: none with enforce_eager; prefill graphs up to max_prefill_graph_tokens."""
    enforce_eager: bool
    max_prefill_graph_tokens: int


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA serving (EngineConfig.lora_config is None when enable_lora is off)."""
    lora_modules: dict[str, str]  # adapter name -> directory; empty: adapters come with requests
    max_loras: int | None  # None: one slot per listed adapter (none listed: 1)
    max_lora_rank: int
    max_cpu_loras: int | None  # None: every adapter stays in host memory


# Speculative methods with a model of their own (a draft model, EAGLE heads): the proposer runs
# in the worker, on the target's device, after each step.
DRAFT_METHODS = ("draft_model", "eagle", "eagle3")
SPECULATIVE_METHODS = ("ngram",) + DRAFT_METHODS
_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
              "quantization", "dtype")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: n-gram lookup, a draft model (`model` with the target's
    vocabulary) or EAGLE-1/EAGLE-3 heads (`model` the heads' directory). `draft_model_config`
    is the draft's or head's own ModelConfig, resolved against the target's
    (`with_draft_model_config`); None for n-gram and until resolved."""
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str
    model: str | None
    quantization: str | None
    dtype: str | None  # None: the target's
    draft_model_config: ModelConfig | None

    @property
    def uses_draft_model(self) -> bool:
        return self.method in DRAFT_METHODS

    @property
    def is_eagle(self) -> bool:
        return self.method in ("eagle", "eagle3")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be an object, got {d!r}.")
        unknown = set(d) - set(_SPEC_KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}; valid keys: "
                             f"{', '.join(_SPEC_KEYS)}.")
        model = d.get("model")
        # vLLM's inference: a model without a method is a draft model.
        method = d.get("method") or ("draft_model" if model is not None else "ngram")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not supported; supported: "
                             f"{', '.join(SPECULATIVE_METHODS)}.")
        k = d.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in [1, 16], got {k!r}.")
        if method in DRAFT_METHODS:
            if not isinstance(model, str) or not model:
                raise ValueError(f"speculative_config: method {method!r} needs 'model', the directory of "
                                 f"the {'EAGLE heads' if method != 'draft_model' else 'draft model'}.")
            for key in ("prompt_lookup_max", "prompt_lookup_min"):
                if key in d:
                    raise ValueError(f"speculative_config: {key} is for method 'ngram', not {method!r}.")
            dtype = d.get("dtype")
            if dtype not in (None, "auto", "float32", "bfloat16", "float16"):
                raise ValueError(f"speculative_config: dtype must be auto, float32, bfloat16 or float16, "
                                 f"got {dtype!r}.")
            quantization = d.get("quantization")
            if quantization is not None and not isinstance(quantization, str):
                raise ValueError(f"speculative_config: quantization must be a string, got {quantization!r}.")
            return cls(k, 0, 0, method, model, quantization, None if dtype == "auto" else dtype, None)
        for key in ("model", "quantization", "dtype"):
            if key in d:
                raise ValueError(f"speculative_config: {key} is for a draft model or EAGLE heads, not "
                                 "method 'ngram'.")
        hi, lo = d.get("prompt_lookup_max"), d.get("prompt_lookup_min")
        if hi is None and lo is None:
            hi = lo = 5
        hi = lo if hi is None else hi
        lo = hi if lo is None else lo
        for name, v in (("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {v!r}.")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi}).")
        return cls(k, hi, lo, method, None, None, None, None)


KV_CONNECTORS = ("NixlConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's `kv_transfer_config` for disaggregated prefill: the connector that moves KV blocks
    between engine instances, this instance's role (a producer prefills and keeps a finished
    prompt's blocks for a consumer to read; a consumer reads them instead of prefilling), and
    the connector's own settings (`abort_timeout_s`: how long a producer keeps blocks nobody
    reads)."""
    kv_connector: str
    kv_role: str
    kv_connector_extra_config: dict[str, Any]
    engine_id: str | None

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def abort_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("abort_timeout_s", 480.0))

    @property
    def num_threads(self) -> int | None:
        """UCX workers NIXL splits a read across (vLLM's extra key); None: the transfer's default."""
        return self.kv_connector_extra_config.get("num_threads")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVTransferConfig":
        if not isinstance(d, dict):
            raise ValueError(f"kv_transfer_config must be an object, got {type(d).__name__}.")
        unknown = sorted(set(d) - {"kv_connector", "kv_role", "kv_connector_extra_config", "engine_id"})
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {', '.join(unknown)}.")
        connector, role = d.get("kv_connector"), d.get("kv_role", "kv_both")
        if connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config: kv_connector must be one of {', '.join(KV_CONNECTORS)}, "
                             f"got {connector!r}.")
        if role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, got {role!r}.")
        extra = d.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be an object.")
        timeout = extra.get("abort_timeout_s", 480.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"kv_transfer_config: abort_timeout_s must be a positive number, got {timeout!r}.")
        threads = extra.get("num_threads", 0)
        if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= 64:
            raise ValueError(f"kv_transfer_config: num_threads must be an integer from 0 to 64, got {threads!r}.")
        return cls(connector, role, dict(extra), d.get("engine_id"))


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is built from, resolved (EngineArgs.create_engine_config)."""
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    compilation_config: CompilationConfig
    lora_config: LoRAConfig | None  # None: LoRA is off
    speculative_config: SpeculativeConfig | None  # None: no speculative decoding
    kv_transfer_config: KVTransferConfig | None  # None: no disaggregated prefill


@dataclass(frozen=True)
class ModelLimits:
    """What the architecture says of the sequence lengths it serves (backend/models): the
    longest served exactly when shorter than max_position_embeddings, with why; a LongRoPE
    model's original_max_position_embeddings."""
    context_limit: tuple[int, str] | None
    longrope_original_length: int | None


@dataclass(frozen=True)
class EngineLimits:
    """What the built engine knows that request validation needs: the vocabulary, the most
    tokens the KV cache holds, the EOS ids."""
    vocab_size: int
    kv_capacity_tokens: int
    eos_token_ids: tuple[int, ...]
