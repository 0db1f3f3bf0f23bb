"""What a proposer is. Every method proposes the same thing: for a sequence, up to
`num_speculative_tokens` token ids of the target's vocabulary, each one token, not a
distribution (a point mass, which verification.py verifies alike for every method). Where the
proposals are made differs, so there are two kinds:

- `TokenProposer` (n-gram lookup, ngram.py): on the engine's side, before scheduling, from a
  sequence's own token ids; nothing on the device.
- `ModelProposer` (a draft model, draft_model.py; EAGLE heads, eagle.py): in the worker, right
  after each step's tokens are known, with a model, a paged KV cache on the target's block ids
  and graphs of its own; its proposals reach the engine with the step's results
  (`ModelRunnerOutput.draft_token_ids`).

Either way the engine gathers each step's proposals with `gather_proposals`, bounded by
`proposal_room`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol

import torch

from ..step import SchedulerOutput


def proposal_room(seq, max_seq_len: int) -> int:
    """How many tokens a running sequence may propose now: what its length limits leave after
    the token it surely gets; 0 while a prompt chunk or a token in flight is ahead of it, or
    before min_tokens."""
    p = seq.params
    if (seq.num_tokens - seq.num_computed_tokens != 1 or seq.num_unresolved or seq.finish_reason
            or seq.num_output_tokens < p.min_tokens):
        return 0
    room = max_seq_len - seq.num_tokens
    if p.max_tokens is not None:
        room = min(room, p.max_tokens - seq.num_output_tokens)
    return room - 1


class TokenProposer(Protocol):
    """Proposes from a sequence's token ids, on the engine's side (n-gram lookup)."""

    def propose(self, token_ids: list[int], max_tokens: int, key: object = None) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) proposed tokens; `key` names the
        sequence across calls (its earlier tokens unchanged), so that the proposer may keep an
        index of it."""
        ...

    def retain(self, keys: set) -> None:
        """Forget what was kept for every other key."""
        ...


@dataclass
class TargetHidden:
    """The target's kept hidden states of a step's packed rows (EAGLE reads them) and each
    scheduled sequence's first row among them."""
    hidden: torch.Tensor
    first_row: dict[int, int]


class ModelProposer(Protocol):
    """Proposes in the worker after each step, with a model of its own (a draft model, EAGLE
    heads) whose KV cache uses the target's block ids."""

    # Whether `propose` reads the target's hidden states of the step (`TargetHidden`).
    reads_target_hidden: bool

    @property
    def block_bytes(self) -> int:
        """Bytes of its KV cache per block (the memory profile counts them with the target's)."""
        ...

    def allocate_cache(self, num_blocks: int) -> None: ...

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write of the target's blocks, applied to its own cache too."""
        ...

    def build_graphs(self, capture: bool) -> None: ...

    def propose(self, step: SchedulerOutput, starts: dict[int, int], states: Any,
                target: TargetHidden | None = None) -> dict[int, list[int]]:
        """Proposals (seq id -> up to k tokens) of each sequence that sampled a token in the
        step, once its tokens are in the worker's states (`RequestStates`); `starts`: each
        scheduled sequence's computed tokens before the step."""
        ...


def gather_proposals(running: Iterable, max_seq_len: int, proposer: TokenProposer | None,
                     draft_token_ids: dict[int, list[int]]) -> dict[int, list[int]]:
    """Proposed tokens for each running decode (the engine's sequences), at most what its length
    limits leave after one token (none before min_tokens): the token proposer's, or else those a
    model proposer made after the last step (`draft_token_ids`, by seq id)."""
    proposals = {}
    for seq in running:
        if (room := proposal_room(seq, max_seq_len)) > 0:
            proposals[seq.seq_id] = (proposer.propose(seq.token_ids, room, seq.seq_id) if proposer
                                     else draft_token_ids.get(seq.seq_id, [])[:room])
    if proposer is not None:
        proposer.retain({seq.seq_id for seq in running})
    return proposals
