"""Collect one benchmark run (benchmarks/gpu.sh e2e's work directory) into results.json and print
the summary table: every engine figure next to the Hugging Face anchor of the same run, and
against the targets; a second table for the long-context workloads (C, L) when the run had them;
then each phase's GPU clock and power (benchmarks/loadgen/gpu_telemetry.py).

    python -m benchmarks.loadgen.bench_report --work /tmp/tritium-bench/work --out $OUT/results.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from . import gpu_telemetry
from .bench import clean_json

MODELS = ("llama-3-8b", "qwen2.5-7b", "qwen2.5-1.5b")
# The issue's targets (bf16, one H200); stated for Llama-3-8B shapes.
TARGETS = {"A_out_tok_s": 11000.0, "B_decode_tok_s": 200.0, "serving_overhead": 0.05, "B_ttft_ms": 40.0}
TARGET_MODEL = "llama-3-8b"
# HF generate, static batches of 64, measured earlier on the same kind of machine
# (shared/notes/anchors.md): a sanity check for this run's own HF figure.
EARLIER_HF_A = {"llama-3-8b": 1871.0, "qwen2.5-7b": 1758.0, "qwen2.5-1.5b": 1701.0}


def _get(d: dict[str, Any] | None, *keys: str) -> float:
    for k in keys:
        if not isinstance(d, dict) or d.get(k) is None:
            return math.nan
        d = d[k]
    return float(d) if isinstance(d, (int, float)) else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def derive(triton: dict[str, Any], offline: dict[str, Any], hf: dict[str, Any]) -> dict[str, float]:
    """The headline figures of one model. Inputs are {workload: summary} per runner ({} if the
    runner did not run)."""
    a_tri = _get(triton, "A", "output_tok_s")
    a_off = _get(offline, "A", "output_tok_s")
    a_hf = _get(hf, "A", "output_tok_s")
    return {
        "A_out_tok_s_triton": a_tri,
        "A_out_tok_s_offline": a_off,
        "A_out_tok_s_hf": a_hf,
        "A_ratio_triton_vs_hf": _ratio(a_tri, a_hf),
        "A_ratio_offline_vs_hf": _ratio(a_off, a_hf),
        # Share of the in-process throughput lost by serving through Triton (negative: faster).
        "serving_overhead": 1.0 - _ratio(a_tri, a_off),
        "A_requests_s_triton": _get(triton, "A", "requests_s"),
        "A_ttft_p50_ms_triton": _get(triton, "A", "ttft_ms", "p50"),
        "A_ttft_p99_ms_triton": _get(triton, "A", "ttft_ms", "p99"),
        "A_itl_p50_ms_triton": _get(triton, "A", "itl_ms", "p50"),
        "A_itl_p99_ms_triton": _get(triton, "A", "itl_ms", "p99"),
        "B_decode_tok_s_triton": _get(triton, "B", "decode_tok_s"),
        "B_decode_tok_s_offline": _get(offline, "B", "decode_tok_s"),
        "B_decode_tok_s_hf": _get(hf, "B", "decode_tok_s"),
        "B_ratio_triton_vs_hf": _ratio(_get(triton, "B", "decode_tok_s"), _get(hf, "B", "decode_tok_s")),
        "B_ttft_ms_triton": _get(triton, "B", "ttft_ms", "p50"),
        "B_ttft_ms_offline": _get(offline, "B", "ttft_ms", "p50"),
        "B_ttft_ms_hf": _get(hf, "B", "ttft_ms", "p50"),
        "B_itl_p50_ms_triton": _get(triton, "B", "itl_ms", "p50"),
        "B_itl_p99_ms_triton": _get(triton, "B", "itl_ms", "p99"),
        **derive_long(triton, offline, hf),
    }


def derive_long(triton: dict[str, Any], offline: dict[str, Any], hf: dict[str, Any]) -> dict[str, float]:
    """The long-context workloads' figures: C as A's (throughput, TTFT), L as B's (decode rate)."""
    c_tri, c_off = _get(triton, "C", "output_tok_s"), _get(offline, "C", "output_tok_s")
    l_tri = _get(triton, "L", "decode_tok_s")
    return {
        "C_out_tok_s_triton": c_tri,
        "C_out_tok_s_offline": c_off,
        "C_out_tok_s_hf": _get(hf, "C", "output_tok_s"),
        "C_ratio_triton_vs_hf": _ratio(c_tri, _get(hf, "C", "output_tok_s")),
        "C_serving_overhead": 1.0 - _ratio(c_tri, c_off),
        "C_ttft_p50_ms_triton": _get(triton, "C", "ttft_ms", "p50"),
        "C_ttft_p99_ms_triton": _get(triton, "C", "ttft_ms", "p99"),
        "C_itl_p50_ms_triton": _get(triton, "C", "itl_ms", "p50"),
        "C_itl_p99_ms_triton": _get(triton, "C", "itl_ms", "p99"),
        "L_decode_tok_s_triton": l_tri,
        "L_decode_tok_s_offline": _get(offline, "L", "decode_tok_s"),
        "L_decode_tok_s_hf": _get(hf, "L", "decode_tok_s"),
        "L_ratio_triton_vs_hf": _ratio(l_tri, _get(hf, "L", "decode_tok_s")),
        "L_ttft_ms_triton": _get(triton, "L", "ttft_ms", "p50"),
        "L_ttft_ms_offline": _get(offline, "L", "ttft_ms", "p50"),
        "L_ttft_ms_hf": _get(hf, "L", "ttft_ms", "p50"),
        "L_itl_p50_ms_triton": _get(triton, "L", "itl_ms", "p50"),
        "L_itl_p99_ms_triton": _get(triton, "L", "itl_ms", "p99"),
    }


def check_targets(d: dict[str, float]) -> dict[str, bool | None]:
    """Pass/fail per target; None where the figure is missing."""
    def ok(value: float, good: bool) -> bool | None:
        return None if math.isnan(value) else good

    return {
        "A_out_tok_s": ok(d["A_out_tok_s_triton"], d["A_out_tok_s_triton"] >= TARGETS["A_out_tok_s"]),
        "B_decode_tok_s": ok(d["B_decode_tok_s_triton"], d["B_decode_tok_s_triton"] >= TARGETS["B_decode_tok_s"]),
        "serving_overhead": ok(d["serving_overhead"], d["serving_overhead"] < TARGETS["serving_overhead"]),
        "B_ttft_ms": ok(d["B_ttft_ms_triton"], d["B_ttft_ms_triton"] < TARGETS["B_ttft_ms"]),
    }


def off_target_reason(meta: dict[str, Any]) -> str | None:
    """Why this run is not the targets' configuration (bf16 weights and KV cache, the issue's
    workload sizes, on the GPU, no LoRA adapters), or None when it is. Only such a run is checked against them."""
    sets = dict(item.split("=", 1) for item in (meta.get("engine_args") or "").split()
                if item != "--set" and "=" in item)
    reasons = []
    if meta.get("dtype", "bfloat16") != "bfloat16":
        reasons.append(f"dtype={meta['dtype']}")
    if meta.get("device", "cuda") != "cuda":
        reasons.append(f"device={meta['device']}")
    for key in ("quantization", "kv_cache_dtype"):
        if sets.get(key, "auto").lower() not in ("auto", "none", ""):
            reasons.append(f"{key}={sets[key]}")
    if meta.get("sizes"):
        reasons.append(f"workload sizes {meta['sizes']}")
    if meta.get("lora_names"):
        reasons.append(f"LoRA adapters {meta['lora_names']}")
    return ", ".join(reasons) or None


def _summaries(doc: dict[str, Any] | None) -> dict[str, Any]:
    """{workload: summary} from a runner's JSON (offline/HF: one file; Triton: one per workload)."""
    if not doc:
        return {}
    if "workloads" in doc and isinstance(doc["workloads"], dict) and "runner" in doc:
        return {k: v.get("summary", {}) for k, v in doc["workloads"].items()}
    return {}


def _load(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def collect(work: str) -> dict[str, Any]:
    meta = _load(os.path.join(work, "meta.json")) or {}
    off_target = off_target_reason(meta)
    models: dict[str, Any] = {}
    for name in sorted(os.listdir(work)) if os.path.isdir(work) else []:
        mdir = os.path.join(work, name)
        if not os.path.isdir(mdir) or name == "logs":
            continue
        triton = {}
        for f in sorted(os.listdir(mdir)):  # triton_<workload>.json, one per workload run
            doc = _load(os.path.join(mdir, f)) if f.startswith("triton_") and f.endswith(".json") else None
            if doc:
                triton[f[len("triton_"):-len(".json")]] = doc.get("summary", {})
        offline = _summaries(_load(os.path.join(mdir, "offline.json")))
        hf = _summaries(_load(os.path.join(mdir, "hf.json")))
        d = derive(triton, offline, hf)
        models[name] = {"triton": triton, "offline": offline, "hf": hf, "derived": d,
                        "targets_met": (check_targets(d) if name == TARGET_MODEL and not off_target
                                        else None),
                        "earlier_hf_A_out_tok_s": EARLIER_HF_A.get(name),
                        "workload_plan": _load(os.path.join(mdir, "workload_plan.json"))}
    phases = []
    ppath = os.path.join(work, "phases.jsonl")
    if os.path.exists(ppath):
        with open(ppath, encoding="utf-8") as f:
            phases = [json.loads(line) for line in f if line.strip()]
    gpu_telemetry.annotate_phases(phases, gpu_telemetry.parse_log(os.path.join(work, "gpu_telemetry.csv")))
    return {"meta": meta, "targets": TARGETS, "target_model": TARGET_MODEL, "models": models, "phases": phases,
            "targets_not_applied": off_target}


def _fmt(v: float, spec: str, suffix: str = "") -> str:
    return "-" if v is None or math.isnan(v) else format(v, spec) + suffix


def render_table(results: dict[str, Any]) -> str:
    """Markdown: one row per model, the layout of docs/performance.md."""
    head = ("| model | A Triton tok/s | A in-process tok/s | A HF tok/s | A Triton / HF | serving overhead "
            "| A TTFT p50 / p99 ms | A ITL p50 / p99 ms | B decode tok/s (Triton / in-proc / HF) "
            "| B TTFT ms (Triton / in-proc / HF) |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, m in results["models"].items():
        d = m["derived"]
        rows.append(
            f"| {name} | {_fmt(d['A_out_tok_s_triton'], ',.0f')} | {_fmt(d['A_out_tok_s_offline'], ',.0f')} "
            f"| {_fmt(d['A_out_tok_s_hf'], ',.0f')} | {_fmt(d['A_ratio_triton_vs_hf'], '.2f', 'x')} "
            f"| {_fmt(d['serving_overhead'] * 100, '.1f', '%')} "
            f"| {_fmt(d['A_ttft_p50_ms_triton'], '.0f')} / {_fmt(d['A_ttft_p99_ms_triton'], '.0f')} "
            f"| {_fmt(d['A_itl_p50_ms_triton'], '.1f')} / {_fmt(d['A_itl_p99_ms_triton'], '.1f')} "
            f"| {_fmt(d['B_decode_tok_s_triton'], '.0f')} / {_fmt(d['B_decode_tok_s_offline'], '.0f')} "
            f"/ {_fmt(d['B_decode_tok_s_hf'], '.0f')} "
            f"| {_fmt(d['B_ttft_ms_triton'], '.1f')} / {_fmt(d['B_ttft_ms_offline'], '.1f')} "
            f"/ {_fmt(d['B_ttft_ms_hf'], '.1f')} |")
    lines = ["\n".join(rows)]
    long_table = render_long_table(results)
    if long_table:
        lines.append(long_table)
    t = results["models"].get(TARGET_MODEL, {}).get("targets_met")
    if TARGET_MODEL in results["models"] and results.get("targets_not_applied"):
        lines.append(f"Targets ({TARGET_MODEL}): not checked, they are for bf16 weights and a bf16 KV cache "
                     f"at the issue's sizes; this run: {results['targets_not_applied']}")
    elif t:
        def word(v: bool | None) -> str:
            return "not measured" if v is None else ("met" if v else "NOT met")
        lines.append(
            f"Targets ({TARGET_MODEL}): A >= {TARGETS['A_out_tok_s']:,.0f} tok/s {word(t['A_out_tok_s'])}; "
            f"B decode >= {TARGETS['B_decode_tok_s']:.0f} tok/s {word(t['B_decode_tok_s'])}; "
            f"serving overhead < {TARGETS['serving_overhead'] * 100:.0f}% {word(t['serving_overhead'])}; "
            f"B TTFT < {TARGETS['B_ttft_ms']:.0f} ms {word(t['B_ttft_ms'])}")
    for p in results.get("phases", []):
        if p.get("rc") not in (0, None):
            lines.append(f"phase {p.get('model')}/{p.get('phase')} exited {p.get('rc')} after {p.get('seconds')} s")
        gpu = gpu_telemetry.describe(p)
        if gpu:
            lines.append(gpu)
    return "\n".join(lines)


def render_long_table(results: dict[str, Any]) -> str:
    """Markdown for the long-context workloads (C, L) of the models that ran one, and the
    workloads each model skipped; empty when there is neither."""
    head = ("| model | C Triton tok/s | C in-process tok/s | C HF tok/s | C serving overhead "
            "| C TTFT p50 / p99 ms | L decode tok/s (Triton / in-proc / HF) | L TTFT ms (Triton / in-proc / HF) |")
    rows, notes = [], []
    for name, m in results["models"].items():
        d = m["derived"]
        skipped = (m.get("workload_plan") or {}).get("skipped") or {}
        notes += [f"{name}: workload {w} skipped ({why})" for w, why in skipped.items()]
        if all(math.isnan(v) for k, v in d.items() if k[:2] in ("C_", "L_")):
            continue
        rows.append(
            f"| {name} | {_fmt(d['C_out_tok_s_triton'], ',.0f')} | {_fmt(d['C_out_tok_s_offline'], ',.0f')} "
            f"| {_fmt(d['C_out_tok_s_hf'], ',.0f')} | {_fmt(d['C_serving_overhead'] * 100, '.1f', '%')} "
            f"| {_fmt(d['C_ttft_p50_ms_triton'], '.0f')} / {_fmt(d['C_ttft_p99_ms_triton'], '.0f')} "
            f"| {_fmt(d['L_decode_tok_s_triton'], '.0f')} / {_fmt(d['L_decode_tok_s_offline'], '.0f')} "
            f"/ {_fmt(d['L_decode_tok_s_hf'], '.0f')} "
            f"| {_fmt(d['L_ttft_ms_triton'], '.0f')} / {_fmt(d['L_ttft_ms_offline'], '.0f')} "
            f"/ {_fmt(d['L_ttft_ms_hf'], '.0f')} |")
    table = [head, "|" + "---|" * (head.count("|") - 1), *rows] if rows else []
    return "\n".join(table + notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quiet", action="store_true", help="write results.json without the table")
    args = ap.parse_args(argv)
    results = collect(args.work)
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(clean_json(results), f, indent=1)
    os.replace(tmp, args.out)  # a run killed at its time limit still leaves a whole file
    if not args.quiet:
        print(render_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
