"""The fused-MoE kernels (kernels/moe.py) on the GPU, bf16, at Qwen3-30B-A3B's (128 experts, top-8,
hidden 2048, expert intermediate 768) and Mixtral-8x7B's (8 experts, top-2, hidden 4096,
intermediate 14336) shapes for M = 1, 8, 64, 256, 2048 tokens: the largest difference from the
PyTorch reference (kernels.reference.fused_moe_ref, one expert at a time), the kernel timed as a
CUDA graph replay and the reference eagerly (it syncs with the host), and the card's floor for each row: the weights of the experts the router hit, read
once at the copy rate, or the FLOPs at the bf16 peak, whichever is longer. Router ids are drawn
uniformly at random (a fixed seed), so M tokens hit about E * (1 - (1 - k/E)^M) experts. Prints a
table, writes JSON.

    python3 benchmarks/kernels/fused_moe.py --json out.json [--copy-tbs 3.0] [--peak-tflops 790]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import triton.testing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import kernels  # noqa: E402
from kernels.reference import fused_moe_ref  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
ROWS = (1, 8, 64, 256, 2048)


def eager_time_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def graph_time_us(fn) -> float:
    """Median time of one call replayed from a CUDA graph (no launch cost), in microseconds."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile and warm outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3


def row(name: str, shape: tuple[int, int, int, int], m: int, copy_tbs: float, peak_tflops: float) -> dict:
    experts, top_k, hidden, inter = shape
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * inter ** -0.5
    logits = torch.randn(m, experts, device="cuda", generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).float()
    ids = ids.to(torch.int32)
    out = kernels.fused_moe(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    kernel_us = graph_time_us(lambda: kernels.fused_moe(x, w13, w2, weights, ids))
    # The reference picks each expert's rows on the host: not capturable, so timed eagerly.
    ref_us = eager_time_us(lambda: fused_moe_ref(x, w13, w2, weights, ids))
    hit = int(torch.unique(ids).numel())
    weight_bytes = hit * 3 * hidden * inter * 2
    flops = 2 * m * top_k * 3 * hidden * inter
    floor_us = max(weight_bytes / (copy_tbs * 1e12), flops / (peak_tflops * 1e12)) * 1e6
    return {"model": name, "m": m, "experts_hit": hit, "kernel_us": kernel_us, "reference_us": ref_us,
            "floor_us": floor_us, "of_floor": floor_us / kernel_us, "max_rel_diff": err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--copy-tbs", type=float, default=3.0, help="the card's copy rate, TB/s (H100: 3.0)")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="the card's bf16 peak, TFLOP/s")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    args = parser.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}  copy {args.copy_tbs} TB/s  peak {args.peak_tflops} TFLOP/s")
    print(f"{'model':15} {'M':>5} {'hit':>4} {'kernel us':>10} {'ref us':>10} {'floor us':>9} "
          f"{'of floor':>8} {'max rel diff':>12}")
    for name in args.shapes.split(","):
        for m in ROWS:
            r = row(name, SHAPES[name], m, args.copy_tbs, args.peak_tflops)
            rows.append(r)
            ref = f"{r['reference_us']:10.1f}" if r["reference_us"] is not None else f"{'-':>10}"
            print(f"{name:15} {m:5d} {r['experts_hit']:4d} {r['kernel_us']:10.1f} {ref} {r['floor_us']:9.1f} "
                  f"{r['of_floor']:8.2f} {r['max_rel_diff']:12.2e}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                       "copy_tbs": args.copy_tbs, "peak_tflops": args.peak_tflops, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
