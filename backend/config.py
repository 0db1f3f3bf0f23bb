"""Engine arguments with vLLM's names and meanings, checked when they are made, and their one
resolution into the typed parts of an EngineConfig (engine_config.py). Every default is here."""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, fields, replace
from typing import Any, Callable

from .engine_config import (CacheConfig, CompilationConfig, DeviceConfig, EngineConfig, KVTransferConfig, LoRAConfig, ModelConfig,
                            ModelLimits, ParallelConfig, SchedulerConfig, SpeculativeConfig)

logger = logging.getLogger(__name__)

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_QUALIFIED_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")  # package.module.Class
QUANTIZATIONS = ("fp8", "awq", "gptq")
SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
GIB = 1 << 30
# vLLM's names: auto = the model's dtype; fp8 and fp8_e4m3 = float8 e4m3 with per-tensor scales.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# With no num_kv_blocks on the CPU, the pool takes this many bytes (like vLLM's
# VLLM_CPU_KVCACHE_SPACE, but modest: CPU serving is for tests and tiny models).
CPU_KV_CACHE_BYTES = 512 * 1024 * 1024
# The token budget of a step with chunked prefill, when max_num_batched_tokens is not set.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192



@dataclass
class EngineArgs:
    """Everything that configures an engine. Invalid values raise ValueError naming the argument."""

    model: str
    tokenizer: str | None = None  # defaults to `model`
    dtype: str = "auto"  # auto: the config's dtype on CUDA, float32 on the CPU
    device: str = "auto"  # auto: cuda when available
    seed: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # overrides sizing by memory
    max_model_len: int | None = None  # defaults to the config's max_position_embeddings
    max_num_seqs: int = 256
    # None: DEFAULT_MAX_NUM_BATCHED_TOKENS, and without chunked prefill at least max_model_len.
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Cap on one prompt's chunk per step while other requests wait; 0: half the token budget.
    long_prefill_token_threshold: int = 0
    load_format: str = "auto"  # dummy: random weights of the config's shapes
    enforce_eager: bool = False  # True: no CUDA graphs
    # Prefill-only steps of at most this many tokens (and 8 prompts) replay a CUDA graph, so a
    # lone request's first step costs its GPU work, not hundreds of kernel launches. 0: eager.
    max_prefill_graph_tokens: int = 1024
    max_logprobs: int = 20
    # fp8: FP8 weights (per-channel scales) and per-token dynamic FP8 activations in the decoder's
    # linear layers, quantized at load from a 16-bit checkpoint. Needs compute capability 8.9+.
    # awq / gptq: 4-bit (GPTQ: or 8-bit) weights of an AWQ / GPTQ checkpoint, 16-bit activations
    # (backend/layers/int4.py); a checkpoint's config.json selects these (and fp8) by itself.
    quantization: str | None = None
    # fp8: the KV cache holds float8 e4m3 (half the bytes of bf16: twice the tokens in the same
    # memory, half the reads in decode attention); keys and values are stored divided by the
    # per-tensor scales k_scale and v_scale (vLLM's defaults: 1.0) and widened back in attention.
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0
    # Streamed outputs carry at least this many new tokens (vLLM's name): a request's first token
    # and its last output go out at once, the rest in groups. Larger values mean fewer, larger
    # responses: less work per token for the server when many streams are open.
    stream_interval: int = 1
    # fcfs: first come, first served. priority (vLLM's): waiting requests are admitted by (priority,
    # arrival), a lower value first, and when the KV cache runs out the running request with the
    # highest (priority, arrival) is preempted.
    scheduling_policy: str = "fcfs"
    # LoRA adapters (PEFT directories) served next to the base model, chosen per request by name
    # (`lora_name`); a Triton model lists them in 1/multi_lora.json, as Triton's vLLM backend does.
    # In-process, a request may also bring one: LoRARequest(name, id, path), as in vLLM.
    enable_lora: bool = False
    lora_modules: dict[str, str] | None = None  # adapter name -> directory
    # Adapter slots on the device, i.e. most adapters in one step (vLLM's meaning); default: one
    # per listed adapter (none listed: 1). With fewer, adapters take turns (backend/core/lora_slots.py).
    max_loras: int | None = None
    max_lora_rank: int = 16
    # Adapters kept in host memory (vLLM's name), the least recently used dropped first and read
    # from disk again when needed; default: every adapter. At least max_loras.
    max_cpu_loras: int | None = None
    # Speculative decoding, vLLM's form: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": 5, "prompt_lookup_min": 5}, a draft model {"model": DIR,
    # "num_speculative_tokens": k} or EAGLE heads {"method": "eagle3", "model": DIR, ...}
    # (docs/speculative_decoding.md). Steps then do not overlap.
    speculative_config: dict[str, Any] | None = None
    # Disaggregated prefill, vLLM's form: {"kv_connector": "NixlConnector", "kv_role":
    # "kv_producer" | "kv_consumer" | "kv_both", "kv_connector_extra_config": {...}}: a
    # request's kv_transfer_params (SamplingParams.extra_args) then asks a producer to keep its
    # prompt's blocks for a consumer, or a consumer to read them instead of prefilling.
    kv_transfer_config: dict[str, Any] | None = None
    # Overload control: at most this many requests wait to be scheduled; one more is refused at
    # once with EngineOverloadedError (servers answer "unavailable" / 503) instead of queueing
    # without bound. None (the default, as vLLM): no bound. The drivers (StreamingEngine,
    # EngineProcess) count a request as waiting until its first output.
    max_waiting_requests: int | None = None
    # Tensor parallelism (vLLM's name): the model's layers split over this many GPUs of one host
    # (ranks 1.. run in worker processes, backend/worker/tp_worker.py); on the CPU the same
    # ranks run over gloo. 1: one process, no process group.
    tensor_parallel_size: int = 1
    # Which executor runs the model (vLLM's name and meaning): "uni" (one device in the engine's
    # process), "mp" (tensor-parallel ranks in processes of their own), or the fully qualified
    # name of an `tritium.worker.executor.Executor` subclass, "package.module.Class", built with
    # the EngineConfig (benchmarks/response_path/ drives the server with one). None: "mp" when
    # tensor_parallel_size > 1, else "uni".
    distributed_executor_backend: str | None = None
    # GiB of pinned host memory per device for the KV blocks of preempted requests (vLLM's name
    # and meaning); 0: off. preemption_mode (vLLM's): "recompute" frees a preempted request's
    # blocks and computes them again; "swap" copies them to host memory and back; None: swap
    # when swap_space is set and recomputing would take more than one step's prompt chunk
    # (docs/serving.md, "Preemption by swap").
    swap_space: float = 0.0
    preemption_mode: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a path to a Hugging Face model directory.")
        if not os.path.isdir(self.model):
            raise ValueError(f"model: directory {self.model!r} does not exist.")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model: {self.model!r} has no config.json.")
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise ValueError(f"tokenizer: directory {self.tokenizer!r} does not exist.")
        _choice("dtype", self.dtype, _DTYPES)
        _choice("device", self.device, _DEVICES)
        _choice("load_format", self.load_format, _LOAD_FORMATS)
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not (
                0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        self._check_executor_backend()
        if self.max_waiting_requests is not None:
            _positive_int("max_waiting_requests", self.max_waiting_requests)
        if self.max_num_batched_tokens is not None:
            _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}.")
        _positive_int("max_logprobs", self.max_logprobs)
        _positive_int("stream_interval", self.stream_interval)
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        if isinstance(self.max_prefill_graph_tokens, bool) or not isinstance(
                self.max_prefill_graph_tokens, int) or self.max_prefill_graph_tokens < 0:
            raise ValueError("max_prefill_graph_tokens must be a non-negative integer, "
                             f"got {self.max_prefill_graph_tokens!r}.")
        if self.quantization is not None:
            _choice("quantization", self.quantization, QUANTIZATIONS)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _positive_finite("k_scale", self.k_scale)
        _positive_finite("v_scale", self.v_scale)
        if isinstance(self.long_prefill_token_threshold, bool) or not isinstance(
                self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be a non-negative integer, "
                             f"got {self.long_prefill_token_threshold!r}.")
        self._check_lora()
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)  # checks it
        if self.kv_transfer_config is not None:
            KVTransferConfig.from_dict(self.kv_transfer_config)  # checks it
            if self.tensor_parallel_size > 1:
                raise ValueError("kv_transfer_config: disaggregated prefill runs on one device per "
                                 "instance; tensor_parallel_size must be 1.")
        self._check_swap()

    def _check_executor_backend(self) -> None:
        # A class name is only checked for its form here: it is imported where the engine is
        # built (its process), never in a Triton stub, which must not import torch.
        backend, tp = self.distributed_executor_backend, self.tensor_parallel_size
        if backend is None:
            return
        if not isinstance(backend, str) or not backend:
            raise ValueError(f"distributed_executor_backend must be 'uni', 'mp' or the qualified name of an "
                             f"Executor class ('package.module.Class'), got {backend!r}.")
        if backend in ("ray", "external_launcher"):
            raise ValueError(f"distributed_executor_backend={backend!r} is not supported by Tritium: use 'uni' "
                             f"(one device), 'mp' (tensor-parallel ranks in processes) or an Executor class's "
                             f"qualified name.")
        if backend == "uni" and tp > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one device; tensor_parallel_size={tp} "
                             f"needs 'mp'.")
        if backend == "mp" and tp == 1:
            raise ValueError("distributed_executor_backend='mp' starts tensor-parallel ranks; with "
                             "tensor_parallel_size=1 use 'uni'.")
        if backend not in ("uni", "mp") and not _QUALIFIED_NAME.fullmatch(backend):
            raise ValueError(f"distributed_executor_backend must be 'uni', 'mp' or the qualified name of an "
                             f"Executor class ('package.module.Class'), got {backend!r}.")

    def _check_swap(self) -> None:
        swap = self.swap_space
        if isinstance(swap, bool) or not isinstance(swap, (int, float)) or not 0.0 <= float(swap) < float("inf"):
            raise ValueError(f"swap_space must be a non-negative number of GiB, got {swap!r}.")
        if self.preemption_mode is not None:
            _choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        if self.preemption_mode == "swap" and not swap:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of host memory per device).")
        spec = None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)
        if swap and spec is not None and spec.uses_draft_model:
            raise ValueError(f"swap_space: speculative method {spec.method!r} keeps a "
                             f"KV cache of its own, which is not swapped; use swap_space=0 (or 'ngram').")
        if swap:
            needed, available = swap * GIB * self.tensor_parallel_size, available_host_memory()
            if needed > available:
                raise ValueError(f"swap_space={swap} GiB per device ({needed / GIB:.2f} GiB for "
                                 f"{self.tensor_parallel_size} device(s)) is more than the host's "
                                 f"available memory ({available / GIB:.2f} GiB).")

    def _check_lora(self) -> None:
        _positive_int("max_lora_rank", self.max_lora_rank)
        if self.max_loras is not None:
            _positive_int("max_loras", self.max_loras)
        if self.max_cpu_loras is not None:
            _positive_int("max_cpu_loras", self.max_cpu_loras)
        modules = self.lora_modules
        if not self.enable_lora:
            if modules:
                raise ValueError("lora_modules needs enable_lora=true.")
            return
        if not modules:  # adapters come with requests (LoRARequest with a lora_path)
            self._check_max_cpu_loras()
            return
        if not isinstance(modules, dict):
            raise ValueError(f"lora_modules must map adapter names to directories, got {modules!r}.")
        for name, path in modules.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"lora_modules: adapter names must be non-empty strings, got {name!r}.")
            if not isinstance(path, str) or not os.path.isdir(path):
                raise ValueError(f"lora_modules: adapter {name!r}: directory {path!r} does not exist.")
        self._check_max_cpu_loras()

    def _check_max_cpu_loras(self) -> None:
        slots = self.max_loras or max(1, len(self.lora_modules or ()))
        if self.max_cpu_loras is not None and self.max_cpu_loras < slots:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} is less than the {slots} adapter "
                             f"slots (max_loras); host memory must hold every adapter in a slot.")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        """Like the constructor, but names an unknown argument instead of a TypeError."""
        valid = {f.name for f in fields(cls)}
        for key in kwargs:
            if key not in valid:
                raise ValueError(f"Unknown engine argument '{key}'. Valid arguments: {', '.join(sorted(valid))}.")
        return cls(**kwargs)

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> "EngineArgs":
        """From string values, as Triton model-config parameters arrive."""
        types = {f.name: f.type for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, raw in values.items():
            if key not in types:
                raise ValueError(f"Unknown engine argument '{key}'. Valid arguments: {', '.join(sorted(types))}.")
            kwargs[key] = _parse_string(key, raw, str(types[key]))
        return cls(**kwargs)

    # ---- resolution: once, into the typed parts every component is built from -----------------
    def create_model_config(self, model_limits: Callable[[dict[str, Any]], ModelLimits]) -> ModelConfig:
        """The model's part, with max_model_len resolved against its config.json and what
        `model_limits` (backend.models.model_limits) says of its architecture; ValueError when
        they conflict. The engine's process makes it; its parent receives it (Ready)."""
        hf_config = load_hf_config(self.model)
        max_pos = int(hf_config.get("max_position_embeddings") or 4096)
        limit = f"the model's max_position_embeddings={max_pos}"
        limits = model_limits(hf_config)
        exact = limits.context_limit
        if exact is not None and exact[0] < max_pos:
            max_pos, limit = exact
            logger.warning("Serving sequences of at most %d tokens: %s", max_pos, limit)
        if self.max_model_len is not None and self.max_model_len > max_pos:
            raise ValueError(f"max_model_len={self.max_model_len} is larger than {limit}.")
        max_model_len = self.max_model_len or max_pos
        original = limits.longrope_original_length
        if original is not None and self.max_model_len is None and max_model_len > original:
            max_model_len = original
            logger.warning("LongRoPE: max_model_len defaults to original_max_position_embeddings=%d "
                           "(its short factors, as transformers uses them up to there); a larger "
                           "max_model_len uses the long factors at every position", original)
        elif original is not None and max_model_len > original:
            logger.warning("LongRoPE: max_model_len=%d passes original_max_position_embeddings=%d, so "
                           "the long factors apply at every position (vLLM's rule; transformers uses "
                           "the short ones while a sequence is shorter)", max_model_len, original)
        return ModelConfig(self.model, self.tokenizer or self.model, self.dtype, self.seed, self.load_format,
                           self.quantization, max_model_len, self.max_logprobs, hf_config)

    def create_engine_config(self, model_config: ModelConfig) -> EngineConfig:
        """Every part, around the model's (`create_model_config`): the defaults that depend on
        the model resolved; ValueError when they conflict."""
        max_model_len = model_config.max_model_len
        budget = self.max_num_batched_tokens or (
            DEFAULT_MAX_NUM_BATCHED_TOKENS if self.enable_chunked_prefill
            else max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS))
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(f"max_num_batched_tokens={budget} is smaller than max_model_len="
                             f"{max_model_len}; without chunked prefill a whole prompt must fit "
                             f"in one step. Raise max_num_batched_tokens or enable_chunked_prefill.")
        spec = self.speculative_config
        return EngineConfig(
            model_config,
            CacheConfig(self.block_size, self.gpu_memory_utilization, self.num_kv_blocks,
                        self.enable_prefix_caching, self.kv_cache_dtype, self.k_scale, self.v_scale,
                        float(self.swap_space)),
            SchedulerConfig(self.max_num_seqs, budget, self.enable_chunked_prefill,
                            self.long_prefill_token_threshold, self.scheduling_policy, self.stream_interval,
                            self.max_waiting_requests,
                            self.preemption_mode or ("auto" if self.swap_space else "recompute")),
            ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend
                           or ("mp" if self.tensor_parallel_size > 1 else "uni")),
            DeviceConfig(self.device),
            CompilationConfig(self.enforce_eager, self.max_prefill_graph_tokens),
            LoRAConfig(dict(self.lora_modules or {}), self.max_loras, self.max_lora_rank, self.max_cpu_loras)
            if self.enable_lora else None,
            None if spec is None else self._resolve_speculative(SpeculativeConfig.from_dict(spec), model_config),
            None if self.kv_transfer_config is None else KVTransferConfig.from_dict(self.kv_transfer_config))

    def _resolve_speculative(self, spec: SpeculativeConfig, target: ModelConfig) -> SpeculativeConfig:
        """A draft model's or EAGLE heads' own ModelConfig: their config.json, the target's
        dtype unless the speculative config sets one, the target's context length (proposals run
        to its end), their checkpoint's quantization unless set."""
        if not spec.uses_draft_model:
            return spec
        if self.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config: method {spec.method!r} runs its model on one device; "
                             f"with tensor_parallel_size={self.tensor_parallel_size} only 'ngram' is supported.")
        if not os.path.isdir(spec.model):
            raise ValueError(f"speculative_config: model directory {spec.model!r} does not exist.")
        hf_config = load_hf_config(spec.model)
        if not spec.is_eagle:
            max_pos = int(hf_config.get("max_position_embeddings") or 4096)
            if max_pos < target.max_model_len:
                raise ValueError(f"speculative_config: the draft model's max_position_embeddings={max_pos} "
                                 f"is smaller than max_model_len={target.max_model_len}.")
        draft = ModelConfig(spec.model, target.tokenizer, spec.dtype or target.dtype, target.seed,
                            target.load_format, spec.quantization, target.max_model_len, 0, hf_config)
        return replace(spec, draft_model_config=draft)


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}.")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _positive_finite(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0.0 < float(value) < float("inf")):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}.")


def parse_bool(text: str) -> bool | None:
    """A boolean as model-config parameters spell it; None when it is not one."""
    text = text.strip().lower()
    return True if text in ("true", "1", "yes", "on") else False if text in ("false", "0", "no", "off") else None


def _parse_string(key: str, raw: str, type_name: str) -> Any:
    text = raw.strip()
    optional = "None" in type_name
    if optional and text.lower() in ("", "none", "null"):
        return None
    try:
        if type_name.startswith("bool"):
            value = parse_bool(text)
            if value is None:
                raise ValueError
            return value
        if type_name.startswith("int"):
            return int(text)
        if type_name.startswith("float"):
            return float(text)
        if type_name.startswith("dict"):
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError
            return value
        return text
    except ValueError:
        raise ValueError(f"engine argument {key}: cannot parse {raw!r} as {type_name}.") from None


def available_host_memory() -> int:
    """Bytes of host memory available now (Linux's MemAvailable; elsewhere the free pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def load_hf_config(model_dir: str) -> dict[str, Any]:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)
