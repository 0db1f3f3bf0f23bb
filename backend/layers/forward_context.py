"""Per-step attention metadata, set by the model runner around a forward pass, so that a model's
`forward(input_ids, positions)` stays free of serving details."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Generic, Iterator, TypeVar

import torch

T = TypeVar("T")


class _StepValue(Generic[T]):
    """A value the layers read during one forward pass, set around it by the model runner."""

    def __init__(self) -> None:
        self.current: T | None = None

    def get(self) -> T | None:
        return self.current

    @contextlib.contextmanager
    def set(self, value: T | None) -> Iterator[None]:
        previous, self.current = self.current, value
        try:
            yield
        finally:
            self.current = previous


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


_attention: _StepValue[AttentionMetadata] = _StepValue()
get_attention_metadata = _attention.get
set_attention_metadata = _attention.set


class LoRAMapping:
    """Which LoRA adapter each row of a step uses (slot, -1: none). `slots` follows the rows the
    layers see: every token's at first, then only the sampled rows' once the last decoder layer
    keeps those alone (`select_lora_rows`)."""

    def __init__(self, token_slots: torch.Tensor) -> None:
        self.slots = token_slots  # [rows] int32 or int64


_lora: _StepValue[LoRAMapping] = _StepValue()
get_lora_mapping = _lora.get
set_lora_mapping = _lora.set


def select_lora_rows(rows: torch.Tensor) -> None:
    """The layers from here on see only these rows of the step, in this order."""
    mapping = _lora.get()
    if mapping is not None:
        mapping.slots = mapping.slots[rows]
