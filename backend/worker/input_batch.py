"""Packs one step's scheduled tokens into model inputs and attention metadata."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch

from ..layers.forward_context import AttentionMetadata
from ..step import ScheduledSequence
from .request_states import RequestState

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


def block_table_matrix(states: list[RequestState]) -> np.ndarray:
    """The states' block tables as one int32 matrix, each row reused from the step before
    while its table is unchanged (`RequestState.block_row`)."""
    arrays = [s.block_row() for s in states]
    lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    width = _padded_width(int(lengths.max()))
    matrix = np.zeros((len(arrays), width), dtype=np.int32)
    matrix[np.arange(width) < lengths[:, None]] = np.concatenate(arrays)
    return matrix


def prepare_batch(scheduled: list[ScheduledSequence], states: Mapping[int, RequestState], block_size: int,
                  lora: bool = False, all_chunks: bool = False) -> PreparedBatch:
    """Decodes (one new token) first, then prompt chunks, each read from the worker's state of
    its sequence (`states`, by seq id). lora: the engine serves LoRA adapters, so the batch
    says which one each token uses. all_chunks: every item as a chunk, decodes as chunks of one
    token (a verification step of speculative decoding, so that the prefill graphs can run it
    whole)."""
    decodes = [] if all_chunks else [it for it in scheduled if it.num_new_tokens == 1]
    prefills = list(scheduled) if all_chunks else [it for it in scheduled if it.num_new_tokens > 1]
    decode_states = [states[it.seq_id] for it in decodes]
    prefill_states = [states[it.seq_id] for it in prefills]
    nd = len(decodes)
    ids, pos, slots = [], [], []
    last_index: dict[int, int] = {}
    for i, s in enumerate(decode_states):
        p = s.num_computed_tokens
        ids.append(s.token_ids[p])
        pos.append(p)
        slots.append(s.block_table[p // block_size] * block_size + p % block_size)
        last_index[s.seq_id] = i
    parts_ids = [np.asarray(ids, dtype=np.int64)]
    parts_pos = [np.asarray(pos, dtype=np.int64)]
    parts_slots = [np.asarray(slots, dtype=np.int64)]
    offset = nd
    for it, s in zip(prefills, prefill_states):
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
    if lora and any(s.lora_slot >= 0 for s in decode_states + prefill_states):
        lora_slots = np.asarray([s.lora_slot for s in decode_states] + [
            s.lora_slot for it, s in zip(prefills, prefill_states) for _ in range(it.num_new_tokens)],
            dtype=np.int64)
    cu = None
    if prefills:
        cu = np.zeros(len(prefills) + 1, dtype=np.int32)
        np.cumsum([it.num_new_tokens for it in prefills], out=cu[1:])
    return PreparedBatch(
        input_ids=np.concatenate(parts_ids), positions=np.concatenate(parts_pos),
        slot_mapping=np.concatenate(parts_slots), num_decodes=nd,
        decode_block_tables=block_table_matrix(decode_states) if decodes else None,
        decode_context_lens=np.asarray([s.num_computed_tokens + 1 for s in decode_states],
                                       dtype=np.int32) if decodes else None,
        prefill_block_tables=block_table_matrix(prefill_states) if prefills else None,
        prefill_cu_seqlens_q=cu,
        prefill_context_lens=np.asarray([s.num_computed_tokens + it.num_new_tokens
                                         for it, s in zip(prefills, prefill_states)],
                                        dtype=np.int32) if prefills else None,
        prefill_max_seqlen_q=max((it.num_new_tokens for it in prefills), default=0),
        last_index=last_index, decode_seq_ids=[it.seq_id for it in decodes], lora_slots=lora_slots)
