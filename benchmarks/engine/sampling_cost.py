"""What per-request sampling parameters cost the batch: the throughput workload (A by default)
through one in-process engine, plain and with sampling variants, alternately over rounds so
that a machine's drift falls on every variant.

    python -m benchmarks.engine.sampling_cost --model models/configs/llama-3-8b \
        --tokenizer models/tiny-llama --variant 'pen_all:1:repetition_penalty=1.1,presence_penalty=0.1' \
        --variant 'pen_1in8:8:repetition_penalty=1.1' --rounds 2 --json cost.json

A variant is NAME:EVERY:KEY=VALUE[,KEY=VALUE...]: those sampling parameters (vLLM's names) on
every EVERY-th request, the others greedy and plain. "plain" (no parameters) always runs too.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from benchmarks.loadgen.workloads import (DEFAULT_SEED, VOCAB_HIGH, VOCAB_LOW, parse_vocab_range,
                                          with_overrides)
from benchmarks.offline import engine_kwargs, parse_sampling, run_throughput


def parse_variant(text: str) -> tuple[str, int, dict[str, Any]]:
    name, every, params = (text.split(":", 2) + ["", ""])[:3]
    if not name or not every.isdigit() or int(every) < 1:
        raise SystemExit(f"--variant wants NAME:EVERY:KEY=VALUE[,...], got {text!r}")
    return name, int(every), parse_sampling([p for p in params.split(",") if p])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--model-config", help="read engine arguments from this config.pbtxt")
    ap.add_argument("--tokenizer")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--workload", default="A")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--input-len", type=int)
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--vocab-range", default=f"{VOCAB_LOW}:{VOCAB_HIGH}")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:EVERY:KEY=VALUE,...")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    low, high = parse_vocab_range(args.vocab_range)
    w = with_overrides(args.workload, args.num_requests, args.input_len, args.output_len)
    variants = [("plain", 1, {})] + [parse_variant(v) for v in args.variant]

    from tritium import LLM

    kwargs = engine_kwargs(args)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    # Warm-up: every variant once on a few requests, so no variant pays a first-use cost.
    warm = with_overrides(args.workload, 8, w.input_len, 16)
    for k, (_, every, extra) in enumerate(variants):
        run_throughput(llm, warm, args.seed + 50 + k, low, high, extra, every)
    runs: list[dict[str, Any]] = []
    for rnd in range(1, args.rounds + 1):
        for k, (name, every, extra) in enumerate(variants):
            # Prompts of their own for every run: repeated ones would be prefix-cache hits.
            s = run_throughput(llm, w, args.seed + 100 * rnd + k, low, high, extra, every)
            runs.append({"round": rnd, "variant": name, "every": every, "sampling": extra,
                         "output_tok_s": s["output_tok_s"], "wall_s": s["wall_s"],
                         "wrong_length_requests": s["wrong_length_requests"]})
            print(f"round {rnd} {name:<14} every {every:<3} {s['output_tok_s']:>10,.1f} tok/s "
                  f"({s['wall_s']:.2f} s)", flush=True)
    plain = [r["output_tok_s"] for r in runs if r["variant"] == "plain"]
    base = sum(plain) / len(plain)
    print(f"\n{'variant':<14} {'every':>5} {'tok/s (mean)':>13} {'vs plain':>9}")
    summary = {}
    for name, every, extra in variants:
        vals = [r["output_tok_s"] for r in runs if r["variant"] == name]
        mean = sum(vals) / len(vals)
        summary[name] = {"every": every, "sampling": extra, "output_tok_s": vals, "mean": mean,
                         "vs_plain": mean / base}
        print(f"{name:<14} {every:>5} {mean:>13,.1f} {mean / base:>8.3f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"workload": w.__dict__, "engine_args": {k: str(v) for k, v in kwargs.items()},
                       "runs": runs, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
