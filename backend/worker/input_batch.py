"""Packs one step's scheduled tokens into model inputs and attention metadata."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..layers.forward_context import AttentionMetadata
from ..step import ScheduledSequence

_TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32}


@dataclass
class PreparedBatch:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    num_decodes: int
    decode_block_tables: np.ndarray | None  # [num_decodes, width] int32
    decode_context_lens: np.ndarray | None  # [num_decodes] int32
    prefill_block_tables: np.ndarray | None
    prefill_cu_seqlens_q: np.ndarray | None
    prefill_context_lens: np.ndarray | None
    prefill_max_seqlen_q: int
    last_index: dict[int, int]  # seq_id -> index of its last new token in the packed batch
    decode_seq_ids: list[int]  # seq_id of each decode row
    lora_slots: np.ndarray | None = None  # [T] int64: each token's LoRA adapter (-1: none); None: no adapter in the step

    def seq_ids_at(self, token_indices) -> list[int]:
        """Sequence ids of decode tokens (only decodes can read a placeholder token)."""
        nd = self.num_decodes
        if len(token_indices) and int(token_indices[-1]) >= nd:
            raise RuntimeError("a prompt chunk contains a token that is not sampled yet")
        return [self.decode_seq_ids[i] for i in token_indices]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def attention_metadata(self, to_device: Callable[[np.ndarray, torch.dtype], torch.Tensor]) -> AttentionMetadata:
        def dev(a: np.ndarray | None) -> torch.Tensor | None:
            return None if a is None else to_device(a, _TORCH_DTYPES[a.dtype.type])

        nd = self.num_decodes
        return AttentionMetadata(
            slot_mapping=dev(self.slot_mapping), num_decode_tokens=nd,
            decode_block_tables=dev(self.decode_block_tables),
            decode_context_lens=dev(self.decode_context_lens),
            num_prefill_tokens=self.num_tokens - nd,
            prefill_block_tables=dev(self.prefill_block_tables),
            prefill_cu_seqlens_q=dev(self.prefill_cu_seqlens_q),
            prefill_context_lens=dev(self.prefill_context_lens),
            prefill_max_seqlen_q=self.prefill_max_seqlen_q,
            decode_max_context_len=int(self.decode_context_lens.max()) if nd else None)


# Block-table widths are padded to a multiple of 16: the attention kernels take the row stride
# as an argument, and Triton compiles one variant for strides divisible by 16 and another for
# the rest, so an unpadded width would compile a new variant mid-serving (seconds).
TABLE_WIDTH_MULTIPLE = 16


def _padded_width(width: int) -> int:
    return -(-width // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE


def _block_table_matrix(items: list[ScheduledSequence]) -> np.ndarray:
    width = _padded_width(max(len(it.seq.block_table) for it in items))
    table = np.zeros((len(items), width), dtype=np.int32)
    for i, it in enumerate(items):
        bt = it.seq.block_table
        table[i, :len(bt)] = bt
    return table


class DecodeBlockRows:
    """Builds the decode rows' block-table matrix, reusing each sequence's row from the step
    before: converting 256 Python lists of ~40 block ids took ~0.7 ms a step (CPU machine), as
    much as the rest of prepare_batch, and small models' decode steps are bound by host time.

    A kept row is valid while the sequence's table is the same list object with the same last
    entry. Between two steps a decoding sequence's table changes only by appending a block (a
    new last entry: a table never holds a block twice), by copy-on-write of the block its next
    token goes into (the last entry: a table covers exactly the tokens computed so far plus the
    new one), or by being freed (BlockManager.free puts a new list in its place). Rows are kept
    only for the sequences of the last decode batch."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[list[int], int, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def matrix(self, items: list[ScheduledSequence]) -> np.ndarray:
        kept, rows, arrays = self._rows, {}, []
        for it in items:
            seq = it.seq
            table = seq.block_table
            row = kept.get(seq.seq_id)
            if row is None or row[0] is not table or row[1] != table[-1]:
                row = (table, table[-1], np.asarray(table, dtype=np.int32))
            rows[seq.seq_id] = row
            arrays.append(row[2])
        self._rows = rows
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        width = _padded_width(int(lengths.max()))
        matrix = np.zeros((len(arrays), width), dtype=np.int32)
        matrix[np.arange(width) < lengths[:, None]] = np.concatenate(arrays)
        return matrix


def prepare_batch(scheduled: list[ScheduledSequence], block_size: int,
                  decode_rows: DecodeBlockRows | None = None, lora: bool = False,
                  all_chunks: bool = False) -> PreparedBatch:
    """Decodes (one new token) first, then prompt chunks. decode_rows (kept by the caller
    from step to step) reuses the decode rows' block tables. lora: the engine serves LoRA
    adapters, so the batch says which one each token uses. all_chunks: every item as a chunk,
    decodes as chunks of one token (a verification step of speculative decoding, so that the
    prefill graphs can run it whole)."""
    decodes = [] if all_chunks else [it for it in scheduled if it.num_new_tokens == 1]
    prefills = list(scheduled) if all_chunks else [it for it in scheduled if it.num_new_tokens > 1]
    nd = len(decodes)
    ids, pos, slots = [], [], []
    last_index: dict[int, int] = {}
    for i, it in enumerate(decodes):
        s = it.seq
        p = s.num_computed_tokens
        ids.append(s.token_ids[p])
        pos.append(p)
        slots.append(s.block_table[p // block_size] * block_size + p % block_size)
        last_index[s.seq_id] = i
    parts_ids = [np.asarray(ids, dtype=np.int64)]
    parts_pos = [np.asarray(pos, dtype=np.int64)]
    parts_slots = [np.asarray(slots, dtype=np.int64)]
    offset = nd
    for it in prefills:
        s = it.seq
        start, end = s.num_computed_tokens, s.num_computed_tokens + it.num_new_tokens
        p = np.arange(start, end, dtype=np.int64)
        bt = np.asarray(s.block_table, dtype=np.int64)
        # A speculating sequence's proposals follow its last token (they are not its tokens yet).
        tokens = s.token_ids[start:] + it.spec_token_ids if it.spec_token_ids else s.token_ids[start:end]
        parts_ids.append(np.asarray(tokens, dtype=np.int64))
        parts_pos.append(p)
        parts_slots.append(bt[p // block_size] * block_size + p % block_size)
        offset += it.num_new_tokens
        last_index[s.seq_id] = offset - 1
    lora_slots = None
    if lora and any(it.seq.lora_slot >= 0 for it in scheduled):
        lora_slots = np.asarray([it.seq.lora_slot for it in decodes] + [
            it.seq.lora_slot for it in prefills for _ in range(it.num_new_tokens)], dtype=np.int64)
    cu = None
    if prefills:
        cu = np.zeros(len(prefills) + 1, dtype=np.int32)
        np.cumsum([it.num_new_tokens for it in prefills], out=cu[1:])
    return PreparedBatch(
        input_ids=np.concatenate(parts_ids), positions=np.concatenate(parts_pos),
        slot_mapping=np.concatenate(parts_slots), num_decodes=nd,
        decode_block_tables=(None if not decodes else decode_rows.matrix(decodes) if decode_rows is not None
                             else _block_table_matrix(decodes)),
        decode_context_lens=np.asarray([it.seq.num_computed_tokens + 1 for it in decodes],
                                       dtype=np.int32) if decodes else None,
        prefill_block_tables=_block_table_matrix(prefills) if prefills else None,
        prefill_cu_seqlens_q=cu,
        prefill_context_lens=np.asarray([it.seq.num_computed_tokens + it.num_new_tokens
                                         for it in prefills], dtype=np.int32) if prefills else None,
        prefill_max_seqlen_q=max((it.num_new_tokens for it in prefills), default=0),
        last_index=last_index, decode_seq_ids=[it.seq.seq_id for it in decodes], lora_slots=lora_slots)
