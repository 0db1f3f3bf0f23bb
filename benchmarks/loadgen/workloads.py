"""The benchmark workloads, shared by the Triton client, the in-process bench and the HF anchor.

Every runner builds its prompts from the same (seed, vocab range) so that the three measure
exactly the same token ids.
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """`num_requests` prompts of exactly `input_len` random token ids, each asking for exactly
    `output_len` tokens (EOS ignored, greedy)."""

    name: str
    num_requests: int
    input_len: int
    output_len: int

    def __post_init__(self) -> None:
        for field in ("num_requests", "input_len", "output_len"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}.")

    @property
    def total_output_tokens(self) -> int:
        return self.num_requests * self.output_len

    @property
    def max_seq_len(self) -> int:
        """Prompt plus output: the max_model_len a request of this workload needs."""
        return self.input_len + self.output_len


# A: throughput, everything submitted at once. B: single-request latency.
# C: long-context throughput, all at once: prefill-heavy, and every decode step reads 16k-token
# KV histories. L: single-request decode at 32k context; its prompt stops one output length
# short of 32,768 so that prompt + output fit a model with 32,768 positions (Qwen2.5).
WORKLOADS: dict[str, Workload] = {
    "A": Workload("A", num_requests=256, input_len=512, output_len=256),
    "B": Workload("B", num_requests=1, input_len=512, output_len=128),
    "C": Workload("C", num_requests=8, input_len=16384, output_len=256),
    "L": Workload("L", num_requests=1, input_len=32640, output_len=128),
}

# Prompt ids are drawn from [VOCAB_LOW, VOCAB_HIGH): inside the vocabulary of any tokenizer the
# engine may be given with dummy weights (the repo's tiny one has 512 ids), above the special ids.
VOCAB_LOW = 100
VOCAB_HIGH = 500
DEFAULT_SEED = 0


def make_prompts(num_requests: int, input_len: int, seed: int = DEFAULT_SEED, tag: str = "",
                 vocab_low: int = VOCAB_LOW, vocab_high: int = VOCAB_HIGH) -> list[list[int]]:
    """Deterministic random prompts: the same arguments give the same ids on every machine
    (Python's `random` seeded with a string, which does not depend on PYTHONHASHSEED).

    `tag` separates the prompt sets of one run (warm-up, A, B): with the same seed alone, B's
    prompt would be A's first prompt and prefix caching would make B's prefill free."""
    if vocab_low < 0 or vocab_high <= vocab_low:
        raise ValueError(f"vocab range must satisfy 0 <= low < high, got [{vocab_low}, {vocab_high}).")
    if num_requests < 1 or input_len < 1:
        raise ValueError("num_requests and input_len must be positive.")
    rng = random.Random(f"{seed}:{tag}")
    return [[rng.randrange(vocab_low, vocab_high) for _ in range(input_len)]
            for _ in range(num_requests)]


def parse_vocab_range(text: str) -> tuple[int, int]:
    """'100:1000' -> (100, 1000)."""
    try:
        low_s, high_s = text.split(":")
        low, high = int(low_s), int(high_s)
    except ValueError:
        raise ValueError(f"vocab range must look like LOW:HIGH, got {text!r}.") from None
    if low < 0 or high <= low:
        raise ValueError(f"vocab range must satisfy 0 <= low < high, got {text!r}.")
    return low, high


def parse_workload_names(text: str) -> list[str]:
    """'A,B' -> ['A', 'B']; ValueError for an empty list or an unknown name."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"no workload named in {text!r}; known: {', '.join(WORKLOADS)}.")
    for name in names:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}.")
    return names


def resolve_workload(name: str | None, num_requests: int | None, input_len: int | None,
                     output_len: int | None) -> Workload:
    """A named workload with optional overrides (see with_overrides); with no name every size
    must be given."""
    if name is not None:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}.")
        return with_overrides(name, num_requests, input_len, output_len)
    if num_requests is None or input_len is None or output_len is None:
        raise ValueError("without --workload, give --num-requests, --input-len and --output-len.")
    return Workload("custom", num_requests, input_len, output_len)


def with_overrides(name: str, num_requests: int | None = None, input_len: int | None = None,
                   output_len: int | None = None) -> Workload:
    """A named workload resized for a quick run; a single-request (latency) workload keeps one
    request, since its figures are per request. The sizes apply to every workload alike, so a
    quick run of the long-context ones (C, L) is as small as one of A."""
    base = WORKLOADS[name]
    n = 1 if base.num_requests == 1 else (num_requests or base.num_requests)
    return Workload(name, n, input_len or base.input_len, output_len or base.output_len)
