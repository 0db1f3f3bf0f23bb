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
    """Proposals from the sequence's own tokens. With a `key` (the engine passes the sequence
    id), the tokens are kept as an array that grows by the new tokens of each call, so a step
    costs O(new tokens) to convert plus one vectorised pass over the history, not a list-to-array
    copy and one pass per lookup length (~0.2 ms a sequence at 4k tokens, which at 32
    speculating sequences is a decode step's worth of host time)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._histories: dict[object, _History] = {}

    def propose(self, token_ids: list[int], max_tokens: int, key: object = None) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) tokens that followed the latest earlier
        occurrence of the sequence's last n tokens, for the longest n that occurs; [] if none.
        `key`: the same key on later calls means the same sequence, whose earlier tokens have
        not changed (tokens are only appended)."""
        k = min(self.config.num_speculative_tokens, max_tokens)
        if k <= 0 or len(token_ids) < self.config.prompt_lookup_min + 1:
            return []
        if key is None:
            ids = np.asarray(token_ids, dtype=np.int64)
        else:
            history = self._histories.get(key)
            if history is None:
                history = self._histories[key] = _History()
            ids = history.extend(token_ids)
        return _lookup(ids, k, self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def retain(self, keys: set) -> None:
        """Forget the histories of every other key (sequences that finished or wait)."""
        for key in [key for key in self._histories if key not in keys]:
            del self._histories[key]


class _History:
    """A sequence's tokens as a growing int64 array (capacity doubles)."""

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.int64)
        self.size = 0

    def extend(self, token_ids: list[int]) -> np.ndarray:
        n = len(token_ids)
        if n < self.size:  # not the same sequence after all: start over
            self.size = 0
        if n > len(self.buf):
            grown = np.empty(max(n, 2 * len(self.buf), 256), dtype=np.int64)
            grown[:self.size] = self.buf[:self.size]
            self.buf = grown
        if n > self.size:
            self.buf[self.size:n] = token_ids[self.size:n]
            self.size = n
        return self.buf[:n]


def _lookup(ids: np.ndarray, k: int, lo: int, hi: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest suffix of length lo..hi.

    Every earlier position holding the last token ends a candidate occurrence (one vectorised
    comparison over the history); the candidates' matches are then extended backwards together,
    one token per round, while any still matches. An occurrence must end before the last token
    (something followed it) and may overlap the suffix."""
    total = len(ids)
    hi = min(hi, total - 1)
    ends = np.flatnonzero(ids[:total - 1] == ids[total - 1])
    if hi < lo or not len(ends):
        return []
    length = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, hi):
        alive &= ends >= back
        idx = np.flatnonzero(alive)
        if not len(idx):
            break
        alive[idx] = ids[ends[idx] - back] == ids[total - 1 - back]
        length += alive
    best = int(length.max())
    if best < lo:
        return []
    start = int(ends[np.flatnonzero(length == best)[-1]]) + 1  # the latest: the nearest context
    return ids[start:start + k].tolist()
