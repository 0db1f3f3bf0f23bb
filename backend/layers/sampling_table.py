"""Each running sequence's sampling parameters, written once into per-slot tensors on the device.

A sequence takes a slot when the worker takes it in (`add`); its temperature, min-p,
top-k, top-p, greedy flag and penalty weights go into that slot's entries in one copy per
field, with its seed, sample index and SamplingParams on the host. Every later step reads them
by slot: the step's host work is the slot lookup, one copy of the slot indices to the device,
and a gather per field that the step uses; nothing is rebuilt from the request's parameters.
The slot is freed when the scheduler says the sequence finished or was preempted
(`SchedulerOutput.finished_seq_ids`).
"""
from __future__ import annotations

from typing import Any, Sequence as Seq

import numpy as np
import torch

from .sampling_metadata import host_to_device

# Host columns (one entry per slot) that decide which sampling steps a batch runs.
_FLAGS = ("greedy", "has_min_p", "has_top_k", "has_top_p", "has_penalties", "has_repetition",
          "has_additive", "has_adjustments", "has_seed")


class SamplingTable:
    """Per-slot sampling parameters: device columns (`temperature`, `min_p`, `top_k`, `top_p`,
    `greedy`, `repetition`, `frequency`, `presence`) and host columns (the flags above,
    `logprobs`: the top logprobs asked for, -1 for none; `seed`, `index`, `params`)."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        f32 = dict(dtype=torch.float32, device=device)
        self.temperature = torch.ones(num_slots, **f32)
        self.min_p = torch.zeros(num_slots, **f32)
        self.top_k = torch.full((num_slots,), vocab_size, dtype=torch.int64, device=device)
        self.top_p = torch.ones(num_slots, **f32)
        self.greedy = torch.ones(num_slots, dtype=torch.bool, device=device)
        self.repetition = torch.ones(num_slots, **f32)
        self.frequency = torch.zeros(num_slots, **f32)
        self.presence = torch.zeros(num_slots, **f32)
        self.flags = {name: np.zeros(num_slots, dtype=bool) for name in _FLAGS}
        self.logprobs = np.full(num_slots, -1, dtype=np.int64)
        self.seed: list[int | None] = [None] * num_slots
        self.index = [0] * num_slots
        self.params: list[Any] = [None] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[int, int] = {}  # seq_id -> slot
        self.rows_written = 0  # slots written since start (each sequence once while it runs)
        # Seeded rows reseed it before each draw (`Sampler._sample`): one serves them all.
        self.generator = torch.Generator(device=device)

    @classmethod
    def transient(cls, rows: Seq[Any], vocab_size: int, device: torch.device) -> tuple["SamplingTable", np.ndarray]:
        """A table for one sampling call, slot i written from row i (a sampler used on its own)."""
        table = cls(len(rows), vocab_size, device)
        slots = np.arange(len(rows), dtype=np.int64)
        table._write([(i, r) for i, r in enumerate(rows)])
        return table, slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def add(self, rows: Seq[Any]) -> None:
        """Give each new sequence (a row with `seq_id`, `params`, `index`) a free slot and write
        its parameters there: once, when the worker takes the sequence in."""
        new: list[tuple[int, Any]] = []
        for r in rows:
            if r.seq_id in self._slot_of:
                raise RuntimeError(f"sampling: sequence {r.seq_id} holds a parameter slot already")
            if not self._free:
                raise RuntimeError(f"sampling: all {len(self._slot_of)} parameter slots are taken "
                                   "(more sequences running than max_num_seqs)")
            slot = self._slot_of[r.seq_id] = self._free.pop()
            new.append((slot, r))
        if new:
            self._write(new)

    def slots_for(self, rows: Seq[Any]) -> np.ndarray:
        """Each row's slot (rows of one sequence share it)."""
        slot_of = self._slot_of
        try:
            return np.fromiter((slot_of[r.seq_id] for r in rows), dtype=np.int64, count=len(rows))
        except KeyError as e:
            raise RuntimeError(f"sampling: sequence {e.args[0]} has no parameter slot (it was "
                               "never added, or was released)") from None

    def release(self, seq_ids: Seq[int]) -> None:
        """Free the slots of sequences that stopped running (finished, aborted, preempted)."""
        for seq_id in seq_ids:
            slot = self._slot_of.pop(seq_id, None)
            if slot is not None:
                self.params[slot] = None
                self._free.append(slot)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._slot_of

    def _write(self, new: list[tuple[int, Any]]) -> None:
        slots = [slot for slot, _ in new]
        params = [r.params for _, r in new]
        columns = {
            self.temperature: [1.0 if p.greedy else p.temperature for p in params],
            self.min_p: [p.min_p for p in params],
            self.top_k: [p.top_k if p.top_k > 0 else self.vocab_size for p in params],
            self.top_p: [p.top_p for p in params],
            self.greedy: [p.greedy for p in params],
            self.repetition: [p.repetition_penalty for p in params],
            self.frequency: [p.frequency_penalty for p in params],
            self.presence: [p.presence_penalty for p in params],
        }
        index = host_to_device(slots, torch.int64, self.device)
        for column, values in columns.items():
            column[index] = host_to_device(values, column.dtype, self.device)
        flags = self.flags
        for (slot, r), p in zip(new, params):
            flags["greedy"][slot] = p.greedy
            flags["has_min_p"][slot] = bool(p.min_p)
            flags["has_top_k"][slot] = p.top_k > 0
            flags["has_top_p"][slot] = p.top_p < 1.0
            flags["has_penalties"][slot] = p.has_penalties
            flags["has_repetition"][slot] = p.repetition_penalty != 1.0
            flags["has_additive"][slot] = bool(p.frequency_penalty or p.presence_penalty)
            flags["has_adjustments"][slot] = bool(p.allowed_token_ids is not None or p._bad_words_token_ids
                                                  or p.logit_bias or p.min_tokens)
            flags["has_seed"][slot] = p.seed is not None and not p.greedy
            self.logprobs[slot] = -1 if p.logprobs is None else p.logprobs
            self.seed[slot], self.index[slot], self.params[slot] = p.seed, r.index, p
        self.rows_written += len(new)
