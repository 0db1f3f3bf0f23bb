"""Speculative decoding by n-gram lookup (vLLM's `speculative_config={"method": "ngram", ...}`).

For a greedy request in its decode phase, `NgramProposer` looks for the last n tokens (n from
`prompt_lookup_max` down to `prompt_lookup_min`) earlier in the prompt and output, and proposes
the up to `num_speculative_tokens` tokens that followed that earlier occurrence. One forward
pass then computes the request's last token and every proposed token (a short chunk over the
cached context); the greedy token at each position is taken while it equals the proposal, and
the token after the last accepted one comes with it. So a step yields 1 to k + 1 tokens, all
exactly the tokens plain greedy decoding gives, at the cost of one forward pass of k + 1 rows.
It pays where the output repeats its input (quoting, editing, extraction, code).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be an object, got {d!r}.")
        unknown = set(d) - {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}; this engine speculates by "
                             "'method': 'ngram' with num_speculative_tokens, prompt_lookup_max and "
                             "prompt_lookup_min.")
        method = d.get("method", "ngram")
        if method != "ngram":
            raise ValueError(f"speculative_config: method {method!r} is not supported; only 'ngram' "
                             "(no draft model) is.")
        k = d.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in [1, 16], got {k!r}.")
        hi, lo = d.get("prompt_lookup_max"), d.get("prompt_lookup_min")
        if hi is None and lo is None:
            hi = lo = 5
        hi = lo if hi is None else hi
        lo = hi if lo is None else lo
        for name, v in (("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {v!r}.")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi}).")
        return cls(k, hi, lo, method)


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) tokens that followed the latest earlier
        occurrence of the sequence's last n tokens, for the longest n that occurs; [] if none."""
        k = min(self.config.num_speculative_tokens, max_tokens)
        if k <= 0 or len(token_ids) < self.config.prompt_lookup_min + 1:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        total = len(ids)
        for n in range(min(self.config.prompt_lookup_max, total - 1), self.config.prompt_lookup_min - 1, -1):
            # Windows of n tokens that start before the suffix itself and are followed by a token.
            windows = np.lib.stride_tricks.sliding_window_view(ids[:total - 1], n)
            hits = np.flatnonzero((windows == ids[total - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the latest occurrence: the nearest context
                return ids[start:start + k].tolist()
        return []
