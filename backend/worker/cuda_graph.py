"""CUDA graphs: the model's forward captured once per padded size over static input buffers,
then replayed. This removes the per-kernel launch cost (hundreds of launches per step) that
dominates small steps.

DecodeGraphs: decode-only steps (one token per sequence), per batch size and context bucket.
PrefillGraphs: prefill-only steps of a few short prompt chunks, per padded token count: a lone
request's first step, whose eager launch takes longer than its GPU work. They return the last
row of each chunk only (the rows a step samples from).

With tensor parallelism every rank captures its own graphs (their collectives are captured
with them) and replays the one that every rank picks from the same step, its input ids
broadcast from rank 0 into the graph's buffer first. With capture=False (the CPU, tests)
`run` executes the model eagerly on the same static buffers, so the padding and the ranks'
choice of graph are testable without a GPU."""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch
from torch import nn

from ..layers.forward_context import AttentionMetadata, LoRAMapping, set_attention_metadata, set_lora_mapping
from ..layers.parallel_state import get_tp_size, tp_broadcast
from .input_batch import TABLE_WIDTH_MULTIPLE, PreparedBatch

logger = logging.getLogger(__name__)


# Graphs fix the decode kernel's KV split at capture. One set sized for max_model_len would
# split every batch's KV at least in two (the longest sequence must not become a tail) and pay
# the merge kernel on every step; a second set for contexts up to SHORT_CONTEXT runs large
# batches unsplit. 4096 keeps one split per sequence at most 4096 tokens.
SHORT_CONTEXT = 4096


def context_buckets(max_model_len: int) -> list[int]:
    return sorted({min(SHORT_CONTEXT, max_model_len), max_model_len})


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int, device: torch.device, lora: bool = False,
                 capture: bool = True, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """lora: the model has LoRA adapters; every graph then adds each row's adapter delta
        (row slots in a fifth buffer row, -1 for rows without one). head: applied to the
        model's output inside the graph (a draft's greedy choice)."""
        self.model = model
        self.head = head
        self.lora = lora
        self.use_graphs = capture
        # Tensor parallelism: rank 0's input ids replace every rank's before a run (only rank 0
        # knows sampled tokens).
        self.share_input_ids = get_tp_size() > 1
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.max_model_len = max_model_len
        n, w = self.max_bs, -(-max_blocks_per_seq // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE
        # input ids, positions, slot mapping, context lengths (and LoRA slots): one buffer, one
        # copy per step
        rows = 5 if lora else 4
        self.vectors = torch.zeros(rows, n, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.vectors[0], self.vectors[1], self.vectors[2]
        self.slot_mapping.fill_(-1)
        if lora:
            self.vectors[4].fill_(-1)
        self.block_tables = torch.zeros(n, w, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        # Pinned staging: two asynchronous copies per step instead of five synchronous ones.
        # Two sets, used alternately: the copy queued for step N may still be waiting behind
        # step N-1 on the device when step N+1 is prepared; step N+2 comes after N was taken.
        pin = device.type == "cuda"
        self.host_vectors = [_host(torch.zeros(rows, n, dtype=torch.int64), pin) for _ in range(2)]
        self.host_tables = [_host(torch.zeros(n, w, dtype=torch.int32), pin) for _ in range(2)]
        self.parity = 0
        self.buckets = context_buckets(max_model_len)
        # (context bucket, batch size) -> (graph, output)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # The target's kept hidden states (an EAGLE head reads them), per graph: its own buffer.
        self.kept_hidden: dict[tuple[int, int], torch.Tensor | None] = {}

    def _metadata(self, bs: int, max_context_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], num_decode_tokens=bs,
            decode_block_tables=self.block_tables[:bs], decode_context_lens=self.context_lens[:bs],
            num_prefill_tokens=0, prefill_block_tables=None, prefill_cu_seqlens_q=None,
            prefill_context_lens=None, decode_max_context_len=max_context_len)

    def _lora(self, bs: int) -> LoRAMapping | None:
        return LoRAMapping(self.vectors[4, :bs]) if self.lora else None

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for bucket in reversed(self.buckets):
            for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
                md = self._metadata(bs, bucket)
                with set_attention_metadata(md), set_lora_mapping(self._lora(bs)):
                    self._call(bs)  # compile kernels, warm up
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self._call(bs)
                pool = graph.pool()
                self.graphs[(bucket, bs)] = (graph, out)
                self.kept_hidden[(bucket, bs)] = kept_hidden_states(self.model)
        # A graph's first launch uploads it to the device (milliseconds for hundreds of nodes):
        # do it now, not on a request's first token. Slot -1 and context 0 make it a no-op.
        self.slot_mapping.fill_(-1)
        self.context_lens.zero_()
        for graph, _ in self.graphs.values():
            graph.replay()
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s, contexts up to %s",
                    self.sizes, self.buckets)

    def can_run(self, batch: PreparedBatch) -> bool:
        return (batch.num_decodes == batch.num_tokens and 0 < batch.num_tokens <= self.max_bs
                and batch.decode_block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, batch: PreparedBatch, fill=None) -> torch.Tensor:
        """`fill` = (token positions, rows, tokens): input tokens that the previous step is still
        sampling, read from its output tensor on the device (rank 0's, which it then broadcasts
        under tensor parallelism)."""
        n = batch.num_tokens
        bs = next(s for s in self.sizes if s >= n)
        width = batch.decode_block_tables.shape[1]
        self.parity ^= 1
        host_vectors, host_tables = self.host_vectors[self.parity], self.host_tables[self.parity]
        hv = host_vectors.numpy()
        hv[0, :n] = batch.input_ids
        hv[1, :n] = batch.positions
        hv[2, :n] = batch.slot_mapping
        hv[3, :n] = batch.decode_context_lens
        hv[2, n:bs] = -1  # padding rows: store nothing, attend to nothing
        hv[3, n:bs] = 0
        if self.lora:
            _fill_lora_row(hv[4], batch.lora_slots, n, bs)
        host_tables.numpy()[:n, :width] = batch.decode_block_tables
        self.vectors[:, :bs].copy_(host_vectors[:, :bs], non_blocking=True)
        self.block_tables[:n, :width].copy_(host_tables[:n, :width], non_blocking=True)
        self.context_lens[:bs].copy_(self.vectors[3, :bs])  # the kernel reads int32
        if fill is not None:
            self.input_ids[fill[0]] = fill[2][fill[1]]
        if self.share_input_ids:
            tp_broadcast(self.input_ids[:n])
        longest = int(batch.decode_context_lens.max())
        bucket = next(b for b in self.buckets if b >= longest)
        if not self.use_graphs:
            with set_attention_metadata(self._metadata(bs, bucket)), set_lora_mapping(self._lora(bs)):
                return self._rows(self._call(bs), n)
        graph, out = self.graphs[(bucket, bs)]
        graph.replay()
        restore_kept_hidden_states(self.model, self.kept_hidden[(bucket, bs)])
        return self._rows(out, n)

    def _call(self, bs: int):
        """The model (and head) on the first bs rows of the static buffers (attention metadata set)."""
        out = self.model(self.input_ids[:bs], self.positions[:bs])
        return out if self.head is None else self.head(out)

    @staticmethod
    def _rows(out, n: int):
        return out[:n]


class HeadDecodeGraphs(DecodeGraphs):
    """Decode graphs of an EAGLE head's one-token passes: besides each row's token, the hidden
    state it continues from goes in a static buffer, and the graph gives the head's two outputs
    (the state for the next pass, the normed state for the logits)."""

    def __init__(self, model: nn.Module, hidden_size: int, dtype: torch.dtype, max_num_seqs: int,
                 max_blocks_per_seq: int, max_model_len: int, device: torch.device, capture: bool = True,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """head: applied to the head's normed output inside the graph (the greedy choice)."""
        super().__init__(model, max_num_seqs, max_blocks_per_seq, max_model_len, device, capture=capture,
                         head=head)
        self.hidden = torch.zeros(self.max_bs, hidden_size, dtype=dtype, device=device)

    def run_with_hidden(self, batch: PreparedBatch, fill, hidden: torch.Tensor):
        self.hidden[:batch.num_tokens].copy_(hidden)
        return self.run(batch, fill)

    def _call(self, bs: int):
        carry, normed = self.model(self.input_ids[:bs], self.positions[:bs], self.hidden[:bs])
        return carry, (normed if self.head is None else self.head(normed))

    @staticmethod
    def _rows(out, n: int):
        return tuple(t[:n] for t in out)


# A prefill graph serves steps of at most this many prompt chunks (a burst of a few requests);
# unused sequence slots have no tokens and cost the attention kernel one early exit per program.
PREFILL_GRAPH_MAX_SEQS = 8
# With speculative decoding a second set of these graphs verifies proposals: a step of up to
# this many sequences, each its last token and k proposed ones as a chunk. Eager verification
# costs more than it gains, so this is also the most sequences that speculate (measured in
# docs/performance.md, speculative decoding).
SPEC_GRAPH_MAX_SEQS = 32


def prefill_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture: powers of two up to 256, then steps of 128 up to 1024 and of 256
    beyond, so padding adds at most a quarter of the GPU work (an eighth above 1024)."""
    if max_tokens <= 0:
        return []
    sizes = [16, 32, 64, 128, 256, *range(384, 1025, 128), *range(1280, max_tokens, 256)]
    return [s for s in sizes if s < max_tokens] + [max_tokens]


class PrefillGraphs:
    """Graphs for steps that are only prompt chunks (no decodes): at most `max_seqs`
    chunks and `max_tokens` tokens, padded to the next captured size. Padding tokens store no
    KV (slot -1) and sit past the last sequence, where attention neither reads nor writes."""

    def __init__(self, model: nn.Module, max_tokens: int, max_blocks_per_seq: int,
                 device: torch.device, capture: bool = True, lora: bool = False,
                 rows_per_seq: int = 1, max_seqs: int = PREFILL_GRAPH_MAX_SEQS,
                 max_chunk: int | None = None, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """rows_per_seq: output rows a chunk may ask for (speculative decoding verifies its
        last token and every proposed one: num_speculative_tokens + 1); 1: its last row.
        max_seqs: most chunks in one step. max_chunk: most tokens in one chunk (verification
        graphs: k + 1, which lets attention pack GQA heads into its tiles); None: any. head: as
        DecodeGraphs's."""
        self.model = model
        self.head = head
        self.lora = lora  # as DecodeGraphs: row slots of LoRA adapters in a fifth token row
        self.sizes = prefill_capture_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.max_seqs = max_seqs
        self.max_chunk = max_chunk
        self.max_rows = self.max_seqs * rows_per_seq
        self.use_graphs = capture
        # As DecodeGraphs: rank 0's input ids (a verification chunk starts with a sampled token).
        self.share_input_ids = get_tp_size() > 1
        t, p = self.max_tokens, self.max_seqs
        w = -(-max_blocks_per_seq // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE
        # input ids, positions, slot mapping, the rows whose final hidden states come out (the
        # first max_rows entries), LoRA slots when lora; then cu_seqlens (p + 1) and context
        # lengths (p)
        rows = 5 if lora else 4
        self.tokens = torch.zeros(rows, max(t, self.max_rows), dtype=torch.int64, device=device)
        self.seq_info = torch.zeros(2 * p + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(p, w, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        # Two staging sets, alternately, as in DecodeGraphs: a copy may still wait behind the
        # previous step when the next one is prepared.
        self.host_tokens = [_host(torch.zeros(rows, max(t, self.max_rows), dtype=torch.int64), pin)
                            for _ in range(2)]
        self.host_seq_info = [_host(torch.zeros(2 * p + 1, dtype=torch.int32), pin) for _ in range(2)]
        self.host_tables = [_host(torch.zeros(p, w, dtype=torch.int32), pin) for _ in range(2)]
        self.parity = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.kept_hidden: dict[int, torch.Tensor | None] = {}  # as DecodeGraphs

    def _metadata(self, size: int) -> AttentionMetadata:
        p = self.max_seqs
        return AttentionMetadata(
            slot_mapping=self.tokens[2, :size], num_decode_tokens=0, decode_block_tables=None,
            decode_context_lens=None, num_prefill_tokens=size,
            prefill_block_tables=self.block_tables, prefill_cu_seqlens_q=self.seq_info[:p + 1],
            prefill_context_lens=self.seq_info[p + 1:],
            prefill_max_seqlen_q=size if self.max_chunk is None else min(size, self.max_chunk))

    def _forward(self, size: int) -> torch.Tensor:
        lora = LoRAMapping(self.tokens[4, :size]) if self.lora else None
        with set_attention_metadata(self._metadata(size)), set_lora_mapping(lora):
            return self._call(size)

    def _call(self, size: int):
        """The model (and head) on the first `size` tokens, giving the rows the fourth token row names."""
        out = self.model(self.tokens[0, :size], self.tokens[1, :size], logits_indices=self.tokens[3, :self.max_rows])
        return out if self.head is None else self.head(out)

    @staticmethod
    def _rows(out, n: int):
        return out[:n]

    def _clear(self) -> None:
        """Inputs that make any graph a no-op: no slots, no sequences."""
        self.tokens[2].fill_(-1)
        self.tokens[3].zero_()
        if self.lora:
            self.tokens[4].fill_(-1)
        self.seq_info.zero_()

    @torch.inference_mode()
    def capture(self) -> None:
        self._clear()
        pool = None
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            self._forward(size)  # compile kernels, warm up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, out)
            self.kept_hidden[size] = kept_hidden_states(self.model)
        for graph, _ in self.graphs.values():  # upload now, not on a request's first token
            graph.replay()
        torch.cuda.synchronize()
        logger.info("captured prefill CUDA graphs for up to %d prompts and token counts %s",
                    self.max_seqs, self.sizes)

    def can_run(self, batch: PreparedBatch) -> bool:
        return (batch.num_decodes == 0 and 0 < batch.num_tokens <= self.max_tokens
                and batch.prefill_cu_seqlens_q is not None
                and len(batch.prefill_cu_seqlens_q) - 1 <= self.max_seqs
                and (self.max_chunk is None or int(np.diff(batch.prefill_cu_seqlens_q).max()) <= self.max_chunk)
                and batch.prefill_block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, batch: PreparedBatch, rows: list[int] | None = None) -> torch.Tensor:
        """Final hidden states of each chunk's last token, one row per chunk; or of these rows
        of the batch (at most max_rows), in this order."""
        n = batch.num_tokens
        size = next(s for s in self.sizes if s >= n)
        p, chunks = self.max_seqs, len(batch.prefill_cu_seqlens_q) - 1
        width = batch.prefill_block_tables.shape[1]
        self.parity ^= 1
        host_tokens = self.host_tokens[self.parity]
        host_info = self.host_seq_info[self.parity]
        host_tables = self.host_tables[self.parity]
        ht = host_tokens.numpy()
        ht[0, :n] = batch.input_ids
        ht[1, :n] = batch.positions
        ht[2, :n] = batch.slot_mapping
        ht[:2, n:size] = 0
        ht[2, n:size] = -1  # padding tokens store nothing
        if self.lora:
            _fill_lora_row(ht[4], batch.lora_slots, n, size)
        wanted = batch.prefill_cu_seqlens_q[1:] - 1 if rows is None else rows
        ht[3, :len(wanted)] = wanted
        ht[3, len(wanted):self.max_rows] = 0  # unused rows: a real row, computed and dropped
        hi = host_info.numpy()
        hi[:chunks + 1] = batch.prefill_cu_seqlens_q
        hi[chunks + 1:p + 1] = n  # unused sequences: no tokens ...
        hi[p + 1:p + 1 + chunks] = batch.prefill_context_lens
        hi[p + 1 + chunks:] = 0  # ... and no context
        host_tables.numpy()[:chunks, :width] = batch.prefill_block_tables
        cols = max(size, self.max_rows)
        self.tokens[:, :cols].copy_(host_tokens[:, :cols], non_blocking=True)
        self.seq_info.copy_(host_info, non_blocking=True)
        self.block_tables[:chunks, :width].copy_(host_tables[:chunks, :width], non_blocking=True)
        if self.share_input_ids:
            tp_broadcast(self.tokens[0, :n])
        if not self.use_graphs:
            return self._rows(self._forward(size), len(wanted))
        graph, out = self.graphs[size]
        graph.replay()
        restore_kept_hidden_states(self.model, self.kept_hidden[size])
        return self._rows(out, len(wanted))


class HeadPrefillGraphs(PrefillGraphs):
    """Prefill graphs of an EAGLE head's first pass (each sequence a short chunk of what the
    step computed): each token's input hidden state goes in a static buffer too, and the graph
    gives the head's two outputs at each chunk's last row."""

    def __init__(self, model: nn.Module, hidden_size: int, dtype: torch.dtype, max_tokens: int,
                 max_blocks_per_seq: int, device: torch.device, max_seqs: int, max_chunk: int,
                 capture: bool = True, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__(model, max_tokens, max_blocks_per_seq, device, capture=capture, max_seqs=max_seqs,
                         max_chunk=max_chunk, head=head)
        self.hidden = torch.zeros(self.max_tokens, hidden_size, dtype=dtype, device=device)

    def run_with_hidden(self, batch: PreparedBatch, hidden: torch.Tensor):
        self.hidden[:batch.num_tokens].copy_(hidden)
        return self.run(batch)

    def _call(self, size: int):
        rows = self.tokens[3, :self.max_rows]
        carry, normed = self.model(self.tokens[0, :size], self.tokens[1, :size], self.hidden[:size])
        return carry[rows], (normed[rows] if self.head is None else self.head(normed[rows]))

    @staticmethod
    def _rows(out, n: int):
        return tuple(t[:n] for t in out)


def kept_hidden_states(model: nn.Module) -> torch.Tensor | None:
    """The hidden states the model keeps for an EAGLE head (CausalLM.keep_hidden_states), as
    the forward just made them: captured, that is the graph's own buffer."""
    return getattr(model, "aux_hidden_states", None)


def restore_kept_hidden_states(model: nn.Module, kept: torch.Tensor | None) -> None:
    """After a replay, the model's kept hidden states are the replayed graph's buffer."""
    if kept is not None:
        model.aux_hidden_states = kept


def _fill_lora_row(row, lora_slots, n: int, end: int) -> None:
    """Each of the n rows' LoRA slot (-1: none, also when the step has no adapter at all), then
    -1 on the padding rows up to `end`."""
    row[:n] = -1 if lora_slots is None else lora_slots
    row[n:end] = -1


def _host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    return t.pin_memory() if pin else t
