"""The mixed-load benchmark's verdict and table: the greedy-token check between colocated and
disaggregated runs (benchmarks/engine/disagg_mixed_load.py), the figures printed per
configuration, the commit measured."""
from __future__ import annotations

import argparse
import os
import subprocess
from typing import Any


def compare(colocated: dict[str, list[int]], disaggregated: dict[str, list[int]], mode: str) -> dict[str, Any]:
    """Greedy tokens of the requests both configurations finished: the probes' must be equal
    (mode "quiet"), and the loaded ones' too (mode "exact")."""
    repeats = [rid for rid in colocated if rid.startswith("r") and "q" + rid[1:] in colocated]
    repeated = sum(colocated[rid] == colocated["q" + rid[1:]] for rid in repeats)
    # A probe the colocated engine answers two ways when sent alone twice is no reference: the
    # quiet check fails only on probes whose colocated answer is stable.
    unstable = sorted("q" + rid[1:] for rid in repeats if colocated[rid] != colocated["q" + rid[1:]])
    both = sorted(set(colocated) & set(disaggregated))
    differ = [rid for rid in both if colocated[rid] != disaggregated[rid]]
    probes = [rid for rid in both if rid.startswith("q")]
    probes_differ = [rid for rid in differ if rid.startswith("q")]

    def common(rid: str) -> int:
        a, b = colocated[rid], disaggregated[rid]
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    stable_differ = [rid for rid in probes_differ if rid not in unstable]
    failed = bool(differ) if mode == "exact" else bool(stable_differ) if mode == "quiet" else False
    loaded = [rid for rid in both if not rid.startswith("q")]
    return {"mode": mode, "compared": len(loaded), "equal": len(loaded) - (len(differ) - len(probes_differ)),
            "first_token_differs": sum(colocated[r][:1] != disaggregated[r][:1] for r in loaded),
            "tokens_in_common": sum(common(r) for r in loaded), "tokens": sum(len(colocated[r]) for r in loaded),
            "probes_compared": len(probes), "probes_equal": len(probes) - len(probes_differ),
            "colocated_repeats": len(repeats), "colocated_repeats_equal": repeated,
            "colocated_unstable": unstable, "probes_differ_stable": stable_differ,
            "differ": {rid: common(rid) for rid in (probes_differ + differ)[:20]},
            "longs_compared": sum(rid.startswith("l") for rid in both),
            "ok": not failed and bool(loaded) and bool(probes)}


def commit() -> str | None:
    for key in ("TRITIUM_COMMIT", "COMMIT"):
        if os.environ.get(key) and os.environ[key] != "unknown":
            return os.environ[key]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def print_table(args: argparse.Namespace, name: str, results: dict[str, dict], check: dict) -> None:
    print(f"\nmixed load on {name}, {args.model} ({args.dtype}): {args.streams} streams "
          f"({args.stream_prompt_len}-token prompts, {args.stream_output_len} tokens out) and "
          f"{args.long_prompts} prompts of {args.long_prompt_len} tokens ({args.long_output_len} out) at "
          f"{args.long_rate:g}/s{' (fixed)' if args.fixed_interval else ' (Poisson)'}; memory shares "
          f"prefill {args.prefill_memory:g} + decode {args.decode_memory:g}")
    head = ("long TTFT p50", "p99", "long ITL p50", "p99", "stream TTFT p50", "p99", "stream ITL p50", "p99")
    print(f"{'configuration':<14} " + " ".join(f"{h:>{max(len(h), 8)}}" for h in head) + f" {'out tok/s':>10}")
    keys = ("long_ttft", "long_itl", "stream_ttft", "stream_itl")
    for config, r in results.items():
        cells = [r[f"{k}_{p}_ms"] for k in keys for p in ("p50", "p99")]
        print(f"{config:<14} " + " ".join(f"{v:>{max(len(h), 8)}.1f}" for h, v in zip(head, cells))
              + f" {r['output_tok_s']:>10,.1f}")
    print("(milliseconds; TTFT from arrival at the router, ITL between streamed tokens)")
    t = results.get("disaggregated", {}).get("transfer")
    if t:
        print(f"transfers (decode engine): {t['transfers']} reads, {t['blocks']} blocks, "
              f"{t['bytes'] / 2**20:,.1f} MiB, {t['seconds']:.3f} s summed ({t['gb_s']:.2f} GB/s)")
    for config, r in results.items():
        print(f"{config}: start-up {', '.join(f'{k} {v:.1f} s' for k, v in r['startup_s'].items())}; "
              f"window {r['window_s']:.1f} s; preemptions {r['preemptions']}; errors {len(r['errors'])}")
    verdict = "OK" if check["ok"] else "MISMATCH"
    print(f"greedy tokens ({check['mode']}): probes alone {check['probes_equal']}/{check['probes_compared']} "
          f"equal (the colocated engine repeats itself in {check['colocated_repeats_equal']}/"
          f"{check['colocated_repeats']}{'; not on ' + ', '.join(check['colocated_unstable']) if check['colocated_unstable'] else ''}); under load {check['equal']}/{check['compared']} requests equal ({check['longs_compared']} "
          f"long), first token differs in {check['first_token_differs']}, {check['tokens_in_common']:,} of "
          f"{check['tokens']:,} tokens before the first difference: {verdict}")
