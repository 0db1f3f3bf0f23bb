"""CUDA graphs for decode-only steps: the model's forward for a batch of one-token sequences,
captured once per padded batch size over static input buffers, then replayed. This removes the
per-kernel launch cost (hundreds of launches per step) that dominates small decode batches."""
from __future__ import annotations

import logging

import torch
from torch import nn

from .forward_context import AttentionMetadata, set_attention_metadata
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
                 max_model_len: int, device: torch.device) -> None:
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.max_model_len = max_model_len
        n, w = self.max_bs, -(-max_blocks_per_seq // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE
        # input ids, positions, slot mapping, context lengths: one buffer, one copy per step
        self.vectors = torch.zeros(4, n, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.vectors[0], self.vectors[1], self.vectors[2]
        self.slot_mapping.fill_(-1)
        self.block_tables = torch.zeros(n, w, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        # Pinned staging: two asynchronous copies per step instead of five synchronous ones.
        # Two sets, used alternately: the copy queued for step N may still be waiting behind
        # step N-1 on the device when step N+1 is prepared; step N+2 comes after N was taken.
        self.host_vectors = [torch.zeros(4, n, dtype=torch.int64).pin_memory() for _ in range(2)]
        self.host_tables = [torch.zeros(n, w, dtype=torch.int32).pin_memory() for _ in range(2)]
        self.parity = 0
        self.buckets = context_buckets(max_model_len)
        # (context bucket, batch size) -> (graph, output)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _metadata(self, bs: int, max_context_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], num_decode_tokens=bs,
            decode_block_tables=self.block_tables[:bs], decode_context_lens=self.context_lens[:bs],
            num_prefill_tokens=0, prefill_block_tables=None, prefill_cu_seqlens_q=None,
            prefill_context_lens=None, decode_max_context_len=max_context_len)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for bucket in reversed(self.buckets):
            for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
                md = self._metadata(bs, bucket)
                with set_attention_metadata(md):
                    self.model(self.input_ids[:bs], self.positions[:bs])  # compile kernels, warm up
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self.model(self.input_ids[:bs], self.positions[:bs])
                pool = graph.pool()
                self.graphs[(bucket, bs)] = (graph, out)
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
        sampling, read from its output tensor on the device."""
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
        host_tables.numpy()[:n, :width] = batch.decode_block_tables
        self.vectors[:, :bs].copy_(host_vectors[:, :bs], non_blocking=True)
        self.block_tables[:n, :width].copy_(host_tables[:n, :width], non_blocking=True)
        self.context_lens[:bs].copy_(self.vectors[3, :bs])  # the kernel reads int32
        if fill is not None:
            self.input_ids[fill[0]] = fill[2][fill[1]]
        longest = int(batch.decode_context_lens.max())
        bucket = next(b for b in self.buckets if b >= longest)
        graph, out = self.graphs[(bucket, bs)]
        graph.replay()
        return out[:n]
