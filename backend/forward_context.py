"""Per-step attention metadata, set by the model runner around a forward pass, so that a model's
`forward(input_ids, positions)` stays free of serving details."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class AttentionMetadata:
    """The batch is packed decodes first (one token each), then prefill chunks."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token, -1 = skip
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32, including the new token
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor | None  # [num_prefills, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor | None  # [num_prefills + 1] int32
    prefill_context_lens: torch.Tensor | None  # [num_prefills] int32, cached prefix + chunk
    prefill_max_seqlen_q: int = 0
    # Host-side bound on decode_context_lens: sizes the decode kernel's KV split without a sync.
    decode_max_context_len: int | None = None


_current: AttentionMetadata | None = None


def get_attention_metadata() -> AttentionMetadata | None:
    return _current


@contextlib.contextmanager
def set_attention_metadata(metadata: AttentionMetadata | None) -> Iterator[None]:
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous


class LoRAMapping:
    """Which LoRA adapter each row of a step uses (slot, -1: none). `slots` follows the rows the
    layers see: every token's at first, then only the sampled rows' once the last decoder layer
    keeps those alone (`select_lora_rows`)."""

    def __init__(self, token_slots: torch.Tensor) -> None:
        self.slots = token_slots  # [rows] int32 or int64


_lora: LoRAMapping | None = None


def get_lora_mapping() -> LoRAMapping | None:
    return _lora


def select_lora_rows(rows: torch.Tensor) -> None:
    """The layers from here on see only these rows of the step, in this order."""
    if _lora is not None:
        _lora.slots = _lora.slots[rows]


@contextlib.contextmanager
def set_lora_mapping(mapping: LoRAMapping | None) -> Iterator[None]:
    global _lora
    previous, _lora = _lora, mapping
    try:
        yield
    finally:
        _lora = previous
