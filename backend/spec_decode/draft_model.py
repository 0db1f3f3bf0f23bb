"""Proposals from a draft model (vLLM's `speculative_config={"model": DRAFT_DIR, ...}`).

The draft runs in the worker after every step, on the target's device, with a paged KV cache
of its own that uses the target's block tables: a block id names the same token positions in
both caches, so a sequence's draft and target keys and values are allocated, freed, preempted
and prefix-cached together by the one block manager.

After a step's tokens are known (`PendingStep.wait`), one batched pass runs the draft over
every position the target computed in the step (prompt chunks, decodes, accepted proposals)
and the newly sampled token, so the draft's cache always covers what the target's does; each
sequence that sampled a token then proposes the draft's argmax there, and `k - 1` one-token
passes extend the proposals. Proposals are greedy, as vLLM v1 drafts: the verifier's rejection
sampling treats each as a point mass (`verify_drafts`, verification.py), which keeps sampled
requests' tokens distributed exactly as the target's. A proposal goes only as far as the
sequence's allocated blocks (the scheduler adds `num_speculative_tokens` slots of lookahead
to each step) and max_model_len.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..engine_config import EngineConfig
from ..layers.forward_context import set_attention_metadata
from ..layers.sampling_metadata import host_to_device
from ..step import SchedulerOutput
from ..worker.cuda_graph import SPEC_GRAPH_MAX_SEQS, DecodeGraphs, PrefillGraphs
from ..worker.input_batch import PreparedBatch, block_table_matrix
from ..worker.model_builder import build_model
from ..worker.request_states import RequestState, RequestStates
from ..worker.device import resolve_dtype
from .proposer import TargetHidden


@dataclass
class DraftSpan:
    """A sequence's share of the draft's first pass: positions `start`..`end` - 1 (what the
    target computed in the step, then its new token when it fits), and whether it proposes."""
    state: RequestState
    start: int
    end: int
    proposes: bool


@dataclass
class DraftOut:
    """A draft pass's rows: their greedy proposals (target token ids), and (EAGLE) the state
    the next pass continues from; None for a draft model, whose cache carries everything."""
    token_ids: torch.Tensor
    carry: torch.Tensor | None = None

    def rows(self, index: torch.Tensor) -> "DraftOut":
        return DraftOut(self.token_ids[index], None if self.carry is None else self.carry[index])


class DraftModelProposer:
    """The draft model, its KV cache and graphs, and the passes that propose (a `ModelProposer`,
    proposer.py)."""

    reads_target_hidden = False  # (EAGLE heads do)

    def __init__(self, config: EngineConfig, device: torch.device, target) -> None:
        """target: the target model (its vocabulary bounds the proposals; EAGLE heads read it)."""
        spec = config.speculative_config
        draft_config = spec.draft_model_config
        self.k = spec.num_speculative_tokens
        self.device = device
        self.dtype = resolve_dtype(draft_config, device)
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.model_config.max_model_len
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.max_num_batched_tokens = config.scheduler_config.max_num_batched_tokens
        self.target_vocab_size = target.config.vocab_size
        self.model = self._build(draft_config, target)
        self.attn_layers = self.model.attention_layers()
        self.kv_cache: torch.Tensor | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.decode_graphs: DecodeGraphs | None = None

    def _build(self, draft_config, target):
        # Random weights (load_format=dummy) from another seed than the target's: a draft of
        # the target's shape must not be the target itself.
        return build_model(draft_config, self.device, self.dtype, seed=draft_config.seed + 1).model

    # ---- the KV cache -------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        layer = self.attn_layers[0]
        return 2 * len(self.attn_layers) * self.block_size * layer.num_kv_heads * layer.head_dim * self.dtype.itemsize

    def allocate_cache(self, num_blocks: int) -> None:
        """[2, layers, num_blocks, block_size, Hkv, D]: the same block ids as the target's."""
        layer = self.attn_layers[0]
        self.kv_cache = torch.zeros(2, len(self.attn_layers), num_blocks, self.block_size, layer.num_kv_heads,
                                    layer.head_dim, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.attn_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write of the target's blocks, applied to the draft's cache too."""
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def build_graphs(self, capture: bool) -> None:
        """The first pass's graphs (each sequence a short chunk: its accepted tokens and the
        new one, at most k + 2) and the one-token passes' decode graphs."""
        max_blocks = -(-self.max_model_len // self.block_size)
        seqs = min(self.max_num_seqs, SPEC_GRAPH_MAX_SEQS)
        chunk = self.k + 2
        # The graphs end in the greedy choice: a pass is one replay, its proposals on the device.
        self.prefill_graphs = PrefillGraphs(self.model, min(seqs * chunk, self.max_num_batched_tokens), max_blocks,
                                            self.device, capture=capture, max_seqs=seqs, max_chunk=chunk,
                                            head=self.greedy)
        self.decode_graphs = DecodeGraphs(self.model, self.max_num_seqs, max_blocks, self.max_model_len,
                                          self.device, capture=capture, head=self.greedy)
        if capture:
            self.prefill_graphs.capture()
            self.decode_graphs.capture()

    # ---- proposing ----------------------------------------------------------------------------
    def spans(self, step: SchedulerOutput, starts: dict[int, int], states: RequestStates) -> list[DraftSpan]:
        """Each scheduled sequence's positions for the first pass, once the step's tokens are
        in the worker's states; `starts`: its computed tokens before the step."""
        spans = []
        for item in step.scheduled:
            if item.seq_id not in states:
                continue
            state = states[item.seq_id]
            start, computed = starts[item.seq_id], state.num_computed_tokens
            end, proposes = self._span_end(state, computed)
            if end > start:
                spans.append(DraftSpan(state, start, end, proposes))
        return spans

    def _span_end(self, state: RequestState, computed: int) -> tuple[int, bool]:
        """A draft model runs over the new token too (the step sampled one and every earlier one
        is computed) when its key and value have a slot, and proposes from there."""
        proposes = len(state.token_ids) == computed + 1 and computed < self._capacity(state)
        return (computed + 1 if proposes else computed), proposes

    @torch.inference_mode()
    def propose(self, step: SchedulerOutput, starts: dict[int, int], states: RequestStates,
                target: TargetHidden | None = None) -> dict[int, list[int]]:
        """Proposals (up to k tokens) of each sequence that sampled a token in the step."""
        spans = self.spans(step, starts, states)
        if not spans:
            return {}
        proposing = [i for i, s in enumerate(spans) if s.proposes and step.propose_drafts]
        first = self._first_pass(spans, target)  # (also when none proposes: the draft's cache follows)
        if not proposing:
            return {}
        active = [spans[i] for i in proposing]
        last = first.rows(self._index(proposing))
        tokens = [last.token_ids]
        members = [list(range(len(active)))]  # per pass: which active sequences its rows are
        for j in range(1, self.k):
            # Pass j stores proposal j at position end - 1 + j: only where a block holds it.
            current = members[-1]
            kept = [(r, a) for r, a in enumerate(current) if active[a].end + j - 1 < self._capacity(active[a].state)]
            if not kept:
                break
            rows = self._index([r for r, _ in kept])
            batch = self._decode_batch([active[a] for _, a in kept], j)
            fill = (torch.arange(len(kept), device=self.device), rows, tokens[-1])
            last = self._decode(batch, fill, None if last.carry is None else last.carry[rows])
            tokens.append(last.token_ids.clone())  # (a graph's output buffer: the next replay rewrites it)
            members.append([a for _, a in kept])
        out: dict[int, list[int]] = {}
        # The host waits once, at the first copy: every pass is queued by then.
        for values, mem in zip((t.tolist() for t in tokens), members):
            for value, a in zip(values, mem):
                out.setdefault(active[a].state.seq_id, []).append(value)
        return out

    def _capacity(self, state: RequestState) -> int:
        return min(len(state.block_table) * self.block_size, self.max_model_len)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's argmax among the target's token ids (in its graphs too)."""
        logits = self.model.compute_logits(hidden)[:, :self.target_vocab_size]
        return logits.argmax(dim=-1)

    def _first_pass(self, spans: list[DraftSpan], target: TargetHidden | None) -> DraftOut:
        """The greedy proposal at each span's last row, in span order."""
        batch = self._chunks_batch(spans, shift=0)
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(batch):
            return DraftOut(self.prefill_graphs.run(batch))
        last = self._index(batch.prefill_cu_seqlens_q[1:] - 1)
        return DraftOut(self.greedy(self._eager(batch, self._to_device(batch.input_ids), last)))

    def _chunks_batch(self, spans: list[DraftSpan], shift: int) -> PreparedBatch:
        """Each span's positions as a chunk, with the tokens `shift` positions later (EAGLE
        pairs position t with token t + 1)."""
        bs = self.block_size
        ids, pos, slots, lengths = [], [], [], []
        for s in spans:
            p = np.arange(s.start, s.end, dtype=np.int64)
            table = s.state.block_row().astype(np.int64)
            ids.append(np.asarray(s.state.token_ids[s.start + shift:s.end + shift], dtype=np.int64))
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            lengths.append(s.end - s.start)
        cu = np.zeros(len(spans) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu[1:])
        return PreparedBatch(
            input_ids=np.concatenate(ids), positions=np.concatenate(pos), slot_mapping=np.concatenate(slots),
            num_decodes=0, decode_block_tables=None, decode_context_lens=None,
            prefill_block_tables=block_table_matrix([s.state for s in spans]), prefill_cu_seqlens_q=cu,
            prefill_context_lens=np.asarray([s.end for s in spans], dtype=np.int32),
            prefill_max_seqlen_q=max(lengths), last_index={}, decode_seq_ids=[])

    def _decode_batch(self, active: list[DraftSpan], j: int) -> PreparedBatch:
        """Proposal j of each active sequence as one decode token (its id filled on the device)."""
        bs = self.block_size
        pos = np.asarray([s.end - 1 + j for s in active], dtype=np.int64)
        tables = [s.state.block_table for s in active]
        slots = np.asarray([t[p // bs] * bs + p % bs for t, p in zip(tables, pos.tolist())], dtype=np.int64)
        return PreparedBatch(
            input_ids=np.zeros(len(active), dtype=np.int64), positions=pos, slot_mapping=slots,
            num_decodes=len(active), decode_block_tables=block_table_matrix([s.state for s in active]),
            decode_context_lens=(pos + 1).astype(np.int32), prefill_block_tables=None, prefill_cu_seqlens_q=None,
            prefill_context_lens=None, prefill_max_seqlen_q=0, last_index={},
            decode_seq_ids=[s.state.seq_id for s in active])

    def _decode(self, batch: PreparedBatch, fill, carry: torch.Tensor | None) -> DraftOut:
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            return DraftOut(self.decode_graphs.run(batch, fill))
        input_ids = self._to_device(batch.input_ids)
        input_ids[fill[0]] = fill[2][fill[1]]
        return DraftOut(self.greedy(self._eager(batch, input_ids, None)))

    def _eager(self, batch: PreparedBatch, input_ids: torch.Tensor, extra: torch.Tensor | None):
        """The model on the batch, its third input `extra`: a draft model's output rows (None:
        every row), an EAGLE head's input hidden states."""
        with set_attention_metadata(batch.attention_metadata(self._to_device)):
            return self.model(input_ids, self._to_device(batch.positions), extra)

    def _to_device(self, values, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Host data to the device without a blocking copy (the host keeps queueing passes)."""
        return host_to_device(values, dtype, self.device)

    def _index(self, values) -> torch.Tensor:
        return self._to_device(np.asarray(values, dtype=np.int64))
