#!/usr/bin/env python3
"""Time the decoder's bf16 GEMMs at the engine's shapes, in the layouts and BLAS back ends PyTorch
offers, to see whether one beats the engine's `F.linear(x, W)` (W stored [N, K]).

    python3 scripts/bench_gemm.py --model models/configs/llama-3-8b [--m 256 --m 8192] [--json F]

Variants per (M, N, K): `linear` = F.linear(x, W) as the engine runs it (cuBLAS "TN");
`mm_kn` = x @ Wt with Wt = W.t().contiguous() stored [K, N] ("NN"); each with the default BLAS
back end and with cuBLASLt preferred (torch.backends.cuda.preferred_blas_library). Times are
medians of CUDA-event timings over back-to-back runs (weights not in L2 at M>=256: 16 GB of
weights per step do not fit). Prints one table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backend.config import load_hf_config  # noqa: E402


def shapes(cfg: dict) -> list[tuple[str, int, int, int]]:
    """(name, N, K, calls per step) of each linear layer of one decoder step."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or h // heads
    layers = cfg["num_hidden_layers"]
    return [("qkv", (heads + 2 * kv) * d, h, layers), ("o", h, heads * d, layers),
            ("gate_up", 2 * inter, h, layers), ("down", h, inter, layers),
            ("lm_head", cfg["vocab_size"], h, 1)]


def time_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--m", type=int, action="append")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    a = ap.parse_args()
    cfg = load_hf_config(a.model)
    ms = a.m or [1, 256, 8192]
    dev, dt = "cuda", torch.bfloat16
    rows = []
    for name, n, k, calls in shapes(cfg):
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        wt = w.t().contiguous()
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=dt)
            ref = F.linear(x, w)
            row = {"gemm": name, "M": m, "N": n, "K": k, "calls_per_step": calls}
            for backend in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(backend)
                for variant, fn in (("linear", lambda: F.linear(x, w)), ("mm_kn", lambda: x @ wt)):
                    out = fn()
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    t = time_ms(fn, a.reps)
                    row[f"{variant}/{backend}_ms"] = round(t, 4)
                    row[f"{variant}/{backend}_tflops"] = round(2 * m * n * k / t / 1e9, 1)
                    row[f"{variant}/{backend}_err"] = err
            torch.backends.cuda.preferred_blas_library("cublas")
            rows.append(row)
            del x, ref
        del w, wt
        torch.cuda.empty_cache()
    variants = ["linear/cublas", "mm_kn/cublas", "linear/cublaslt", "mm_kn/cublaslt"]
    print(f"{'gemm':8} {'M':>5} {'N':>6} {'K':>6} " + " ".join(f"{v:>16}" for v in variants) + "  (TFLOP/s)")
    for r in rows:
        print(f"{r['gemm']:8} {r['M']:>5} {r['N']:>6} {r['K']:>6} "
              + " ".join(f"{r[v + '_tflops']:>16}" for v in variants))
    print("\nper decoder step (ms, all layers):")
    for m in ms:
        sel = [r for r in rows if r["M"] == m]
        tot = {v: sum(r[v + "_ms"] * r["calls_per_step"] for r in sel) for v in variants}
        best = sum(min(r[v + "_ms"] for v in variants) * r["calls_per_step"] for r in sel)
        print(f"M={m}: " + ", ".join(f"{v} {t:.2f}" for v, t in tot.items()) + f", best per shape {best:.2f}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"model": a.model, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
