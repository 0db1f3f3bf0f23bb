"""The step contract: what the scheduler decided for one step, the runner's whole input.

The scheduler (backend/core) fills a `SchedulerOutput`; `ModelRunner.execute_model`
(backend/worker) takes it and returns a `PendingStep` whose `wait()` gives a
`ModelRunnerOutput`. Nothing else travels from the engine to the runner, and only the runner
writes its pending step. Both sides import this module and neither imports the other's.

The step is data only, as in vLLM v1: it names sequences by id, carries a sequence's tokens,
parameters and blocks once (when the worker does not hold it yet) and after that only what
changed. The worker keeps its own state of each sequence it holds (backend/worker/
request_states.py) and never sees the engine's `Sequence`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

# A token sampled by a step still running on the device: its id is filled in when the step's
# results arrive; the next step already reads it there, on the device.
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()  # preempted with its blocks in host memory; waits to be swapped in
    WAITING_FOR_REMOTE_KVS = enum.auto()  # its prompt's blocks are being read from another engine
    FINISHED = enum.auto()


@dataclass(frozen=True)
class NewSequenceData:
    """A sequence the worker does not hold yet: first scheduled, or resumed after preemption
    (then with every token so far, its blocks from scratch). Sent once; later steps send only
    a `CachedSequenceData`. `params` is its SamplingParams, written into the worker's sampling
    table when it arrives."""
    seq_id: int
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    params: Any  # SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_slot: int  # -1: no adapter


@dataclass
class CachedSequenceData:
    """A held sequence's change since the step before: its computed tokens as the scheduler
    counts them (the worker checks its own count against it) and its block table from index
    `blocks_from` on (appended blocks, or a copy-on-write block replacing the last)."""
    seq_id: int
    num_computed_tokens: int
    blocks_from: int
    new_block_ids: list[int] = field(default_factory=list)


@dataclass
class ScheduledSequence:
    """A sequence's share of the step: `num_new_tokens` tokens from its computed ones on. With
    speculative decoding its last `len(spec_token_ids)` tokens are proposals, which are
    verified by this step and count as computed only once accepted."""
    seq_id: int
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_known_tokens(self) -> int:
        """New tokens that are not proposals: what the step surely computes."""
        return self.num_new_tokens - len(self.spec_token_ids)


@dataclass(frozen=True)
class SampleRow:
    """One token to sample for sequence `seq_id` (its parameters, generator, grammar), from the
    hidden state `offset` rows before the last new token of the sequence `source` (a forked
    sibling samples from its parent's row). `draft`: the proposed token it verifies, -1 none."""
    seq_id: int
    source: int
    offset: int = 0
    draft: int = -1


@dataclass(frozen=True)
class PromptSpan:
    """Prompt positions first..end-1 of scheduled sequence `seq_id` whose logprobs are asked
    for (the rows of positions first-1..end-2 predict them); the worker reads the tokens and
    how many top logprobs to report from what it holds of the sequence."""
    seq_id: int
    first: int
    end: int


@dataclass(frozen=True)
class SpecRun:
    """A speculating sequence's rows: its last token's and each proposal's, from `first_row`."""
    seq_id: int
    proposed: list[int]
    first_row: int


@dataclass(frozen=True)
class Fork:
    """A parent of n > 1 samples whose prompt completes this step, and its new siblings (child
    j is sample `indices[j]` of the request): the worker copies the parent's state into each
    after the step; they sample from the parent's last row and run from the next step on."""
    parent: int
    children: list[int]
    indices: list[int]


@dataclass
class GrammarBitmask:
    """The tokens each guided sample row's grammar allows, made by the engine from its grammars
    once it has taken the tokens before: `rows` (indices of sample rows) and `bitmask`, a host
    torch.Tensor [len(rows), ceil(vocab / 32)] int32 (bit j of word i allows token 32 i + j)."""
    rows: list[int]
    bitmask: Any


@dataclass
class SchedulerOutput:
    """One step, as data only (it pickles; it holds no engine object): the sequences by id, in
    the order the step packs them; the data of those the worker does not hold yet, and the
    changes of those it holds."""
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    new_sequences: list[NewSequenceData] = field(default_factory=list)
    cached_sequences: list[CachedSequenceData] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    # Preemption by swap: (device block, host block) copies out, then (host block, device block)
    # copies in; the runner makes both before anything of the step writes a block.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_seq_ids: list[int] = field(default_factory=list)
    # Sequences that finished, were aborted or were preempted since the last step: the runner
    # frees what it holds for them (before it adds this step's new sequences).
    finished_seq_ids: list[int] = field(default_factory=list)
    lora_loads: list[tuple[int, str]] = field(default_factory=list)  # (slot, adapter) to load first
    sample_rows: list[SampleRow] = field(default_factory=list)
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    spec_runs: list[SpecRun] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    # Queue only the forward pass: the sampling of some row reads its sequence's previous
    # tokens on the host, and the step before is still in flight (`PendingStep.sample`).
    defer_sampling: bool = False
    # With a draft model or EAGLE head: whether it proposes after this step (few enough
    # sequences run to speculate); else its first pass only keeps its cache up with the target's.
    propose_drafts: bool = True
    # The guided rows' masks, when the step's sampling is not deferred (a deferred sampling gets
    # them with `PendingStep.sample`).
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None  # requested top logprobs: (token id, logprob)
    rank: int | None


@dataclass
class PromptLogprobsResult:
    """A prompt span's logprobs: one result per position from `first` on."""
    first: int
    results: list[SampleResult]


@dataclass
class ModelRunnerOutput:
    """What a step produced, by sequence id: the results of a sequence's sample rows in row
    order (one row; or a verification run's k + 1, of which the engine keeps those up to the
    first that differs from its proposal, and that one), and the prompt logprobs of each
    sequence with a prompt span in the step; with a draft model, the next proposals."""
    sampled: dict[int, list[SampleResult]] = field(default_factory=dict)
    prompt_logprobs: dict[int, PromptLogprobsResult] = field(default_factory=dict)
    # Speculative decoding with a draft model: each sequence's proposed tokens after this step's
    # (the next step verifies them).
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
