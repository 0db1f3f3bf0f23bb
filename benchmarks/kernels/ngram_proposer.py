#!/usr/bin/env python3
"""Host time of the n-gram proposer (speculative decoding) per engine step, on the CPU.

Each step appends one token to every sequence's history and asks for a proposal per sequence,
as the engine's `_propose` does (one key per sequence, so the kept index is used). What the
outputs look like decides the cost, so three kinds are timed:
  run     the same token over and over (what random-weight models often write),
  cycle3  a cycle of three tokens,
  random  fresh random tokens (lookups rarely find anything).

    python3 benchmarks/kernels/ngram_proposer.py [--seqs 32] [--prompt-lens 512,8192] [--steps 200] [--json F]

Prints the first step (each sequence's index built from its prompt) and then ms per step (all
sequences) and us per sequence, and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

from tritium.engine_config import SpeculativeConfig
from tritium.spec_decode.ngram import NgramProposer

KINDS = ("run", "cycle3", "random")


def time_kind(kind: str, seqs: int, prompt_len: int, steps: int, config: SpeculativeConfig) -> tuple[float, float]:
    """Seconds of the first step (each sequence's index is built then) and mean seconds of the
    later steps, proposing for every sequence."""
    proposer = NgramProposer(config)
    rng = random.Random(0)
    histories = {i: [rng.randrange(128_000) for _ in range(prompt_len)] for i in range(seqs)}
    times = []
    for step in range(steps + 1):
        for ids in histories.values():
            ids.append(7 if kind == "run" else (5, 6, 7)[step % 3] if kind == "cycle3" else rng.randrange(128_000))
        start = time.perf_counter()
        for key, ids in histories.items():
            proposer.propose(ids, 100, key)
        times.append(time.perf_counter() - start)
    return times[0], sum(times[1:]) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--prompt-lens", default="512,8192")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--lookup", default="2:4", help="prompt_lookup_min:prompt_lookup_max")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    lo, hi = (int(x) for x in a.lookup.split(":"))
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": a.k,
                                          "prompt_lookup_min": lo, "prompt_lookup_max": hi})
    rows = []
    print(f"n-gram proposer, {a.seqs} sequences, k={a.k}, lookup {lo}..{hi}, {a.steps} steps")
    print(f"{'prompt':>7} {'outputs':<8} {'first ms':>9} {'ms/step':>9} {'us/seq':>8}")
    for prompt_len in (int(x) for x in a.prompt_lens.split(",")):
        for kind in KINDS:
            first, per_step = time_kind(kind, a.seqs, prompt_len, a.steps, config)
            rows.append({"prompt_len": prompt_len, "outputs": kind, "first_step_ms": first * 1e3,
                         "ms_per_step": per_step * 1e3, "us_per_seq": per_step * 1e6 / a.seqs})
            print(f"{prompt_len:>7} {kind:<8} {first * 1e3:>9.2f} {per_step * 1e3:>9.3f} "
                  f"{per_step * 1e6 / a.seqs:>8.1f}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"seqs": a.seqs, "k": a.k, "lookup": [lo, hi], "steps": a.steps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
