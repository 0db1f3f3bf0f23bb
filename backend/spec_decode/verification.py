"""Verification of proposals: a verification step computes, for a speculating sequence, its
last token and each of its k proposals as a run of k + 1 sample rows; row j predicts the token
after proposal j - 1. A greedy row takes the argmax; a sampled row rejection-samples the
proposal it verifies (`verify_drafts`, called by the sampler, backend/layers/sampler.py); and
the sequence keeps its tokens up to the first that differs from its proposal, and that one
(`num_accepted`, the engine's rule, which the worker applies to its own copy of the tokens).
"""
from __future__ import annotations

from typing import Any, Sequence as Seq

import torch


class WithProposals:
    """A speculating sequence as its verification rows see it: its tokens, then its proposals
    (the sequence itself is the engine's and stays as it is)."""

    def __init__(self, seq: Any, proposed: list[int]) -> None:
        self._seq = seq
        self.token_ids = seq.token_ids + proposed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._seq, name)


def verify_drafts(probs: torch.Tensor, race: torch.Tensor, sampled: torch.Tensor,
                  drafts: torch.Tensor) -> torch.Tensor:
    """Rejection sampling of a proposed token d (a point mass: n-gram proposals): a row keeps d
    with probability p(d), else draws from p without d, renormalised (the exponential race with
    d left out), so the token is distributed as p either way. The engine keeps a sequence's
    tokens while they equal its proposals, and the first that does not (that draw)."""
    has = drafts >= 0
    d = drafts.clamp(min=0)[:, None]
    accept = torch.rand(probs.shape[0], device=probs.device) < probs.gather(1, d).squeeze(1)
    residual = race.scatter(1, d, 0.0).argmax(dim=-1)
    return torch.where(has, torch.where(accept, drafts, residual), sampled)


def verification_runs(rows: Seq[Any], drafts: Seq[int] | None) -> tuple[list[int], list[int]]:
    """Speculative decoding: a sequence verifying k proposals holds them after its known tokens
    during the launch and has a run of k + 1 consecutive rows (the same object), row j
    predicting the token after proposal j - 1. Per row: the index of its run's first row (its
    own for any other row), and how many of its sequence's last tokens it must not see (k - j;
    0 for any other row)."""
    run_start, ahead = list(range(len(rows))), [0] * len(rows)
    if drafts is None:
        return run_start, ahead
    for i in range(len(rows) - 2, -1, -1):
        if drafts[i] >= 0 and rows[i + 1] is rows[i]:
            ahead[i] = ahead[i + 1] + 1
    for i in range(1, len(rows)):
        if drafts[i - 1] >= 0 and rows[i - 1] is rows[i]:
            run_start[i] = run_start[i - 1]
    return run_start, ahead


def num_accepted(results: Seq[Any], proposed: list[int]) -> int:
    """How many of a verification run's proposals are kept: those before the first whose row's
    token (`results[j].token_id`, a `SampleResult`) differs from it."""
    accepted = 0
    while accepted < len(proposed) and results[accepted].token_id == proposed[accepted]:
        accepted += 1
    return accepted
