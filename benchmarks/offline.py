"""The benchmark workloads through the engine in-process (`backend.LLM`), with no server, so
that Triton's share of the time can be separated from the engine's.

    python -m benchmarks.offline --model-config /tmp/repo/llm/config.pbtxt --json offline.json
    python -m benchmarks.offline --model models/configs/llama-3-8b --tokenizer models/tiny-llama \
        --engine-arg load_format=dummy --engine-arg dtype=bfloat16

With --model-config the engine arguments are read from a Triton config.pbtxt (the one the
server ran), so both runs use exactly the same engine configuration.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks.loadgen.bench import clean_json
from benchmarks.loadgen.bench_model_repo import get_parameters, parse_assignments
from benchmarks.loadgen.bench_stats import percentile
from benchmarks.loadgen.workloads import (DEFAULT_SEED, VOCAB_HIGH, VOCAB_LOW, Workload, make_prompts,
                                          parse_vocab_range, parse_workload_names, with_overrides)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from tritium.config import EngineArgs
    from tritium.serving.triton_config import engine_args_from_model_config

    if args.model_config:
        with open(args.model_config, encoding="utf-8") as f:
            params: dict[str, str] = get_parameters(f.read())
        params.update(parse_assignments(args.engine_arg))
        engine_args = engine_args_from_model_config(params, ROOT)
    else:
        if not args.model:
            raise SystemExit("give --model-config or --model")
        values = {"load_format": "dummy", "dtype": "bfloat16"}
        values.update(parse_assignments(args.engine_arg))
        values["model"] = args.model
        if args.tokenizer:
            values["tokenizer"] = args.tokenizer
        engine_args = EngineArgs.from_strings(values)
    return {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)}


def _dist_ms(values: list[float]) -> dict[str, float]:
    return {"mean": sum(values) / len(values) * 1000, "p50": percentile(values, 50) * 1000,
            "p99": percentile(values, 99) * 1000}


def _engine_latencies(outputs: list[Any]) -> dict[str, Any]:
    """TTFT / E2E from the engine's own request metrics, when it records them."""
    ttft, e2e = [], []
    for o in outputs:
        m = getattr(o, "metrics", None)
        if m is None or m.first_token_time is None or m.finished_time is None:
            return {}
        ttft.append(m.first_token_time - m.arrival_time)
        e2e.append(m.finished_time - m.arrival_time)
    return {"engine_ttft_ms": _dist_ms(ttft), "engine_e2e_ms": _dist_ms(e2e)} if outputs else {}


def parse_sampling(assignments: list[str]) -> dict[str, Any]:
    """KEY=VALUE sampling parameters (vLLM's names); values are read as JSON where they parse."""
    extra: dict[str, Any] = {}
    try:
        values = parse_assignments(assignments)
    except ValueError as e:
        raise SystemExit(f"--sampling: {e}") from None
    for key, value in values.items():
        try:
            extra[key] = json.loads(value)
        except json.JSONDecodeError:
            extra[key] = value
    return extra


def timed_generate(llm: Any, prompts: list[list[int]], max_tokens: int,
                   extra: dict[str, Any] | None = None, every: int = 1) -> tuple[float, list[Any]]:
    """extra: sampling parameters for every `every`-th request (the others greedy and plain)."""
    from tritium import SamplingParams

    plain = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    params = [plain] * len(prompts)
    if extra:
        special = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)
        params = [special if i % every == 0 else plain for i in range(len(prompts))]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - t0, outputs


def run_throughput(llm: Any, w: Workload, seed: int, low: int, high: int,
                   extra: dict[str, Any] | None = None, every: int = 1) -> dict[str, Any]:
    prompts = make_prompts(w.num_requests, w.input_len, seed, w.name, low, high)
    wall, outputs = timed_generate(llm, prompts, w.output_len, extra, every)
    counts = [len(o.outputs[0].token_ids) for o in outputs]
    tokens = sum(counts)
    return {"completed": len(outputs), "failed": w.num_requests - len(outputs), "output_tokens": tokens,
            "wall_s": wall, "output_tok_s": tokens / wall, "requests_s": len(outputs) / wall,
            "wrong_length_requests": sum(1 for c in counts if c != w.output_len),
            **_engine_latencies(outputs)}


def run_latency(llm: Any, w: Workload, seed: int, low: int, high: int,
                ttft_repeats: int = 3) -> dict[str, Any]:
    """One request at a time. TTFT = median of max_tokens=1 requests on other prompts of the same
    length (other prompts, so the prefix cache cannot serve them); decode rate from the full one."""
    ttft_prompts = make_prompts(ttft_repeats, w.input_len, seed, w.name + "-ttft", low, high)
    ttfts = [timed_generate(llm, [p], 1)[0] for p in ttft_prompts]
    ttft = percentile(ttfts, 50)
    summary = run_throughput(llm, w, seed, low, high)
    e2e = summary["wall_s"] / w.num_requests
    summary["ttft_ms"] = _dist_ms(ttfts)
    summary["e2e_ms"] = {"mean": e2e * 1000, "p50": e2e * 1000, "p99": e2e * 1000}
    summary["decode_tok_s"] = (w.output_len - 1) / (e2e - ttft) if e2e > ttft else float("nan")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-config", help="read engine arguments from this config.pbtxt")
    ap.add_argument("--model", help="model directory (without --model-config)")
    ap.add_argument("--tokenizer")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--workloads", default="A,B", help="names from benchmarks/loadgen/workloads.py (A, B, C, L)")
    ap.add_argument("--num-requests", type=int, help="override the throughput workloads' request count")
    ap.add_argument("--input-len", type=int)
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--vocab-range", default=f"{VOCAB_LOW}:{VOCAB_HIGH}")
    ap.add_argument("--warmup", type=int, default=4, help="warm-up requests before timing")
    ap.add_argument("--warmup-output-len", type=int, default=16)
    ap.add_argument("--sampling", action="append", default=[], metavar="KEY=VALUE",
                    help="a sampling parameter (vLLM's name) for the throughput workload's requests, "
                         "e.g. repetition_penalty=1.1")
    ap.add_argument("--sampling-every", type=int, default=1, metavar="N",
                    help="--sampling applies to every N-th request only (the others stay plain)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    extra = parse_sampling(args.sampling)
    if args.sampling_every < 1:
        raise SystemExit("--sampling-every must be at least 1")
    low, high = parse_vocab_range(args.vocab_range)
    try:
        names = parse_workload_names(args.workloads)
    except ValueError as e:
        ap.error(str(e))
    workloads = [with_overrides(n, args.num_requests, args.input_len, args.output_len) for n in names]

    from tritium import LLM

    kwargs = engine_kwargs(args)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0
    print(f"engine ready in {load_s:.1f} s")
    result: dict[str, Any] = {"runner": "offline-llm", "engine_args": kwargs, "load_s": load_s,
                              "seed": args.seed, "vocab_range": [low, high], "workloads": {},
                              "sampling": extra, "sampling_every": args.sampling_every}
    if args.warmup > 0:
        input_len = max(w.input_len for w in workloads)
        timed_generate(llm, make_prompts(args.warmup, input_len, args.seed, "warmup", low, high),
                       args.warmup_output_len)
    for w in workloads:
        name = w.name
        s = run_latency(llm, w, args.seed, low, high) if w.num_requests == 1 else \
            run_throughput(llm, w, args.seed, low, high, extra, args.sampling_every)
        result["workloads"][name] = {"workload": dataclasses.asdict(w), "summary": s}
        print(format_offline(f"offline workload {name}", s))
        if args.json:  # after each workload: a later failure keeps the earlier figures
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(clean_json(result), f, indent=1, default=str)
    return 0


def format_offline(title: str, s: dict[str, Any]) -> str:
    line = (f"{title}: {s['completed']} requests, {s['output_tokens']} output tokens in {s['wall_s']:.2f} s\n"
            f"  output tok/s {s['output_tok_s']:,.1f}   requests/s {s['requests_s']:.2f}")
    if "decode_tok_s" in s:  # latency run
        line += (f"\n  TTFT p50 {s['ttft_ms']['p50']:.2f} ms   E2E {s['e2e_ms']['p50']:.2f} ms   "
                 f"decode tok/s {s['decode_tok_s']:.1f}")
    if s.get("engine_ttft_ms"):
        line += f"\n  engine TTFT ms p50 {s['engine_ttft_ms']['p50']:.2f}  p99 {s['engine_ttft_ms']['p99']:.2f}"
    if s.get("wrong_length_requests"):
        line += f"\n  WARNING: {s['wrong_length_requests']} requests did not return the expected length"
    return line


if __name__ == "__main__":
    sys.exit(main())
