"""Proposals by n-gram lookup (vLLM's `speculative_config={"method": "ngram", ...}`), made on
the engine's side from each sequence's token ids (a draft model or EAGLE head proposes in the
worker: draft_model.py, eagle.py).

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

import numpy as np

from ..engine_config import SpeculativeConfig


class NgramProposer:
    """Proposals from the sequence's own tokens. With a `key` (the engine passes the sequence
    id), each sequence keeps an index of where each `prompt_lookup_min`-gram occurred, grown by
    the new tokens of each call: a lookup extends only the occurrences of the last such n-gram,
    ~3 us (CPU machine, 512-32k tokens), where a pass over the whole history costs ~35 us a
    sequence in numpy (~1 ms a step for 32 speculating sequences) and a list-to-array copy per
    lookup length 0.1-2 ms. The index takes ~200-240 bytes of host memory per token (7.5 MiB for
    a 32k-token sequence) and is built once per sequence, at its first lookup (~15 ms for 8k tokens;
    benchmarks/kernels/ngram_proposer.py)."""

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
        lo, hi = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        if key is None:
            return _lookup(np.asarray(token_ids, dtype=np.int64), k, lo, hi)
        history = self._histories.get(key)
        if history is None:
            history = self._histories[key] = _History(lo)
        return history.lookup(token_ids, k, hi)

    def retain(self, keys: set) -> None:
        """Forget the histories of every other key (sequences that finished or wait)."""
        for key in [key for key in self._histories if key not in keys]:
            del self._histories[key]


class _History:
    """Where each n-gram of `lo` tokens ended in a sequence, for the n-grams followed by a
    token: the candidates for the suffix's occurrences."""

    # Occurrences of the last n-gram extended one by one in Python, the latest first, until one
    # matches the longest suffix (prompt_lookup_max tokens: nothing can beat it). Past this many
    # without one (many occurrences, all matching short), one vectorised pass over the history
    # is cheaper. In a long run of one token the latest occurrence matches at once.
    MAX_CANDIDATES = 64

    def __init__(self, lo: int) -> None:
        self.lo = lo
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.size = 0  # tokens indexed: n-grams ending before size - 1 are in `ends`

    def lookup(self, token_ids: list[int], k: int, hi: int) -> list[int]:
        n, lo = len(token_ids), self.lo
        if n < self.size:  # not the same sequence after all: start over
            self.ends.clear()
            self.size = 0
        # Index the n-grams that now have a token after them: those ending at size-1 .. n-2.
        for end in range(max(lo - 1, self.size - 1), n - 1):
            self.ends.setdefault(tuple(token_ids[end - lo + 1:end + 1]), []).append(end)
        self.size = n
        candidates = self.ends.get(tuple(token_ids[n - lo:]))
        if not candidates:
            return []
        hi = min(hi, n - 1)
        best, best_end = lo - 1, -1
        for tried, end in enumerate(reversed(candidates)):  # the latest first: it wins ties
            if tried == self.MAX_CANDIDATES:
                return _lookup(np.asarray(token_ids, dtype=np.int64), k, lo, hi)
            m = lo
            while m < hi and end - m >= 0 and token_ids[end - m] == token_ids[n - 1 - m]:
                m += 1
            if m > best:
                best, best_end = m, end
                if m == hi:
                    break
        return list(token_ids[best_end + 1:best_end + 1 + k])


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
