"""How one step's forward pass runs: the step as a rank packs it (`StepBatch`, the same on
every rank), the path every rank decides from it, and the pass it runs."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .input_batch import PreparedBatch
from .pending_step import PromptSpanTokens
from .request_states import RequestState


class ForwardPath(str, Enum):
    """The four ways a step's forward pass runs. A graph path replays the CUDA graphs that each
    rank captured (on the CPU, the same static buffers run eagerly); tensor-parallel ranks take
    the same path (`ModelRunner.choose_path`, a function of the step), so that their
    collectives match."""
    DECODE_GRAPH = "decode_graph"
    PREFILL_GRAPH = "prefill_graph"
    VERIFY_GRAPH = "verify_graph"
    EAGER = "eager"


@dataclass
class ForwardCall:
    """One forward pass on this rank: its path and packed batch (placeholder tokens are 0 in
    it). `rows`: the packed rows whose final hidden states come out (the verification graph's
    sampled rows, or the rows an eager pass keeps at its last layer); None: every row (eager)
    or each prompt chunk's last (prefill graph). It never leaves its rank: every rank packs its
    own from the step."""
    path: ForwardPath
    batch: PreparedBatch
    rows: list[int] | None = None


@dataclass
class StepBatch:
    """A step as the runner packs it, the same on every tensor-parallel rank: the batch, each
    sample row's state and packed row, the rows predicting prompt tokens whose logprobs are
    asked for, and whether the verification graphs run it."""
    batch: PreparedBatch
    row_states: list[RequestState]
    rows_index: list[int]
    prompt_index: list[int]
    spans: list[PromptSpanTokens]
    prompt_targets: list[int]
    speculative: bool
    verify_in_graph: bool

    @property
    def every_row(self) -> bool:
        return self.rows_index == list(range(self.batch.num_tokens))
