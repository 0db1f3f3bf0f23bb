"""Token counts for repetition, frequency and presence penalties, kept on the device.

A sequence with a penalty holds a slot of `PenaltyCounts` while it runs: a row of counts of
its output tokens and a row marking its prompt's tokens. The slot is filled once from the
host's tokens when the sequence first samples (or first again after a preemption freed it), and
from then on the sampler adds each token it samples to the counts on the device, in stream
order. So a step's sampling reads every earlier step's token, those of a step still in flight
included, with no work on the host that grows with the sequence's length, and the engine can
launch the next step before it has taken the previous step's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence as Seq

import numpy as np
import torch

from tritium import kernels


@dataclass
class PenaltyRows:
    """The rows of one step that have a penalty: where their counts are and their values."""
    counts: "PenaltyCounts"
    rows: torch.Tensor | None  # [Q] rows of the batch; None: every row, in order
    slots: torch.Tensor  # [Q] their slots
    repetition: torch.Tensor | None  # [Q] float32 (1.0: none); None when no row has one
    frequency: torch.Tensor | None  # [Q] float32; None when no row has frequency or presence
    presence: torch.Tensor | None  # [Q] float32
    count_samples: bool  # add the tokens sampled for these rows to their counts
    # Speculative decoding: a sequence verifying k proposals has a run of k + 1 rows, row j
    # conditioned on proposals 0..j-1 having been taken, so its penalties count them too:
    # `proposed` = (q [E], token ids [E], times [E]): row q's token is counted `times` more than
    # its slot says (None: no row follows a proposal). A row's sampled token is counted only
    # when every earlier row of its run sampled its proposal, as the engine keeps it only then:
    # `drafts` [Q] (the proposal each row verifies, -1 for none) and `run_first` [Q] (the index
    # of its run's first row among these rows).
    proposed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    drafts: torch.Tensor | None = None
    run_first: torch.Tensor | None = None

    def kept(self, sampled: torch.Tensor) -> torch.Tensor | None:
        """Which of these rows' sampled tokens the engine keeps (None: all)."""
        if self.drafts is None:
            return None
        missed = ((self.drafts >= 0) & (sampled != self.drafts)).to(torch.int32)
        before = torch.cumsum(missed, 0) - missed  # proposals missed by the rows before each
        return before == before[self.run_first]  # none of them in its own run


class PenaltyCounts:
    """Per-sequence token counts on the device, one slot per running sequence with a penalty.

    `output_counts[slot, t]`: how often the sequence has sampled token t; `in_prompt[slot, t]`:
    whether t is in its prompt (vLLM's repetition penalty covers prompt and output)."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device,
                 max_count: int = 2**31 - 1) -> None:
        """max_count: the most tokens a sequence can have (16-bit counts when it fits)."""
        dtype = torch.int16 if max_count < 2**15 else torch.int32
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts = torch.zeros((num_slots, vocab_size), dtype=dtype, device=device)
        self.in_prompt = torch.zeros((num_slots, vocab_size), dtype=torch.bool, device=device)
        self._one = torch.ones((), dtype=dtype, device=device)  # what `count` adds to each (slot, token)
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[int, int] = {}  # seq_id -> slot

    @classmethod
    def transient(cls, seqs: Seq[Any], vocab_size: int, device: torch.device,
                  proposed: dict[int, int] | None = None) -> "PenaltyCounts":
        """A table for one sampling call, slot i filled from sequence i's tokens (a sampler used
        on its own, without an engine's table), the `proposed[seq_id]` last ones left out."""
        table = cls(len(seqs), vocab_size, device)
        table._fill(list(enumerate(seqs)), proposed)
        return table

    @property
    def nbytes(self) -> int:
        return self.output_counts.nbytes + self.in_prompt.nbytes

    def slots_for(self, seqs: Seq[Any], proposed: dict[int, int] | None = None) -> list[int]:
        """Each sequence's slot; sequences without one take a free slot, filled from their
        tokens on the host (placeholders of steps in flight left out: a new slot is taken only
        before a sequence's first sample, or after a preemption freed it; so are the
        `proposed[seq_id]` last tokens of a sequence verifying proposals)."""
        slots: list[int] = []
        new: list[tuple[int, Any]] = []
        for seq in seqs:
            slot = self._slot_of.get(seq.seq_id)
            if slot is None:
                if not self._free:
                    raise RuntimeError(f"penalties: all {len(self._slot_of)} count slots are taken "
                                       "(more sequences with penalties than max_num_seqs)")
                slot = self._free.pop()
                self._slot_of[seq.seq_id] = slot
                new.append((slot, seq))
            slots.append(slot)
        if new:
            self._fill(new, proposed or {})
        return slots

    def count(self, slots: torch.Tensor, token_ids: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        """Add one sampled token per slot (queued on the device like the step itself); with
        `kept` (bool per token), only those."""
        ones = self._one.expand(slots.shape) if kept is None else kept.to(self.output_counts.dtype)
        self.output_counts.index_put_((slots, token_ids), ones, accumulate=True)

    def release(self, seq_ids: Seq[int]) -> None:
        """Free the slots of sequences that stopped running (finished, aborted, preempted: a
        preempted one is filled again from its tokens when it next samples)."""
        for seq_id in seq_ids:
            slot = self._slot_of.pop(seq_id, None)
            if slot is not None:
                self._free.append(slot)

    def _fill(self, new: list[tuple[int, Any]], proposed: dict[int, int] | None = None) -> None:
        slot_list = [slot for slot, _ in new]
        prompt_rows, prompt_ids, output_rows, output_ids = [], [], [], []
        for slot, seq in new:
            tokens = np.asarray(seq.token_ids, dtype=np.int64)
            if proposed and proposed.get(seq.seq_id):
                tokens = tokens[:len(tokens) - proposed[seq.seq_id]]
            prompt, output = tokens[:seq.num_prompt_tokens], tokens[seq.num_prompt_tokens:]
            prompt = np.unique(prompt[(prompt >= 0) & (prompt < self.vocab_size)])
            output = output[(output >= 0) & (output < self.vocab_size)]  # no placeholders
            prompt_rows.append(np.full(len(prompt), slot, dtype=np.int64))
            prompt_ids.append(prompt)
            output_rows.append(np.full(len(output), slot, dtype=np.int64))
            output_ids.append(output)
        slots = self._to_device(np.asarray(slot_list, dtype=np.int64))
        self.output_counts[slots] = 0
        self.in_prompt[slots] = False
        rows, ids = np.concatenate(prompt_rows), np.concatenate(prompt_ids)
        if len(ids):
            self.in_prompt[self._to_device(rows), self._to_device(ids)] = True
        rows, ids = np.concatenate(output_rows), np.concatenate(output_ids)
        if len(ids):
            self.count(self._to_device(rows), self._to_device(ids))

    def _to_device(self, values: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(values)
        if self.device.type != "cuda":
            return t
        # From pinned memory: a pageable copy would wait for the step still running on the device.
        return t.pin_memory().to(self.device, non_blocking=True)


def apply_penalties(logits: torch.Tensor, p: PenaltyRows) -> torch.Tensor:
    """Repetition (divide positive logits, multiply negative ones, for tokens in the prompt or
    output), then frequency and presence (subtract per output count, and once per token
    sampled), on the rows that have them, in place: one Triton pass on CUDA."""
    if p.proposed is None:
        return kernels.apply_penalties(logits, p.rows, p.slots, p.counts.output_counts, p.counts.in_prompt,
                                   p.repetition, p.frequency, p.presence)
    # Verification rows: every row from its slot's counts, then the tokens proposed before a
    # row recomputed from their logits as they were, with the proposals counted: the kernel's
    # operations in its order, so the same roundings. Such a token has been sampled (count >= 1),
    # so the repetition penalty and the presence penalty both apply.
    q, ids, times = p.proposed
    rows = q if p.rows is None else p.rows[q]
    raw = logits[rows, ids]
    kernels.apply_penalties(logits, p.rows, p.slots, p.counts.output_counts, p.counts.in_prompt,
                        p.repetition, p.frequency, p.presence)
    counts = p.counts.output_counts[p.slots[q], ids].to(torch.float32) + times
    x = raw
    if p.repetition is not None:
        rep = p.repetition[q]
        x = torch.where(x > 0, x / rep, x * rep)
    if p.frequency is not None:
        x = x - (p.frequency[q] * counts + p.presence[q])
    logits[rows, ids] = x
    return logits
