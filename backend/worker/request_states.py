"""The worker's own state of each sequence it holds, kept from step to step (vLLM v1's
persistent input batch, in our size).

A sequence arrives once as `NewSequenceData` (its tokens, parameters, blocks); later steps
send only its computed-token count and block-table tail (`CachedSequenceData`). The worker
appends the tokens it samples itself: a placeholder for an ordinary sample row when the step
is launched, filled in when the step's results arrive; a verification run's kept tokens when
they arrive. The scheduler's count of computed tokens is checked against the worker's own: a
difference is a bug of one side, reported, never repaired.

A tensor-parallel rank > 0 keeps the same states from the same steps but never learns sampled
tokens (only rank 0 samples; the input ids of each step reach it by broadcast): its sampled
tokens stay placeholders, and after a verification run it adopts the scheduler's count of
computed tokens, the accepted proposals being known to rank 0 only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from ..step import PLACEHOLDER, Fork, NewSequenceData, SchedulerOutput


@dataclass
class RequestState:
    """What the worker holds of one sequence: the fields `prepare_batch` and the sampler read."""
    seq_id: int
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: Any  # SamplingParams
    block_table: list[int]
    num_computed_tokens: int
    lora_slot: int = -1
    # A rank that does not receive results: the proposals of the verification run launched
    # last, of which the scheduler's next count tells how many were accepted (None: no run).
    unverified_proposals: int | None = None
    _block_row: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def from_new(cls, data: NewSequenceData) -> "RequestState":
        return cls(data.seq_id, data.index, list(data.token_ids), data.num_prompt_tokens, data.params,
                   list(data.block_ids), data.num_computed_tokens, data.lora_slot)

    def block_row(self) -> np.ndarray:
        """The block table as int32, made again only after the table changed (converting every
        decode's table each step costs as much as the rest of a small model's step on the host)."""
        if self._block_row is None:
            self._block_row = np.asarray(self.block_table, dtype=np.int32)
        return self._block_row

    def set_blocks_from(self, start: int, block_ids: list[int]) -> None:
        if start > len(self.block_table):
            raise RuntimeError(f"step contract: sequence {self.seq_id}'s block table changes from "
                               f"index {start}, past its {len(self.block_table)} blocks")
        if block_ids or start < len(self.block_table):
            self.block_table[start:] = block_ids
            self._block_row = None

    def clone(self, seq_id: int, index: int) -> "RequestState":
        return RequestState(seq_id, index, list(self.token_ids), self.num_prompt_tokens, self.params,
                            list(self.block_table), self.num_computed_tokens, self.lora_slot)


class RequestStates:
    """The states of the sequences the worker holds, by seq id."""

    def __init__(self, receives_results: bool = True) -> None:
        """receives_results: the step's sampled tokens arrive here (`PendingStep.wait`), as on
        rank 0; False on a tensor-parallel rank > 0."""
        self._states: dict[int, RequestState] = {}
        self.receives_results = receives_results

    def __len__(self) -> int:
        return len(self._states)

    def __getitem__(self, seq_id: int) -> RequestState:
        try:
            return self._states[seq_id]
        except KeyError:
            raise RuntimeError(f"step contract: the step names sequence {seq_id}, which the worker "
                               "does not hold (it was never sent as new, or was freed)") from None

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._states

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._states.pop(seq_id, None)

    def apply(self, step: SchedulerOutput) -> list[RequestState]:
        """Free the finished sequences, add the new ones, apply the held ones' changes (checking
        their computed tokens); returns the states added."""
        self.release(step.finished_seq_ids)
        added = []
        for data in step.new_sequences:
            if data.seq_id in self._states:
                raise RuntimeError(f"step contract: sequence {data.seq_id} is sent as new, but the "
                                   "worker holds it already")
            state = self._states[data.seq_id] = RequestState.from_new(data)
            added.append(state)
        states = self._states
        for diff in step.cached_sequences:
            state = states.get(diff.seq_id)
            if state is None:
                state = self[diff.seq_id]  # (raises)
            if state.unverified_proposals is not None:
                self._adopt_verified_count(state, diff.num_computed_tokens)
            elif diff.num_computed_tokens != state.num_computed_tokens:
                raise RuntimeError(
                    f"step contract: the scheduler counts {diff.num_computed_tokens} computed tokens "
                    f"of sequence {diff.seq_id}, the worker {state.num_computed_tokens}")
            if diff.new_block_ids or diff.blocks_from < len(state.block_table):
                state.set_blocks_from(diff.blocks_from, diff.new_block_ids)
        return added

    @staticmethod
    def _adopt_verified_count(state: RequestState, computed: int) -> None:
        """A rank without results after a verification run: the scheduler's count includes the
        accepted proposals; the tokens up to it and the next one are there, of unknown value
        (their ids reach this rank by broadcast)."""
        pending, state.unverified_proposals = state.unverified_proposals, None
        if not state.num_computed_tokens <= computed <= state.num_computed_tokens + pending:
            raise RuntimeError(
                f"step contract: the scheduler counts {computed} computed tokens of sequence "
                f"{state.seq_id} after a verification run of {pending} proposals from "
                f"{state.num_computed_tokens}")
        state.num_computed_tokens = computed
        state.token_ids.extend([PLACEHOLDER] * (computed + 1 - len(state.token_ids)))

    def book_launch(self, step: SchedulerOutput, row_states: list[RequestState]
                    ) -> tuple[list[tuple[RequestState, int] | None], list[RequestState]]:
        """The states after the launch, as the scheduler books it: the known new tokens count as
        computed (a verification run's accepted proposals on arrival), siblings start from their
        parent's count, and each ordinary sample row leaves a placeholder. Returns, per sample
        row, (state, position of its placeholder) or None for a verification row, and the state
        of each verification run: what `PendingStep.wait()` completes."""
        for item in step.scheduled:
            self[item.seq_id].num_computed_tokens += item.num_known_tokens
        for fork in step.forks:
            computed = self[fork.parent].num_computed_tokens
            for child in fork.children:
                self[child].num_computed_tokens = computed
        speculating = {run.seq_id for run in step.spec_runs}
        placeholders: list[tuple[RequestState, int] | None] = []
        if not self.receives_results:
            for run in step.spec_runs:
                self[run.seq_id].unverified_proposals = len(run.proposed)
        for state in row_states:
            if state.seq_id in speculating:
                placeholders.append(None)
            else:
                state.token_ids.append(PLACEHOLDER)
                placeholders.append((state, len(state.token_ids) - 1))
        return placeholders, [self[run.seq_id] for run in step.spec_runs]

    def fork(self, fork: Fork) -> list[RequestState]:
        """Each sibling starts as a copy of its parent (after the parent's step is booked)."""
        parent = self[fork.parent]
        children = []
        for seq_id, index in zip(fork.children, fork.indices):
            child = self._states[seq_id] = parent.clone(seq_id, index)
            children.append(child)
        return children

