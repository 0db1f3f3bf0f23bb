#!/usr/bin/env python3
"""Is PyTorch's CUTLASS GEMM (`torch._grouped_mm`, one group) faster than cuBLAS (`F.linear`) at
the decoder's shapes? `_grouped_mm` runs CUTLASS's warp-specialized persistent sm_90 kernels
(128x256 cooperative tiles, or 64x128 ping-pong when M or N <= 128, 2x1 clusters) where
`F.linear` runs cuBLAS's pick; cuBLASLt's other algorithms and our own Triton GEMM lost to it
(docs/performance_notes.md rows 19 and 36).

    python3 scripts/probe_grouped_mm.py --model models/configs/llama-3-8b [--m 256 --m 8192] [--json F]

Per shape: a CUDA graph of the 32 layers' calls (32 distinct weight tensors, so the weights
stream from HBM as in the engine), replayed back to back; the two back ends alternate (cuBLAS,
CUTLASS, cuBLAS, CUTLASS) so power-cap drift hits both. Then a whole decode step's GEMMs in
layer order, each back end and the faster one per shape, again alternating, sustained for about
a second each (at the 700 W cap a kernel's isolated gain shows only in part).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from backend.config import load_hf_config  # noqa: E402
from bench_gemm import shapes  # noqa: E402
from probe_cublaslt import time_graph  # noqa: E402


def cutlass_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T through torch._grouped_mm with one group; w [N, K] row-major is B = w.T [K, N]
    column-major, so nothing is copied."""
    return torch._grouped_mm(x.unsqueeze(0), w.t().unsqueeze(0)).squeeze(0)


BACKENDS = {"cublas": F.linear, "cutlass": cutlass_linear}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--m", type=int, action="append")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--step-seconds", type=float, default=1.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    cfg = load_hf_config(a.model)
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    report: dict = {"model": a.model, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "shapes": [], "steps": []}
    weights = {name: [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(calls)]
               for name, n, k, calls in shapes(cfg)}
    for m in a.m or [256, 8192]:
        best: dict[str, str] = {}
        print(f"\nM={m}: ms for all layers' calls of a shape (median of {a.reps} replays, two rounds)")
        print(f"{'shape':8} {'cublas':>9} {'cutlass':>9} {'TFLOP/s':>15}  max rel err")
        for name, n, k, calls in shapes(cfg):
            x = torch.randn(m, k, device=dev, dtype=dt)
            ref = F.linear(x, weights[name][0]).float()
            err = ((cutlass_linear(x, weights[name][0]).float() - ref).norm() / ref.norm()).item()

            def calls_of(f):
                for w in weights[name]:
                    f(x, w)

            times: dict[str, list[float]] = {b: [] for b in BACKENDS}
            for _ in range(2):  # alternating, so that power-cap drift hits both
                for b, f in BACKENDS.items():
                    times[b].append(time_graph(lambda f=f: calls_of(f), reps=a.reps))
            med = {b: statistics.median(t) for b, t in times.items()}
            best[name] = min(med, key=med.get)
            flops = 2 * m * n * k * calls
            print(f"{name:8} {med['cublas']:9.3f} {med['cutlass']:9.3f} "
                  f"{flops / med['cublas'] / 1e9:7.0f} {flops / med['cutlass'] / 1e9:7.0f}  {err:.2e}")
            report["shapes"].append({"M": m, "gemm": name, "N": n, "K": k, "calls": calls, "rel_err": err,
                                     **{f"{b}_ms": med[b] for b in BACKENDS}})
            del x, ref
        # A whole step's GEMMs in layer order, sustained.
        x_in = {k: torch.randn(m, k, device=dev, dtype=dt) for k in {s[2] for s in shapes(cfg)}}
        order = [(name, i) for i in range(cfg["num_hidden_layers"]) for name in ("qkv", "o", "gate_up", "down")]
        order.append(("lm_head", 0))
        k_of = {name: k for name, _, k, _ in shapes(cfg)}
        plans = {"cublas": {n: "cublas" for n in k_of}, "cutlass": {n: "cutlass" for n in k_of}, "best": best}

        def step(plan):
            for name, i in order:
                BACKENDS[plan[name]](x_in[k_of[name]], weights[name][i])

        one = time_graph(lambda: step(plans["cublas"]), reps=3)
        reps = max(3, int(a.step_seconds * 1000 / one))
        line: dict[str, list[float]] = {p: [] for p in plans}
        for _ in range(2):
            for p, plan in plans.items():
                line[p].append(round(time_graph(lambda plan=plan: step(plan), reps=reps), 3))
        print(f"M={m} whole step's GEMMs, ms per step (sustained {reps} replays, two rounds): {line}; "
              f"best per shape: {best}")
        report["steps"].append({"M": m, "ms_per_step": line, "best": best, "reps": reps})
        del x_in
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
