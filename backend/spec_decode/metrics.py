"""Speculative decoding's counters, vLLM's spec_decode metrics. The engine's `EngineStats`
(backend/engine/metrics.py) holds them as its `spec_decode_*` fields, which the metric readers
publish under vLLM's names; this module does the counting."""
from __future__ import annotations

from typing import Protocol


class SpecDecodeCounters(Protocol):
    """Verification runs (a speculating sequence's verification step), tokens proposed in them,
    proposals accepted, and (vLLM's num_accepted_tokens_per_pos) entry j: runs that kept
    proposal j."""
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: list[int]


def record_verification(stats: SpecDecodeCounters, num_proposed: int, accepted: int) -> None:
    """A speculating sequence's verification: `accepted` of its `num_proposed` proposals kept."""
    stats.spec_decode_num_drafts += 1
    stats.spec_decode_num_draft_tokens += num_proposed
    stats.spec_decode_num_accepted_tokens += accepted
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    per_pos.extend([0] * (num_proposed - len(per_pos)))
    for j in range(accepted):
        per_pos[j] += 1
