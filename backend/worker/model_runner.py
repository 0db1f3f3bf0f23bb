"""ModelRunner: owns the model, the KV cache pool and the sampler; runs one scheduled step."""
from __future__ import annotations

import logging

import numpy as np
import torch

from kernels.validation import v_cache_shape

from ..config import CPU_KV_CACHE_BYTES, EngineArgs, EngineConfig
from ..layers.attention import Attention
from ..layers.forward_context import LoRAMapping, set_attention_metadata, set_lora_mapping
from ..layers.penalties import PenaltyCounts
from ..layers.quantization import check_fp8_supported, get_linear_method, process_weights_after_loading
from ..layers.sampler import Sampler, SamplerOutput, compute_prompt_logprobs
from ..layers.sampling_table import SamplingTable
from ..models import get_model_class
from ..models.loader import load_dummy, load_safetensors
from ..step import PLACEHOLDER, GrammarBitmask, SchedulerOutput
from .compile_watch import CompileWatch
from .cuda_graph import SPEC_GRAPH_MAX_SEQS, DecodeGraphs, PrefillGraphs
from .device import resolve_device, resolve_dtype, resolve_quantization
from .input_batch import prepare_batch
from .lora import LoRAManager
from .pending_step import PendingStep, PromptSpanTokens
from .request_states import RequestState, RequestStates
from .warmup import compile_step_variants, profile_num_blocks
from .worker_group import RankFailed, WorkerGroup

logger = logging.getLogger(__name__)


class ModelRunner:
    """The device side of the engine. `execute_model` takes one step's SchedulerOutput, queues
    its work and returns the step's PendingStep at once; nothing else writes that step.

    With tensor_parallel_size > 1 the runner of rank 0 starts the other ranks (`WorkerGroup`)
    and mirrors its forward passes and LM-head calls to them; a worker rank's runner is built
    with `peer` (backend/worker/tp_worker.py) and only follows. Every rank builds the same way,
    in lockstep, each its shard of the model and of the KV cache."""

    def __init__(self, config: EngineConfig, peer=None) -> None:
        self.workers: WorkerGroup | None = None
        self._peer = peer
        if config.args.tensor_parallel_size > 1 and peer is None:
            self.workers = WorkerGroup(config, resolve_device(config.args))
        try:
            self._build(config)
        except BaseException:
            self.shutdown()
            raise
        if self.workers is not None:
            self._drive_workers()

    def _build(self, config: EngineConfig) -> None:
        args, hf_config = config.args, config.hf_config
        max_model_len, max_num_batched_tokens = args.max_model_len, args.max_num_batched_tokens
        self.config = config
        self.args = args
        self.device = resolve_device(args)
        self.dtype = resolve_dtype(args, hf_config, self.device)
        self.block_size = args.block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            CompileWatch.remove_hooks()  # another engine's watch must not count this start-up
        torch.manual_seed(args.seed)
        model_cls = get_model_class(hf_config)
        self.quantization = resolve_quantization(args, hf_config)
        linear_method = get_linear_method(self.quantization, hf_config.get("quantization_config"))
        if self.quantization == "fp8":
            check_fp8_supported(self.device)
        self.cache_dtype = self.dtype if args.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        if args.kv_cache_dtype != "auto":
            check_fp8_supported(self.device, f"kv_cache_dtype='{args.kv_cache_dtype}'")
        with torch.device(self.device):
            self.model = model_cls(hf_config, self.dtype, linear_method, max_model_len=max_model_len)
        self.model.eval()
        checkpoint_kv_scales: dict[str, dict[str, float]] = {}
        if args.load_format == "dummy":
            load_dummy(self.model, args.seed)
        else:
            checkpoint_kv_scales = load_safetensors(self.model, args.model)
        process_weights_after_loading(self.model)
        self._tp_exchange("loaded", None)  # every rank has its shard before any collective
        # LoRA adapters before the memory profile, so the cache is sized around them.
        self.lora_manager = LoRAManager(self.model, args.lora_modules, args.max_loras, args.max_lora_rank,
                                        self.dtype, self.device, args.max_cpu_loras) if args.enable_lora else None
        self.attn_layers = self.model.attention_layers()
        a = self.model.args
        self.num_kv_heads = self.attn_layers[0].num_kv_heads
        self.head_dim = a.head_dim
        self.vocab_size = a.vocab_size
        # Penalties' token counts stay on the device, a slot per running sequence; allocated
        # before the memory profile, so the cache is sized around them. Only rank 0 samples: the
        # other ranks keep one slot, for the warm-up of the penalties' kernel.
        slots = args.max_num_seqs if self._peer is None else 1
        self.sampler = Sampler(PenaltyCounts(slots, self.vocab_size, self.device, max_model_len),
                               SamplingTable(slots, self.vocab_size, self.device))
        self.states = RequestStates()  # the worker's own state of each sequence it holds
        # Prompt logprobs take the logits of this many rows at a time: the rows the memory
        # profile gives the sampler (`warmup.profile_num_blocks`), so they fit in what the cache left.
        self.logits_rows_per_pass = max(1, min(args.max_num_seqs, max_num_batched_tokens))
        self.num_blocks = min(self._tp_exchange("num_blocks", self._decide_num_blocks()))
        self.kv_cache = self.allocate_cache(self.num_blocks, zero=True)
        self.bind_cache(self.kv_cache)
        self._set_kv_scales(args, checkpoint_kv_scales)
        if self.device.type == "cuda":
            compile_step_variants(self)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.verify_graphs: PrefillGraphs | None = None  # speculative decoding's verification steps
        if self.device.type == "cuda" and not args.enforce_eager and args.tensor_parallel_size > 1:
            logger.info("tensor parallelism runs eager: no CUDA graphs (collectives in graphs are not done yet)")
        elif self.device.type == "cuda" and not args.enforce_eager:
            max_blocks = -(-max_model_len // self.block_size)
            lora = self.lora_manager is not None
            self.graphs = DecodeGraphs(self.model, args.max_num_seqs, max_blocks, max_model_len, self.device, lora)
            self.graphs.capture()
            prefill_tokens = min(args.max_prefill_graph_tokens, max_num_batched_tokens)
            if prefill_tokens:
                self.prefill_graphs = PrefillGraphs(self.model, prefill_tokens, max_blocks, self.device,
                                                    lora=lora)
                self.prefill_graphs.capture()
            spec = args.speculative
            if spec:  # each of up to `seqs` sequences verifies its last token and k proposals
                rows = spec.num_speculative_tokens + 1
                seqs = min(args.max_num_seqs, SPEC_GRAPH_MAX_SEQS)
                self.verify_graphs = PrefillGraphs(self.model, min(seqs * rows, max_num_batched_tokens),
                                                   max_blocks, self.device, lora=lora, rows_per_seq=rows,
                                                   max_seqs=seqs, max_chunk=rows)
                self.verify_graphs.capture()
        # From here on a Triton compile stalls a step: log each one (kernels the warm-up missed).
        self._last: PendingStep | None = None  # the step launched last (placeholders read its tokens)
        self.compile_watch = CompileWatch()
        if self.device.type == "cuda":
            self.compile_watch.install()

    # ---- tensor parallelism -----------------------------------------------------------------------
    def _tp_exchange(self, tag: str, value):
        """Every rank's `value` (rank 0's first): a start-up handshake over the ranks' pipes."""
        link = self.workers or self._peer
        return [value] if link is None else link.exchange(tag, value)

    def _drive_workers(self) -> None:
        """From now on each LM-head call of rank 0 is mirrored (the head is split over the
        vocabulary: every rank computes its part of the logits)."""
        workers, head = self.workers, self.model.compute_logits

        def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
            try:
                return head(workers.logits(hidden))
            except RankFailed:
                raise
            except Exception as exc:  # the ranks' collectives are out of step from here on
                raise workers.failed(exc) from exc
        self.model.compute_logits = compute_logits
        workers.driving = True

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one rank)."""
        if self.workers is not None:
            self.workers.shutdown()

    def copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (src, dst) block of every layer's keys and values."""
        if block_copies:
            src = self.to_device([c[0] for c in block_copies], torch.int64)
            dst = self.to_device([c[1] for c in block_copies], torch.int64)
            raw = self.kv_cache.view(torch.uint8)  # index_put has no float8 kernel on every device
            raw[:, :, dst] = raw[:, :, src]

    def _set_kv_scales(self, args: EngineArgs, checkpoint: dict[str, dict[str, float]]) -> None:
        """An FP8 cache stores keys and values divided by per-layer scales: the checkpoint's
        where it has them (FP8 checkpoints calibrated them), else k_scale / v_scale."""
        for layer in self.attn_layers:
            layer.k_scale, layer.v_scale = float(args.k_scale), float(args.v_scale)
        if not checkpoint:
            return
        if self.cache_dtype != torch.float8_e4m3fn:
            logger.info("The checkpoint's KV cache scales (%d layers) are not used: "
                        "kv_cache_dtype is %s", len(checkpoint), args.kv_cache_dtype)
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

    # ---- KV pool sizing -----------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        return (2 * len(self.attn_layers) * self.block_size * self.num_kv_heads * self.head_dim
                * self.cache_dtype.itemsize)

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
        if self.args.num_kv_blocks is not None:
            return self.args.num_kv_blocks
        if self.device.type == "cpu":
            enough = -(-self.max_model_len // self.block_size) * self.args.max_num_seqs
            return max(1, min(CPU_KV_CACHE_BYTES // self.block_bytes, enough))
        return profile_num_blocks(self)


    # ---- one step -----------------------------------------------------------------------------
    # ---- one step -----------------------------------------------------------------------------
    def forward_eager(self, batch, fill=None, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        input_ids = self.to_device(batch.input_ids, torch.int64)
        if fill is not None:
            input_ids[fill[0]] = fill[2][fill[1]]
        if self.workers is not None and self.workers.driving:
            self.workers.forward(batch, input_ids, fill is not None, logits_indices)
        return self.run_forward(batch, input_ids, logits_indices)

    def run_forward(self, batch, input_ids: torch.Tensor,
                    logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        positions = self.to_device(batch.positions, torch.int64)
        lora = None if batch.lora_slots is None else LoRAMapping(self.to_device(batch.lora_slots, torch.int64))
        with set_attention_metadata(batch.attention_metadata(self.to_device)), set_lora_mapping(lora):
            return self.model(input_ids, positions, logits_indices)

    def to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        """Host data to the device without blocking: copies from pageable memory would wait
        for the stream (the step still running); pinned ones are queued behind it."""
        t = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return t.to(dtype)
        return t.to(dtype).pin_memory().to(self.device, non_blocking=True)


    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput) -> PendingStep:
        """Queue the step on the device and return at once; `PendingStep.wait()` gives its
        ModelRunnerOutput. Input tokens still being sampled by the step launched before
        (placeholders) are read from its output on the device. With `step.defer_sampling` only
        the forward pass is queued: `PendingStep.sample()` queues the sampling later, once the
        host knows what it reads (the previous step's tokens, for a grammar). With tensor
        parallelism, RankFailed once a rank is lost (and for every step after)."""
        workers = self.workers
        if workers is None:
            return self._execute_model(step)
        workers.check()
        try:
            if step.lora_loads or step.block_copies:
                workers.prologue([(slot, name, self.lora_manager.paths[name])
                                  for slot, name in step.lora_loads], step.block_copies)
            return self._execute_model(step)
        except RankFailed:
            raise
        except Exception as exc:  # the ranks' collectives are out of step from here on
            raise workers.failed(exc) from exc

    def _execute_model(self, step: SchedulerOutput) -> PendingStep:
        table, counts, states = self.sampler.table, self.sampler.counts, self.states
        table.release(step.finished_seq_ids)
        counts.release(step.finished_seq_ids)
        table.add(states.apply(step))  # parameters are written once, when a sequence arrives
        for fork in step.forks:  # siblings copy their parent now: they sample in this step
            table.add(states.fork(fork))
        for slot, name in step.lora_loads:  # adapters taking a slot, before the step reads them
            self.lora_manager.load(slot, name)
        self.copy_blocks(step.block_copies)
        rows = step.sample_rows
        row_states = [states[r.seq_id] for r in rows]
        speculative = bool(step.spec_runs)
        # A verification step of speculative decoding (rows before a sequence's last) of a few
        # sequences runs whole through the verification graphs, its decodes as one-token chunks.
        pg = self.verify_graphs
        verify_in_graph = (speculative and pg is not None and not step.prompt_spans
                           and len(step.scheduled) <= pg.max_seqs and len(rows) <= pg.max_rows)
        batch = prepare_batch(step.scheduled, states, self.block_size, self.lora_manager is not None,
                              all_chunks=verify_in_graph)
        fill = self._placeholder_fill(batch)
        # The packed row whose hidden state each sample row reads.
        rows_index = [batch.last_index[r.source] - r.offset for r in rows]
        every_row = rows_index == list(range(batch.num_tokens))
        # The rows that predict prompt tokens whose logprobs are asked for (position j predicts
        # token j + 1), and those tokens.
        prompt_index: list[int] = []
        prompt_targets: list[int] = []
        spans: list[PromptSpanTokens] = []
        if step.prompt_spans:
            num_new = {it.seq_id: it.num_new_tokens for it in step.scheduled}
            for span in step.prompt_spans:
                state = states[span.seq_id]
                row_of_position_0 = (batch.last_index[span.seq_id]
                                     - (state.num_computed_tokens + num_new[span.seq_id] - 1))
                prompt_index.extend(range(row_of_position_0 + span.first - 1, row_of_position_0 + span.end - 1))
                spans.append(PromptSpanTokens(span.seq_id, span.first, state.token_ids[span.first:span.end],
                                              state.params.prompt_logprobs))
                prompt_targets.extend(spans[-1].token_ids)
        sampling = None
        if rows and not step.defer_sampling:
            sampling = Sampler.prepare(row_states, self.vocab_size, self.device, counts=counts,
                                       drafts=[r.draft for r in rows] if speculative else None,
                                       table=table,
                                       proposals={run.seq_id: run.proposed for run in step.spec_runs},
                                       grammar=step.grammar_bitmask)
        gather = None
        prompt_hidden = None
        if self.graphs is not None and self.graphs.can_run(batch):
            if not every_row:
                gather = self.to_device(rows_index, torch.int64)
            hidden = self.graphs.run(batch, fill)  # every row
            if prompt_index:
                prompt_hidden = hidden[self.to_device(prompt_index, torch.int64)]
        elif verify_in_graph and fill is None and pg.can_run(batch):
            hidden = pg.run(batch, rows_index)  # the sampled rows, in order
        elif not prompt_index and not speculative and self.prefill_graphs is not None \
                and self.prefill_graphs.can_run(batch):
            # The graph gives the last row of each prompt chunk, in chunk order.
            chunk_of = {int(end) - 1: i for i, end in enumerate(batch.prefill_cu_seqlens_q[1:])}
            chunks = [chunk_of[r] for r in rows_index]
            if chunks != list(range(len(chunk_of))):
                gather = self.to_device(chunks, torch.int64)
            hidden = self.prefill_graphs.run(batch)  # prompt chunks have no placeholder tokens
        else:
            # Only the sampled rows (then the prompt-logprob rows) leave the last layer.
            logits_indices = None
            if not every_row or prompt_index:
                logits_indices = self.to_device(rows_index + prompt_index, torch.int64)
            hidden = self.forward_eager(batch, fill, logits_indices)
            if prompt_index:
                hidden, prompt_hidden = hidden[:len(rows_index)], hidden[len(rows_index):]
        prompt = None
        if prompt_index:
            num_top = max(span.num_logprobs for span in spans)
            prompt = compute_prompt_logprobs(
                self.model.compute_logits, prompt_hidden, self.to_device(prompt_targets, torch.int64),
                num_top, self.logits_rows_per_pass)
        pending = self._last = PendingStep(step, spans, prompt)
        pending.placeholders, pending.spec_states = self.states.book_launch(step, row_states)
        if not rows:
            pending.finish(None)
            return pending
        if gather is not None:
            hidden = hidden[gather]
        if step.defer_sampling:
            # The graphs' output buffers stay valid: the next forward is queued after sample().
            pending.defer(lambda grammar: self._sample_deferred(hidden, row_states, grammar))
            return pending
        pending.finish(self.sampler(self.model.compute_logits(hidden), row_states, sampling))
        return pending

    def _placeholder_fill(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(input rows, rows of the previous step's output, that output) for the input tokens
        that are placeholders, or None when there are none."""
        holes = np.flatnonzero(batch.input_ids == PLACEHOLDER)
        if not len(holes):
            return None
        previous = self._last
        if previous is None or previous.token_ids is None:
            raise RuntimeError("a placeholder input token without a step that samples it")
        src_rows = [previous.row_of[sid] for sid in batch.seq_ids_at(holes)]
        batch.input_ids[holes] = 0
        return (self.to_device(holes.astype(np.int64), torch.int64),
                self.to_device(src_rows, torch.int64), previous.token_ids)

    @torch.inference_mode()
    def _sample_deferred(self, hidden: torch.Tensor, seqs: list[RequestState],
                         grammar: GrammarBitmask | None) -> SamplerOutput:
        """The rows' sampling from their host state now: each row's tokens but its last (the
        placeholder of this very step)."""
        sampling = Sampler.prepare(seqs, self.vocab_size, self.device, pending_tokens=1,
                                   counts=self.sampler.counts, table=self.sampler.table, grammar=grammar)
        return self.sampler(self.model.compute_logits(hidden), seqs, sampling)
