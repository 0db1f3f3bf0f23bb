#!/usr/bin/env python3
"""Sweep kernels/matmul.py's launch configs against cuBLAS (F.linear) at the linear layers'
shapes of a decode step (M = 256 rows) and a prefill step (M = 8192), GPU only.

Each candidate is timed inside a CUDA graph that runs it over several copies of the weight
(so a weight that fits in L2 is still read from HBM, as in a real step), per call. The MLP's
fused `linear_silu_and_mul` is compared with F.linear followed by the silu_and_mul kernel.

    python3 scripts/sweep_matmul.py --out $OUT/sweep_matmul.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
# (block_m, block_n, block_k, num_warps, num_stages[, warp_specialize])
CONFIGS = [(128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
           (256, 128, 64, 8, 3), (256, 128, 64, 8, 4), (128, 128, 128, 8, 3), (64, 128, 64, 4, 4),
           (64, 256, 64, 4, 3), (64, 128, 128, 4, 3), (128, 64, 64, 4, 5), (64, 64, 64, 4, 6),
           (256, 64, 64, 8, 4), (64, 256, 64, 8, 4), (128, 64, 128, 4, 4), (128, 128, 64, 8, 5),
           (128, 128, 64, 4, 4, True), (128, 256, 64, 8, 3, True), (64, 128, 64, 4, 4, True)]
DT = torch.bfloat16


def config(c):
    from kernels.matmul import MatmulConfig
    bm, bn, bk, w, s = c[:5]
    return MatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s,
                        warp_specialize=len(c) > 5 and c[5])


def _warm(job) -> str:
    """Compile one (config, fused) variant in a worker; the disk cache serves the parent."""
    c, fused = job
    try:
        from kernels.matmul import linear, linear_silu_and_mul
        x = torch.randn(256, 512, device="cuda", dtype=DT)
        w = torch.randn(1024, 512, device="cuda", dtype=DT)
        (linear_silu_and_mul if fused else linear)(x, w, config=config(c))
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # noqa: BLE001 (a config that does not fit is reported, not fatal)
        return f"{c} fused={fused}: {type(exc).__name__}: {str(exc)[:160]}"


def graph_us(fn, xs, ws) -> float:
    """Per-call microseconds of fn(x, w) over all weight copies, replayed in a CUDA graph."""
    for w in ws[:1]:
        fn(xs, w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in ws:
            fn(xs, w)
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps / len(ws)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--m", default="256,8192")
    ap.add_argument("--jobs", type=int, default=8)
    a = ap.parse_args()
    from kernels import activation
    from kernels.matmul import linear, linear_silu_and_mul
    start = time.time()
    jobs = [(c, f) for c in CONFIGS for f in (False, True)]
    with ProcessPoolExecutor(max_workers=a.jobs, mp_context=get_context("spawn")) as pool:
        failed = [e for e in pool.map(_warm, jobs) if e]
    print(f"compiled {len(jobs)} variants in {time.time() - start:.0f} s; failed: {len(failed)}", flush=True)
    for e in failed:
        print("  ", e)
    results = []
    for m in (int(v) for v in a.m.split(",")):
        step = {"cublas": 0.0, "triton_best": 0.0}
        for name, (n, k) in SHAPES.items():
            copies = max(2, min(8, -(-(256 << 20) // (n * k * 2))))
            ws = [torch.randn(n, k, device="cuda", dtype=DT) * 0.02 for _ in range(copies)]
            x = torch.randn(m, k, device="cuda", dtype=DT)
            ref = F.linear(x, ws[0])
            rows = [{"impl": "cublas", "us": graph_us(F.linear, x, ws)}]
            fused_ref = None
            if name == "gate_up":
                fused_ref = activation.silu_and_mul(ref)
                rows.append({"impl": "cublas+silu_and_mul",
                             "us": graph_us(lambda x, w: activation.silu_and_mul(F.linear(x, w)), x, ws)})
            for c in CONFIGS:
                for fused in ((False, True) if name == "gate_up" else (False,)):
                    fn = linear_silu_and_mul if fused else linear
                    label = f"{'fused ' if fused else ''}{c}"
                    try:
                        out = fn(x, ws[0], config=config(c))
                        want = fused_ref if fused else ref
                        err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
                        if err > 2e-2:
                            rows.append({"impl": label, "error": f"rel err {err:.3g}"})
                            continue
                        us = graph_us(lambda x, w, fn=fn, c=c: fn(x, w, config=config(c)), x, ws)
                        rows.append({"impl": label, "us": us, "rel_err": err})
                    except Exception as exc:  # noqa: BLE001
                        rows.append({"impl": label, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            flops = 2 * m * n * k
            for r in rows:
                if "us" in r:
                    r["TFLOPs"] = flops / r["us"] / 1e6
            ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
            print(f"\n== {name} M={m} N={n} K={k} ({copies} weight copies)")
            for r in rows[:2]:
                print(f"  {r['impl']:>28} {r.get('us', 0):9.1f} us {r.get('TFLOPs', 0):6.0f} TFLOP/s")
            for r in [r for r in ok if r["impl"].startswith("(")][:4] + [r for r in ok if r["impl"].startswith("fused")][:4]:
                print(f"  {r['impl']:>28} {r['us']:9.1f} us {r['TFLOPs']:6.0f} TFLOP/s")
            errors = [r for r in rows if "error" in r]
            if errors:
                print(f"  {len(errors)} failed, e.g. {errors[0]['impl']}: {errors[0]['error']}")
            plain = [r for r in ok if r["impl"].startswith("(")]
            step["cublas"] += rows[1 if name == "gate_up" else 0]["us"] * LAYERS
            fused_best = [r for r in ok if r["impl"].startswith("fused")]
            best = (fused_best or plain)[0]["us"] if name == "gate_up" else plain[0]["us"]
            step["triton_best"] += best * LAYERS
            results.append({"name": name, "m": m, "n": n, "k": k, "rows": rows})
            del ws, x, ref
            torch.cuda.empty_cache()
        print(f"\nM={m}: per step, all {LAYERS} layers (gate_up with its activation): cuBLAS "
              f"{step['cublas'] / 1000:.2f} ms, best Triton per shape {step['triton_best'] / 1000:.2f} ms")
        results.append({"m": m, "step_ms": {k: v / 1000 for k, v in step.items()}})
    if a.out:
        Path(a.out).write_text(json.dumps({"results": results, "seconds": time.time() - start}, indent=1))


if __name__ == "__main__":
    main()
