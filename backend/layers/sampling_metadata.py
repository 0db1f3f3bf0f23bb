"""What a step's sampling works on: the per-row parameters on the device (SamplingMetadata),
built by `Sampler.prepare`, and what it produces (SamplerOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np
import torch

from .penalties import PenaltyRows


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor  # [R] float32, log p(sampled token) under the raw distribution
    top_logprobs: torch.Tensor | None = None  # [R, K] values, K = max requested
    top_token_ids: torch.Tensor | None = None  # [R, K]
    ranks: torch.Tensor | None = None  # [R] rank of the sampled token (1 = most likely)
    num_logprobs: np.ndarray | None = None  # [R] on the host: top logprobs asked for (-1: none)


@dataclass
class SamplingMetadata:
    all_greedy: bool
    greedy: torch.Tensor | None = None  # [R] bool
    temperature: torch.Tensor | None = None  # [R]
    min_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None  # [R] int64, vocab size where disabled
    top_p: torch.Tensor | None = None
    # Seeded rows: (row, seed, sample index, token position), drawn with `generator` reseeded per token
    seeded: list[tuple[int, int, int, int]] = field(default_factory=list)
    generator: torch.Generator | None = None
    # Per-token adjustments of every row at once, as (rows [P], token ids [P], values [P]...)
    # over P (row, token) pairs, or None when no row has any; a row's tokens are distinct.
    min_tokens: tuple[torch.Tensor, ...] | None = None  # stop ids (masked until min_tokens)
    allowed: tuple[torch.Tensor, ...] | None = None  # allowed_token_ids; then the rows, once each
    banned: tuple[torch.Tensor, ...] | None = None  # bad words' next tokens
    logit_bias: tuple[torch.Tensor, ...] | None = None  # ids; bias
    # Rows with repetition, frequency or presence penalties: their token counts on the device
    penalties: PenaltyRows | None = None
    # Rows with a grammar (structured_outputs) and their allowed tokens, as a bitmask
    grammar_rows: torch.Tensor | None = None  # [G] int64
    grammar_bitmask: torch.Tensor | None = None  # [G, ceil(vocab / 32)] int32
    max_logprobs: int = 0
    want_logprobs: bool = False
    row_logprobs: np.ndarray | None = None  # [R] on the host: top logprobs asked for (-1: none)
    # Speculative decoding: the proposed token each random (not greedy) row verifies, -1 where
    # none; None when no such row has one
    drafts: torch.Tensor | None = None  # [R] int64


def host_to_device(values, dtype, device) -> torch.Tensor:
    """A list (as dtype) or a numpy array (as it is) on the device."""
    t = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    # From pinned memory: a pageable copy would wait for the step still running on the device.
    return t.pin_memory().to(device, non_blocking=True)


class TokenPairs:
    """(row, token id, values...) pairs of one kind for all rows of a step, sent to the device
    in one copy per field (a copy and a few kernels per row cost more than the work)."""

    def __init__(self, num_values: int = 0) -> None:
        self.rows: list[np.ndarray] = []
        self.ids: list[np.ndarray] = []
        self.values: list[list[np.ndarray]] = [[] for _ in range(num_values)]

    def add(self, row: int, ids, *values) -> None:
        """ids: distinct token ids; each value an array (one per id) or one for all of them."""
        ids = np.asarray(list(ids) if isinstance(ids, (set, dict)) else ids, dtype=np.int64)
        if not len(ids):
            return
        self.rows.append(np.full(len(ids), row, dtype=np.int64))
        self.ids.append(ids)
        for column, value in zip(self.values, values):
            column.append(np.asarray(value, dtype=np.float32) if np.ndim(value)
                          else np.full(len(ids), value, dtype=np.float32))

    def to(self, device: torch.device) -> tuple[torch.Tensor, ...] | None:
        if not self.rows:
            return None
        return tuple(host_to_device(np.concatenate(parts), None, device) for parts in (self.rows, self.ids, *self.values))
