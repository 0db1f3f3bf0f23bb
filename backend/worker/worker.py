"""Worker: one rank's device. It builds the model (its shard, with tensor parallelism), sizes,
allocates and binds the KV cache, compiles the kernels a step can pick and captures the CUDA
graphs; its ModelRunner then runs the steps on them."""
from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from tritium.kernels.validation import v_cache_shape

from ..config import CPU_KV_CACHE_BYTES, GIB
from ..engine_config import CacheConfig, EngineConfig
from ..kv_transfer.nixl_blocks import NixlBlockTransfer
from ..layers.attention import Attention
from ..layers.quantization import check_fp8_supported
from ..spec_decode.eagle import make_proposer
from ..step import SchedulerOutput
from .compile_watch import CompileWatch
from .cuda_graph import SPEC_GRAPH_MAX_SEQS, DecodeGraphs, PrefillGraphs
from .device import resolve_device, resolve_dtype
from .lora import LoRAManager
from .model_builder import build_model
from .host_kv_cache import HostKVCache
from .model_runner import ModelRunner
from .pending_step import PendingStep
from .warmup import compile_step_variants, profile_num_blocks

logger = logging.getLogger(__name__)


class StartupLink(Protocol):
    """A tensor-parallel rank's start-up handshake with the others (rank 0: `WorkerGroup`;
    the other ranks: `tp_worker.Peer`)."""

    def exchange(self, tag: str, value: Any) -> list[Any]: ...


class Worker:
    """One rank's model, KV cache and graphs, and the ModelRunner that runs steps on them.
    With tensor parallelism every rank builds one the same way, in lockstep (`link` carries the
    start-up handshakes), each its shard of the model and of the KV cache."""

    def __init__(self, config: EngineConfig, rank: int = 0, link: StartupLink | None = None) -> None:
        model_config, cache, scheduler = config.model_config, config.cache_config, config.scheduler_config
        lora_config = config.lora_config
        self.config, self.rank, self._link = config, rank, link
        self.device = resolve_device(config.device_config)
        self.dtype = resolve_dtype(model_config, self.device)
        self.block_size = cache.block_size
        self.max_model_len = model_config.max_model_len
        self.max_num_batched_tokens = scheduler.max_num_batched_tokens
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            CompileWatch.remove_hooks()  # another engine's watch must not count this start-up
        torch.manual_seed(model_config.seed)
        built = build_model(model_config, self.device, self.dtype)
        self.model, self.quantization = built.model, built.quantization
        checkpoint_kv_scales = built.kv_scales
        self.cache_dtype = self.dtype if cache.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        if cache.kv_cache_dtype != "auto":
            check_fp8_supported(self.device, f"kv_cache_dtype='{cache.kv_cache_dtype}'")
        self._exchange("loaded", None)  # every rank has its shard before any collective
        # LoRA adapters and the sampler's device state before the memory profile, so the cache is
        # sized around them.
        self.lora_manager = LoRAManager(
            self.model, lora_config.lora_modules, lora_config.max_loras, lora_config.max_lora_rank, self.dtype,
            self.device, lora_config.max_cpu_loras) if lora_config is not None else None
        self.runner = ModelRunner(config, self.model, self.device, self.dtype, self.lora_manager, rank)
        self.attn_layers = self.model.attention_layers()
        self.num_kv_heads = self.attn_layers[0].num_kv_heads
        self.head_dim = self.model.config.head_dim
        self.vocab_size = self.model.config.vocab_size
        spec = config.speculative_config
        # A draft model before the memory profile: its weights and its share of each block count.
        self.drafter = self.runner.drafter = make_proposer(config, self.device, self.model) \
            if spec is not None and spec.uses_draft_model else None
        # Blocks behind every layer's window can go back to the pool; a draft model or EAGLE
        # head reads the same tables with attention over the whole context, so not with one.
        self.kv_sliding_window = self.model.config.kv_window if self.drafter is None else None
        self.num_blocks = min(self._exchange("num_blocks", self._decide_num_blocks()))
        self.kv_cache = self.allocate_cache(self.num_blocks, zero=True)
        self.bind_cache(self.kv_cache)
        self.runner.kv_cache = self.kv_cache
        if self.drafter is not None:
            self.drafter.allocate_cache(self.num_blocks)
        # Preemption by swap: host blocks of this rank's shard, as many on every rank.
        self.num_host_blocks = min(self._exchange("num_host_blocks", int(cache.swap_space * GIB) // self.block_bytes)) \
            if cache.swap_space else 0
        self.runner.host_cache = HostKVCache(self.kv_cache, self.num_host_blocks) if self.num_host_blocks else None
        # Disaggregated prefill: the cache registered with NIXL, for another engine to read or be read.
        transfer = config.kv_transfer_config
        self.kv_transfer = NixlBlockTransfer(self.kv_cache, transfer.engine_id, transfer.num_threads) \
            if transfer is not None else None
        self._set_kv_scales(cache, checkpoint_kv_scales)
        if self.device.type == "cuda":
            compile_step_variants(self)
        if self.device.type == "cuda" and not config.compilation_config.enforce_eager:
            self.build_graphs(capture=True)
        # From here on a Triton compile stalls a step: log each one (kernels the warm-up missed).
        self.compile_watch = CompileWatch()
        if self.device.type == "cuda":
            self.compile_watch.install()

    def _exchange(self, tag: str, value: Any) -> list[Any]:
        """Every rank's `value` (rank 0's first): a start-up handshake."""
        return [value] if self._link is None else self._link.exchange(tag, value)

    def execute_model(self, step: SchedulerOutput) -> PendingStep:
        return self.runner.execute_model(step)

    # ---- CUDA graphs ----------------------------------------------------------------------------
    def build_graphs(self, capture: bool) -> None:
        """The runner's decode, prefill and (with speculative decoding) verification graphs. Every
        tensor-parallel rank builds the same ones in the same order (their capture runs the
        collectives). capture=False: the graphs' static buffers run eagerly (the CPU)."""
        config, runner = self.config, self.runner
        max_num_seqs = config.scheduler_config.max_num_seqs
        max_blocks = -(-self.max_model_len // self.block_size)
        lora = self.lora_manager is not None

        def ready(graphs):
            if capture:
                graphs.capture()
            return graphs
        runner.graphs = ready(DecodeGraphs(self.model, max_num_seqs, max_blocks, self.max_model_len,
                                           self.device, lora, capture=capture))
        prefill_tokens = min(config.compilation_config.max_prefill_graph_tokens, self.max_num_batched_tokens)
        if prefill_tokens:
            runner.prefill_graphs = ready(PrefillGraphs(self.model, prefill_tokens, max_blocks, self.device,
                                                        capture=capture, lora=lora))
        spec = config.speculative_config
        if spec:  # each of up to `seqs` sequences verifies its last token and k proposals
            rows = spec.num_speculative_tokens + 1
            seqs = min(max_num_seqs, SPEC_GRAPH_MAX_SEQS)
            runner.verify_graphs = ready(PrefillGraphs(
                self.model, min(seqs * rows, self.max_num_batched_tokens), max_blocks, self.device,
                capture=capture, lora=lora, rows_per_seq=rows, max_seqs=seqs, max_chunk=rows))
        if self.drafter is not None:
            self.drafter.build_graphs(capture)

    # ---- the KV cache ---------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one block: the target's keys and values, and the draft model's."""
        target = (2 * len(self.attn_layers) * self.block_size * self.num_kv_heads * self.head_dim
                  * self.cache_dtype.itemsize)
        return target + (self.drafter.block_bytes if self.drafter is not None else 0)

    def allocate_cache(self, num_blocks: int, zero: bool) -> torch.Tensor:
        """[2, layers, num_blocks, block_size, Hkv, D] in the cache dtype. Made as bytes and
        reinterpreted, since not every device fills or indexes float8 tensors."""
        shape = (2, len(self.attn_layers), num_blocks, self.block_size, self.num_kv_heads,
                 self.head_dim)
        make = torch.zeros if zero else torch.empty
        raw = make(*shape[:-1], self.head_dim * self.cache_dtype.itemsize, dtype=torch.uint8,
                   device=self.device)
        return raw.view(self.cache_dtype)

    def bind_cache(self, pool: torch.Tensor) -> None:
        """Give each attention layer its views of the pool; an FP8 value cache is each block
        transposed, [num_blocks, Hkv, D, block_size] (same bytes per block)."""
        for i, layer in enumerate(self.attn_layers):
            k_cache = pool[0, i]
            layer.k_cache = k_cache
            layer.v_cache = pool[1, i].view(v_cache_shape(tuple(k_cache.shape), pool.dtype))

    def _decide_num_blocks(self) -> int:
        num_kv_blocks = self.config.cache_config.num_kv_blocks
        if num_kv_blocks is not None:
            return num_kv_blocks
        if self.device.type == "cpu":
            enough = -(-self.max_model_len // self.block_size) * self.config.scheduler_config.max_num_seqs
            return max(1, min(CPU_KV_CACHE_BYTES // self.block_bytes, enough))
        return profile_num_blocks(self)

    def _set_kv_scales(self, cache: CacheConfig, checkpoint: dict[str, dict[str, float]]) -> None:
        """An FP8 cache stores keys and values divided by per-layer scales: the checkpoint's
        where it has them (FP8 checkpoints calibrated them), else k_scale / v_scale."""
        for layer in self.attn_layers:
            layer.k_scale, layer.v_scale = float(cache.k_scale), float(cache.v_scale)
        if not checkpoint:
            return
        if self.cache_dtype != torch.float8_e4m3fn:
            logger.info("The checkpoint's KV cache scales (%d layers) are not used: "
                        "kv_cache_dtype is %s", len(checkpoint), cache.kv_cache_dtype)
            return
        blocks = {name: module.attn for name, module in self.model.named_modules()
                  if isinstance(getattr(module, "attn", None), Attention)}
        for block, scales in sorted(checkpoint.items()):
            attn = blocks.get(block)
            if attn is None:
                raise ValueError(f"model: KV cache scales for {block!r}, which is not an "
                                 f"attention block of this model")
            attn.k_scale = scales.get("k", attn.k_scale)
            attn.v_scale = scales.get("v", attn.v_scale)
        logger.info("KV cache scales from the checkpoint for %d of %d layers", len(checkpoint),
                    len(self.attn_layers))
