"""What the worker holds of each sequence, as the scheduler knows it: so that a step sends a
sequence's tokens, parameters and blocks once and after that only what changed.

A sequence is sent whole (`NewSequenceData`) the first time it is scheduled and again after a
preemption (the worker freed it: its id was in `finished_seq_ids`); a held one is sent its
computed-token count and the tail of its block table that differs from the table last sent
(`CachedSequenceData`). A forked sibling is held from its fork on, with its parent's table.
"""
from __future__ import annotations

from typing import Callable

from ..step import CachedSequenceData, NewSequenceData, SchedulerOutput
from .sequence import Sequence


class WorkerView:
    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}  # seq id -> the block table the worker holds

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def forget(self, seq_id: int) -> None:
        """The sequence finished or was preempted: the worker frees it with the next step."""
        self._tables.pop(seq_id, None)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The worker copies the parent's state (its table as sent) into the sibling."""
        self._tables[child_id] = list(self._tables[parent_id])

    def describe(self, out: SchedulerOutput, sequence: Callable[[int], Sequence]) -> None:
        """Fill the step's new and cached sequence data for its scheduled sequences."""
        tables = self._tables
        for item in out.scheduled:
            seq = sequence(item.seq_id)
            table = seq.block_table
            sent = tables.get(seq.seq_id)
            if sent is None:
                tables[seq.seq_id] = list(table)
                out.new_sequences.append(NewSequenceData(
                    seq.seq_id, seq.index, list(seq.token_ids), seq.num_prompt_tokens, seq.params,
                    list(table), seq.num_computed_tokens, seq.lora_slot))
                continue
            start = _first_difference(sent, table)
            if start < len(table) or start < len(sent):
                sent[start:] = table[start:]
            out.cached_sequences.append(CachedSequenceData(seq.seq_id, seq.num_computed_tokens, start,
                                                           table[start:]))


def _first_difference(sent: list[int], table: list[int]) -> int:
    """The first index where the tables differ (the length of the shorter when one extends the
    other): between two steps a table grows at its end or has its last block replaced."""
    n = len(sent)
    if len(table) >= n and table[:n] == sent:
        return n
    i = 0
    while i < n and i < len(table) and sent[i] == table[i]:
        i += 1
    return i
