"""Times every algorithm of cuBLASLt's heuristic list at the engine's GEMM shapes, against
torch's F.linear (cuBLAS's own first choice), to show whether choosing the algorithm per shape
pays. Each timing is a CUDA graph of 32 GEMMs over 32 distinct weights (one model's layers, so the
weights stream from HBM as in a real step), replayed; the median replay is kept.

    python scripts/probe_cublaslt.py [--models llama-3-8b] [--rows 256,8192,1] [--count 32]
                                     [--json OUT.json]
Ends with the whole decode step's GEMMs (32 layers + LM head) in one graph: F.linear against the
fastest algorithm per shape.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cublaslt import CublasLt  # noqa: E402

# (name, out_features, in_features) per model: qkv, o, gate_up, down, lm_head
SHAPES = {
    "llama-3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                   ("down", 4096, 14336), ("lm_head", 128256, 4096)],
    "qwen2.5-7b": [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584),
                   ("down", 3584, 18944), ("lm_head", 152064, 3584)],
    "qwen2.5-1.5b": [("qkv", 2048, 1536), ("o", 1536, 1536), ("gate_up", 17920, 1536),
                     ("down", 1536, 8960), ("lm_head", 151936, 1536)],
}
LAYERS = 32


def time_graph(body, warm: int = 2, reps: int = 7) -> float:
    """Median ms of one replay of a CUDA graph of `body`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm-up outside the graph (workspace, lazy init)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(warm):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def probe_shape(lt: CublasLt, name: str, n: int, k: int, m: int, count: int) -> dict:
    layers = 1 if name == "lm_head" else LAYERS
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
               for _ in range(layers)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, weights[0]).float()
    scale = ref.abs().max().item()
    calls = LAYERS  # the LM head's single weight is multiplied 32 times too (it exceeds L2)

    def torch_body():
        for i in range(calls):
            F.linear(x, weights[i % layers])

    flop = 2.0 * m * n * k * calls
    base_ms = time_graph(torch_body)
    row = {"shape": name, "m": m, "n": n, "k": k, "torch_ms": base_ms,
           "torch_tflops": flop / base_ms / 1e9, "algorithms": []}
    for alg in lt.algorithms(m, n, k, torch.bfloat16, count):
        entry = {"index": alg.index, "describe": alg.describe(), "workspace": alg.workspace_size}
        try:
            lt.linear(x, weights[0], alg, out=out)
            err = (out.float() - ref).abs().max().item() / scale
            entry["rel_err"] = err
            if err > 2e-2:
                entry["skipped"] = "wrong result"
            else:
                def body(alg=alg):
                    for i in range(calls):
                        lt.linear(x, weights[i % layers], alg, out=out)
                entry["ms"] = time_graph(body)
                entry["tflops"] = flop / entry["ms"] / 1e9
        except Exception as exc:  # an algorithm that fails to run is reported, not fatal
            entry["skipped"] = repr(exc)[:200]
        row["algorithms"].append(entry)
    timed = [a for a in row["algorithms"] if "ms" in a]
    if timed:
        best = min(timed, key=lambda a: a["ms"])
        row["best_index"], row["best_ms"] = best["index"], best["ms"]
        row["best_vs_torch"] = base_ms / best["ms"]
        row["first_ms"] = next((a["ms"] for a in timed if a["index"] == 0), None)
    return row


def decode_step(lt: CublasLt, shapes, m: int, best: dict[str, int], count: int) -> dict:
    """All of a step's GEMMs in one graph: 32 layers of qkv, o, gate_up, down, then the LM head
    (left out of prefill-sized steps)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    layer_shapes = [s for s in shapes if s[0] != "lm_head"]
    head = next((s for s in shapes if s[0] == "lm_head"), None)
    weights = [{name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                for name, n, k in layer_shapes} for _ in range(LAYERS)]
    head_w = (torch.randn(head[1], head[2], device="cuda", dtype=torch.bfloat16, generator=gen)
              if head else None)
    inputs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
              for name, n, k in shapes}
    outs = {name: torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for name, n, k in shapes}
    algs = {}
    for name, n, k in shapes:
        found = {a.index: a for a in lt.algorithms(m, n, k, torch.bfloat16, count)}
        algs[name] = found[best.get(name, 0)]

    def torch_body():
        for layer in weights:
            for name, _, _ in layer_shapes:
                F.linear(inputs[name], layer[name])
        if head:
            F.linear(inputs["lm_head"], head_w)

    def lt_body():
        for layer in weights:
            for name, _, _ in layer_shapes:
                lt.linear(inputs[name], layer[name], algs[name], out=outs[name])
        if head:
            lt.linear(inputs["lm_head"], head_w, algs["lm_head"], out=outs["lm_head"])

    result = {}
    for label, body in (("torch", torch_body), ("chosen", lt_body), ("torch_again", torch_body),
                        ("chosen_again", lt_body)):
        result[label + "_ms"] = time_graph(body, warm=3, reps=15)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="llama-3-8b")
    ap.add_argument("--rows", default="256,8192,1")
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lt = CublasLt()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cublaslt": lt.path, "models": {}}
    t0 = time.time()
    for model in args.models.split(","):
        shapes = SHAPES[model]
        per_rows = {}
        for m in (int(r) for r in args.rows.split(",")):
            # the LM head sees one row per sequence, never a prefill step's 8,192
            step_shapes = [s for s in shapes if m <= 512 or s[0] != "lm_head"]
            count = args.count if m < 4096 else min(args.count, 16)
            rows = []
            for name, n, k in step_shapes:
                rows.append(probe_shape(lt, name, n, k, m, count))
                torch.cuda.empty_cache()  # the shape's 32 weights are gone with its frame
            print(f"\n{model}  M={m}  ({time.time() - t0:.0f}s)")
            print(f"{'shape':8} {'torch ms':>9} {'TFLOP/s':>8} {'#0 ms':>8} {'best ms':>8} "
                  f"{'gain':>6}  best algorithm")
            for r in rows:
                best = next((a for a in r["algorithms"] if a.get("index") == r.get("best_index")), {})
                print(f"{r['shape']:8} {r['torch_ms']:9.3f} {r['torch_tflops']:8.0f} "
                      f"{(r.get('first_ms') or float('nan')):8.3f} {r.get('best_ms', float('nan')):8.3f} "
                      f"{r.get('best_vs_torch', float('nan')):6.3f}  {best.get('describe', '-')}"
                      f"  ({len(r['algorithms'])} candidates)")
            step = {}
            if m >= 64:
                step = decode_step(lt, step_shapes, m,
                                   {r["shape"]: r.get("best_index", 0) for r in rows}, count)
                print(f"all GEMMs of a step at M={m}: " + ", ".join(f"{k} {v:.3f}" for k, v in step.items()))
            per_rows[str(m)] = {"shapes": rows, "step": step}
            if args.json:
                report["models"][model] = per_rows
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=1)
        report["models"][model] = per_rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
