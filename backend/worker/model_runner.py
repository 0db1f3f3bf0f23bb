"""ModelRunner: forward and sample. It runs one scheduled step on the model and the KV cache
that its Worker (backend/worker/worker.py) built, sized and bound."""
from __future__ import annotations

from functools import partial
from typing import Callable, Protocol

import numpy as np
import torch

from ..engine_config import EngineConfig
from ..layers.forward_context import LoRAMapping, set_attention_metadata, set_lora_mapping
from ..layers.parallel_state import get_tp_size, tp_broadcast
from ..layers.penalties import PenaltyCounts
from ..layers.sampler import Sampler, SamplerOutput, compute_prompt_logprobs
from ..layers.sampling_table import SamplingTable
from ..spec_decode.proposer import ModelProposer, TargetHidden
from ..step import PLACEHOLDER, GrammarBitmask, SchedulerOutput
from .cuda_graph import DecodeGraphs, PrefillGraphs, kept_hidden_states
from .forward_path import ForwardCall, ForwardPath, StepBatch
from .host_kv_cache import HostKVCache
from .input_batch import prepare_batch
from .lora import LoRAManager
from .pending_step import PendingStep, PromptSpanTokens
from .request_states import RequestState, RequestStates


class LogitsMirror(Protocol):
    """Rank 0's link to the other tensor-parallel ranks (`WorkerGroup`) for LM-head calls: rank
    0 alone knows when one comes (deferred sampling, prompt logprobs), so each is told to them
    with its hidden states, and every rank computes its part of the vocabulary."""

    def logits(self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor: ...


class ModelRunner:
    """The device side of a step. `execute_model` takes one step's SchedulerOutput, queues its
    work and returns the step's PendingStep at once; nothing else writes that step.

    Every tensor-parallel rank has one and receives every step (the same SchedulerOutput); each
    applies it to its own states, packs the same batch and takes the same `ForwardPath`. Rank 0
    samples (`execute_model`) and its `mirror` (set by its executor once every rank is built)
    tells the others its LM-head calls; the others run `follow_step` and sample nothing."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device,
                 dtype: torch.dtype, lora_manager: LoRAManager | None, rank: int = 0) -> None:
        model_config, scheduler = config.model_config, config.scheduler_config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.lora_manager = lora_manager
        self.block_size = config.cache_config.block_size
        self.vocab_size = model.config.vocab_size
        # Only rank 0 samples: the other ranks keep one sampling slot, for the warm-up of the
        # penalties' kernel, and never learn the sampled tokens.
        self.samples = rank == 0
        sample_slots = scheduler.max_num_seqs if self.samples else 1
        # Penalties' token counts stay on the device, a slot per running sequence.
        self.sampler = Sampler(PenaltyCounts(sample_slots, self.vocab_size, device, model_config.max_model_len),
                               SamplingTable(sample_slots, self.vocab_size, device))
        self.states = RequestStates(receives_results=self.samples)  # its own state of each sequence it holds
        # Prompt logprobs take the logits of this many rows at a time: the rows the memory
        # profile gives the sampler (`warmup.profile_num_blocks`), so they fit in what the cache left.
        self.logits_rows_per_pass = max(1, min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens))
        self.kv_cache: torch.Tensor | None = None  # the Worker's pool (copy-on-write copies in it)
        self.host_cache: HostKVCache | None = None  # with swap_space: preemption by swap's host blocks
        # The Worker's captured graphs, None where a step runs eagerly.
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.verify_graphs: PrefillGraphs | None = None  # speculative decoding's verification steps
        self.mirror: LogitsMirror | None = None
        self.drafter: ModelProposer | None = None  # speculative decoding with a draft model or EAGLE head
        self._last: PendingStep | None = None  # the step launched last (placeholders read its tokens)

    def copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (src, dst) block of every layer's keys and values."""
        if block_copies:
            src = self.to_device([c[0] for c in block_copies], torch.int64)
            dst = self.to_device([c[1] for c in block_copies], torch.int64)
            raw = self.kv_cache.view(torch.uint8)  # index_put has no float8 kernel on every device
            raw[:, :, dst] = raw[:, :, src]
            if self.drafter is not None:
                self.drafter.copy_blocks(src, dst)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on rank 0's hidden states; with tensor parallelism every rank computes
        its part of the vocabulary from them (the mirror broadcasts them)."""
        if self.mirror is None:
            return self.model.compute_logits(hidden)
        return self.mirror.logits(hidden, self.model.compute_logits)

    # ---- forward passes -------------------------------------------------------------------------
    def run_path(self, call: ForwardCall, fill=None) -> torch.Tensor:
        """The forward pass `call` describes, on this rank: rank 0 with `fill`, the placeholders'
        tokens on its device. With tensor parallelism every rank runs it for the step and the
        input ids are rank 0's, broadcast into the others' graph buffers or eager ids (they do
        not know sampled tokens)."""
        if call.path is ForwardPath.DECODE_GRAPH:
            return self.graphs.run(call.batch, fill)
        if call.path is ForwardPath.VERIFY_GRAPH:
            return self.verify_graphs.run(call.batch, call.rows)
        if call.path is ForwardPath.PREFILL_GRAPH:
            return self.prefill_graphs.run(call.batch)
        rows = None if call.rows is None else self.to_device(call.rows, torch.int64)
        return self.forward_eager(call.batch, fill, rows, share_input_ids=get_tp_size() > 1)

    def forward_eager(self, batch, fill=None, logits_indices: torch.Tensor | None = None,
                      share_input_ids: bool = False) -> torch.Tensor:
        input_ids = self.to_device(batch.input_ids, torch.int64)
        if fill is not None:
            input_ids[fill[0]] = fill[2][fill[1]]
        if share_input_ids:
            tp_broadcast(input_ids)
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

    def choose_path(self, packed: StepBatch) -> ForwardPath:
        """Which way a step's forward pass runs: a decode, verification or prefill graph where
        one fits the batch, else eagerly. A function of the packed step and the graphs only, so
        that every tensor-parallel rank takes the same path (a verification step has no
        placeholder input: the engine takes the step before first)."""
        batch = packed.batch
        if self.graphs is not None and self.graphs.can_run(batch):
            return ForwardPath.DECODE_GRAPH
        if packed.verify_in_graph and self.verify_graphs.can_run(batch):
            return ForwardPath.VERIFY_GRAPH
        if not packed.prompt_index and not packed.speculative and self.prefill_graphs is not None \
                and self.prefill_graphs.can_run(batch):
            return ForwardPath.PREFILL_GRAPH
        return ForwardPath.EAGER

    # ---- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput) -> PendingStep:
        """Queue the step on the device and return at once; `PendingStep.wait()` gives its
        ModelRunnerOutput. Input tokens still being sampled by the step launched before
        (placeholders) are read from its output on the device. With `step.defer_sampling` only
        the forward pass is queued: `PendingStep.sample()` queues the sampling later, once the
        host knows what it reads (the previous step's tokens, for a grammar)."""
        return self._execute_model(step)

    @torch.inference_mode()
    def follow_step(self, step: SchedulerOutput) -> None:
        """A tensor-parallel rank > 0's share of the step rank 0 runs: the same states, batch,
        path and forward pass, with rank 0's input ids (broadcast); no sampling (rank 0's
        LM-head calls reach this rank as messages of their own)."""
        self._apply(step)
        packed = self._pack(step)
        ids = packed.batch.input_ids
        ids[ids == PLACEHOLDER] = 0  # tokens this rank does not know; rank 0's ids replace them
        self._forward(packed, None)
        self.states.book_launch(step, packed.row_states)

    def _apply(self, step: SchedulerOutput) -> None:
        """The step's changes to the runner's states (and rank 0's sampling slots), adapters
        and KV blocks, before its forward pass."""
        table, counts, states = self.sampler.table, self.sampler.counts, self.states
        if self.samples:
            table.release(step.finished_seq_ids)
            counts.release(step.finished_seq_ids)
        added = states.apply(step)
        for fork in step.forks:  # siblings copy their parent now: they sample in this step
            added += states.fork(fork)
        if self.samples:
            table.add(added)  # parameters are written once, when a sequence arrives
        for slot, name in step.lora_loads:  # adapters taking a slot, before the step reads them
            self.lora_manager.load(slot, name)
        # Blocks swapped out are read before anything of the step can write them (they may be
        # this step's copy-on-write or swap-in targets); swapped-in blocks land before the forward.
        if step.blocks_to_swap_out or step.blocks_to_swap_in:
            self.host_cache.swap_out(step.blocks_to_swap_out)
        self.copy_blocks(step.block_copies)
        if step.blocks_to_swap_in:
            self.host_cache.swap_in(step.blocks_to_swap_in)

    def _pack(self, step: SchedulerOutput) -> StepBatch:
        states, rows = self.states, step.sample_rows
        speculative = bool(step.spec_runs)
        # A verification step of speculative decoding (rows before a sequence's last) of a few
        # sequences runs whole through the verification graphs, its decodes as one-token chunks.
        pg = self.verify_graphs
        verify_in_graph = (speculative and pg is not None and not step.prompt_spans
                           and len(step.scheduled) <= pg.max_seqs and len(rows) <= pg.max_rows)
        batch = prepare_batch(step.scheduled, states, self.block_size, self.lora_manager is not None,
                              all_chunks=verify_in_graph)
        # The packed row whose hidden state each sample row reads.
        rows_index = [batch.last_index[r.source] - r.offset for r in rows]
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
        return StepBatch(batch, [states[r.seq_id] for r in rows], rows_index, prompt_index, spans,
                         prompt_targets, speculative, verify_in_graph)

    def _forward(self, packed: StepBatch, fill) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Run the step's forward pass by its path: (hidden states, the rows of them that the
        sample rows read in order or None for all, the prompt-logprob rows' hidden states)."""
        batch, rows_index, prompt_index = packed.batch, packed.rows_index, packed.prompt_index
        gather = None
        prompt_hidden = None
        path = self.choose_path(packed)
        if path is ForwardPath.DECODE_GRAPH:
            if not packed.every_row:
                gather = self.to_device(rows_index, torch.int64)
            hidden = self.run_path(ForwardCall(path, batch), fill)  # every row
            if prompt_index:
                prompt_hidden = hidden[self.to_device(prompt_index, torch.int64)]
        elif path is ForwardPath.VERIFY_GRAPH:
            hidden = self.run_path(ForwardCall(path, batch, rows=rows_index))  # the sampled rows, in order
        elif path is ForwardPath.PREFILL_GRAPH:
            # The graph gives the last row of each prompt chunk, in chunk order.
            chunk_of = {int(end) - 1: i for i, end in enumerate(batch.prefill_cu_seqlens_q[1:])}
            chunks = [chunk_of[r] for r in rows_index]
            if chunks != list(range(len(chunk_of))):
                gather = self.to_device(chunks, torch.int64)
            hidden = self.run_path(ForwardCall(path, batch))  # prompt chunks have no placeholder tokens
        else:
            # Only the sampled rows (then the prompt-logprob rows) leave the last layer.
            logits_rows = None
            if not packed.every_row or prompt_index:
                logits_rows = rows_index + prompt_index
            hidden = self.run_path(ForwardCall(path, batch, logits_rows), fill)
            if prompt_index:
                hidden, prompt_hidden = hidden[:len(rows_index)], hidden[len(rows_index):]
        return hidden, gather, prompt_hidden

    def _execute_model(self, step: SchedulerOutput) -> PendingStep:
        self._apply(step)
        packed = self._pack(step)
        # The draft proposes once the step's tokens are known: from each sequence's computed
        # tokens before the step on.
        starts = None if self.drafter is None else {
            item.seq_id: self.states[item.seq_id].num_computed_tokens for item in step.scheduled}
        rows, row_states, spans = step.sample_rows, packed.row_states, packed.spans
        fill = self._placeholder_fill(packed.batch)
        sampling = None
        if rows and not step.defer_sampling:
            sampling = Sampler.prepare(row_states, self.vocab_size, self.device, counts=self.sampler.counts,
                                       drafts=[r.draft for r in rows] if packed.speculative else None,
                                       table=self.sampler.table,
                                       proposals={run.seq_id: run.proposed for run in step.spec_runs},
                                       grammar=step.grammar_bitmask)
        hidden, gather, prompt_hidden = self._forward(packed, fill)
        prompt = None
        if packed.prompt_index:
            num_top = max(span.num_logprobs for span in spans)
            prompt = compute_prompt_logprobs(
                self.compute_logits, prompt_hidden, self.to_device(packed.prompt_targets, torch.int64),
                num_top, self.logits_rows_per_pass)
        pending = self._last = PendingStep(step, spans, prompt)
        pending.placeholders, pending.spec_states = self.states.book_launch(step, row_states)
        if self.drafter is not None:
            pending.propose = partial(self.drafter.propose, step, starts, self.states, self._target_hidden(step, packed))
        if not rows:
            pending.finish(None)
            return pending
        if gather is not None:
            hidden = hidden[gather]
        if step.defer_sampling:
            # The graphs' output buffers stay valid: the next forward is queued after sample().
            pending.defer(lambda grammar: self._sample_deferred(hidden, row_states, grammar))
            return pending
        pending.finish(self.sampler(self.compute_logits(hidden), row_states, sampling))
        return pending

    def _target_hidden(self, step: SchedulerOutput, packed: StepBatch) -> TargetHidden | None:
        """What an EAGLE head reads of the step: the target's kept hidden states of every packed
        row, and each scheduled sequence's first row (its rows are consecutive)."""
        if not self.drafter.reads_target_hidden:
            return None
        last = packed.batch.last_index
        return TargetHidden(kept_hidden_states(self.model),
                            {it.seq_id: last[it.seq_id] - it.num_new_tokens + 1 for it in step.scheduled})

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
        return self.sampler(self.compute_logits(hidden), seqs, sampling)
