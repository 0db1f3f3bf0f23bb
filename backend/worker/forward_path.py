"""How one step's forward pass runs, as rank 0 decides it and every rank then runs it."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class ForwardPath(str, Enum):
    """The four ways a step's forward pass runs. A graph path replays the CUDA graphs that each
    rank captured (on the CPU, the same static buffers run eagerly); tensor-parallel ranks take
    the path rank 0 took, so that their collectives match."""
    DECODE_GRAPH = "decode_graph"
    PREFILL_GRAPH = "prefill_graph"
    VERIFY_GRAPH = "verify_graph"
    EAGER = "eager"


@dataclass
class ForwardCall:
    """One forward pass: its path and prepared batch (placeholder tokens are 0 in it). `fill`:
    some input tokens are the previous step's samples, which rank 0 fills on its device and
    broadcasts. `rows`: the packed rows whose final hidden states come out (the verification
    graph's sampled rows, or the rows an eager pass keeps at its last layer); None: every row
    (eager) or each prompt chunk's last (prefill graph)."""
    path: ForwardPath
    batch: Any  # PreparedBatch
    fill: bool = False
    rows: list[int] | None = None
