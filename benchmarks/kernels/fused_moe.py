"""The fused-MoE kernels (kernels/moe.py) on the GPU, bf16, at Qwen3-30B-A3B's (128 experts, top-8,
hidden 2048, expert intermediate 768) and Mixtral-8x7B's (8 experts, top-2, hidden 4096,
intermediate 14336) shapes for M = 1, 8, 64, 256, 2048 tokens: the largest difference from the
PyTorch reference (kernels.reference.fused_moe_ref, one expert at a time), the kernel timed as a
CUDA graph replay and the reference eagerly (it syncs with the host), and the card's floor for each row: the weights of the experts the router hit, read
once at the copy rate, or the FLOPs at the bf16 peak, whichever is longer. Router ids are drawn
uniformly at random (a fixed seed), so M tokens hit about E * (1 - (1 - k/E)^M) experts. Prints a
table, writes JSON. Each row runs the config the kernel picks itself (kernels/configs/fused_moe.json
for this GPU and shape, else the default), which the JSON names, and times the alignment step alone.

--sweep times, instead of the table, the candidate configs of SWEEP for each shape and bucket of
rows per expert (kernels.moe.ROW_BUCKETS) at the benchmark's M values in that bucket (one at the
bucket's top where none falls in it), each checked against the reference; the fastest in sum of
times relative to the default goes to --write-configs, merged into the table the kernel reads for
this GPU model. The compiles run first on --jobs processes (inline they would take most of the
sweep).

    python3 benchmarks/kernels/fused_moe.py --json out.json [--copy-tbs 3.0] [--peak-tflops 790]
    python3 benchmarks/kernels/fused_moe.py --sweep --json sweep.json --write-configs kernels/configs/fused_moe.json

A rehearsal on the CPU (Triton's interpreter, a tiny layer, float16: the interpreter has no bf16):

    TRITON_INTERPRET=1 python3 benchmarks/kernels/fused_moe.py --device cpu --dtype float16 --shapes tiny \
        --rows 1,8 [--sweep --max-configs 2 --write-configs /tmp/fused_moe.json]
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, wait
from multiprocessing import get_context

import torch
import triton.testing

from tritium import kernels
from tritium.kernels.moe import (DEFAULT_CONFIGS, ROW_BUCKETS, FusedMoEConfig, choose_config, config_key,
                         row_bucket)
from tritium.kernels.reference import fused_moe_ref

# (experts, top_k, hidden, expert intermediate); "tiny" is for a rehearsal on the CPU.
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336), "tiny": (8, 2, 64, 32)}
MODELS = ("qwen3-30b-a3b", "mixtral-8x7b")
ROWS = (1, 8, 64, 256, 2048)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SMEM_BYTES = 232448  # an H100's (and H200's) shared memory a program may take
MAX_REL_DIFF = 2e-2  # a candidate further from the reference than this is wrong, not slow


def _fits(c: FusedMoEConfig) -> bool:
    """The gate/up kernel's pipelined tiles (x and two weight tiles, 2 bytes each, one set a stage,
    an upper bound) fit in shared memory: a config that does not fails at launch."""
    return c.num_stages * (c.block_m * c.block_k + 2 * c.block_k * c.block_n) * 2 <= SMEM_BYTES


# Candidates per bucket of rows per expert, besides the default; each is a compile or a few per
# shape, so about 12-16 a bucket keep the whole sweep within a few minutes on an H100.
_DECODE = [FusedMoEConfig(16, bn, bk, 1, 4, st)
           for bn, bk, st in itertools.product((32, 64, 128), (64, 128, 256), (3, 4))]
_PREFILL = ([FusedMoEConfig(bm, bn, 64, 8, w, st) for (bm, w), bn, st in
             itertools.product(((64, 4), (64, 8), (128, 8)), (64, 128), (3, 4))]
            + [FusedMoEConfig(bm, 128, 64, 1, w, 3) for bm, w in ((64, 4), (64, 8), (128, 8))])
SWEEP = {
    1: _DECODE,
    4: _DECODE,
    16: [FusedMoEConfig(bm, bn, bk, 1, 4, st)
         for bm, bn, bk, st in itertools.product((16, 32), (64, 128), (64, 128), (3, 4))],
    64: [FusedMoEConfig(bm, bn, bk, 8, 4, st)
         for bm, bn, bk, st in itertools.product((32, 64), (64, 128), (64, 128), (3, 4))],
    256: _PREFILL,
    0: _PREFILL,
}
SWEEP = {b: [c for c in dict.fromkeys([DEFAULT_CONFIGS[b], *cands]) if _fits(c)] for b, cands in SWEEP.items()}


def eager_time_us(fn, device: str = "cuda") -> float:
    if device != "cuda":
        return wall_time_us(fn)
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def wall_time_us(fn) -> float:
    """One call by the host clock (the CPU rehearsal: the interpreter's time means nothing)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def graph_time_us(fn, device: str = "cuda", rep: int = 200) -> float:
    """Median time of one call replayed from a CUDA graph (no launch cost), in microseconds."""
    if device != "cuda":
        return wall_time_us(fn)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile and warm outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=min(25, rep), rep=rep, return_mode="median") * 1e3


def random_layer(shape: tuple[int, int, int, int], gen: torch.Generator, dtype: torch.dtype, device: str):
    experts, _, hidden, inter = shape
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype, generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=dtype, generator=gen) * inter ** -0.5
    return w13, w2


def routed_tokens(shape: tuple[int, int, int, int], m: int, gen: torch.Generator, dtype: torch.dtype, device: str):
    """x [M, H] and the router's top-k (float32 weights summing to one, int32 ids) for M tokens."""
    experts, top_k, hidden, _ = shape
    x = torch.randn(m, hidden, device=device, dtype=dtype, generator=gen)
    logits = torch.randn(m, experts, device=device, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return x, (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


def max_rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def row(name: str, shape: tuple[int, int, int, int], m: int, copy_tbs: float, peak_tflops: float,
        dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> dict:
    experts, top_k, hidden, inter = shape
    gen = torch.Generator(device=device).manual_seed(m)
    w13, w2 = random_layer(shape, gen, dtype, device)
    x, weights, ids = routed_tokens(shape, m, gen, dtype, device)
    cfg = choose_config(m, top_k, experts, hidden, inter, w13.dtype, x.dtype, kernels.moe._device_name(x.device))
    out = kernels.fused_moe.triton(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    err = max_rel_diff(out, ref)
    kernel_us = graph_time_us(lambda: kernels.fused_moe.triton(x, w13, w2, weights, ids), device)
    align_us = graph_time_us(lambda: kernels.moe_align_block_size(ids, experts, cfg.block_m), device)
    # The reference picks each expert's rows on the host: not capturable, so timed eagerly.
    ref_us = eager_time_us(lambda: fused_moe_ref(x, w13, w2, weights, ids), device)
    hit = int(torch.unique(ids).numel())
    weight_bytes = hit * 3 * hidden * inter * 2
    flops = 2 * m * top_k * 3 * hidden * inter
    floor_us = max(weight_bytes / (copy_tbs * 1e12), flops / (peak_tflops * 1e12)) * 1e6
    return {"model": name, "m": m, "experts_hit": hit, "kernel_us": kernel_us, "reference_us": ref_us,
            "floor_us": floor_us, "of_floor": floor_us / kernel_us, "max_rel_diff": err, "align_us": align_us,
            "config": vars(cfg)}


def bucket_rows(shape: tuple[int, int, int, int], rows: tuple[int, ...]) -> dict[int, list[int]]:
    """The M values of `rows` by config bucket (kernels.moe.row_bucket of rows per expert); a
    bucket none falls in gets the M at its top (twice the largest bucket for the last)."""
    experts, top_k = shape[:2]
    per_bucket: dict[int, list[int]] = {b: [] for b in (*ROW_BUCKETS, 0)}
    for m in rows:
        per_bucket[row_bucket(-(-m * top_k // experts))].append(m)
    for b, ms in per_bucket.items():
        if not ms:
            ms.append(max(1, (b or 2 * ROW_BUCKETS[-1]) * experts // top_k))
    return per_bucket


def cfg_name(c: FusedMoEConfig) -> str:
    return f"m{c.block_m} n{c.block_n} k{c.block_k} g{c.group_m} w{c.num_warps} st{c.num_stages}"


_worker_layer: dict = {}


def _warm(job: tuple) -> str | None:
    """Compile one config at one shape and M by running it once on uninitialised weights (Triton's
    disk cache keeps the binaries for the main process); an error is returned."""
    name, shape, m, cfg, dtype, device = job
    try:
        if name not in _worker_layer:  # one layer a worker at a time (the GPU is shared)
            _worker_layer.clear()
            if device == "cuda":
                torch.cuda.empty_cache()
            experts, _, hidden, inter = shape
            _worker_layer[name] = (torch.empty(experts, 2 * inter, hidden, device=device, dtype=dtype),
                                   torch.empty(experts, hidden, inter, device=device, dtype=dtype))
        x, weights, ids = routed_tokens(shape, m, torch.Generator(device=device).manual_seed(m), dtype, device)
        kernels.fused_moe.triton(x, *_worker_layer[name], weights, ids, config=cfg)
        if device == "cuda":
            torch.cuda.synchronize()
        return None
    except Exception as exc:
        return f"{name} M={m} {cfg_name(cfg)}: {type(exc).__name__}: {str(exc)[:200]}"


def warm_compile(work: list[tuple], jobs: int, limit_s: float) -> set:
    """The sweep's compiles on `jobs` processes; returns the (name, m, config) runs that failed
    or did not finish within limit_s, which are not timed."""
    start = time.time()
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"))
    futures = {pool.submit(_warm, job): job for job in work}
    done, pending = wait(futures, timeout=limit_s)
    bad = {(futures[f][0], futures[f][2], futures[f][3]) for f in pending}
    errors = [f"{futures[f][0]} M={futures[f][2]} {cfg_name(futures[f][3])}: not done in {limit_s:.0f} s"
              for f in pending]
    for f in done:
        if f.result():
            bad.add((futures[f][0], futures[f][2], futures[f][3]))
            errors.append(f.result())
    if pending:  # a worker stuck in a kernel is ended, not waited for
        for proc in list(pool._processes.values()):
            proc.kill()
    pool.shutdown(wait=not pending, cancel_futures=True)
    print(f"compiled {len(work)} config runs in {time.time() - start:.1f} s with {jobs} processes"
          + "".join(f"\n  warm-up failed: {e}" for e in errors), flush=True)
    return bad


def sweep(names: list[str], rows: tuple[int, ...], dtype: torch.dtype, device: str, jobs: int,
          compile_limit: float, max_configs: int) -> tuple[list[dict], dict[str, FusedMoEConfig]]:
    """Every candidate of each bucket at that bucket's M values: (timed runs, {config_key: fastest})."""
    plan = [(name, b, m, SWEEP[b][:max_configs]) for name in names
            for b, ms in bucket_rows(SHAPES[name], rows).items() for m in ms]
    work = [(name, SHAPES[name], m, cfg, dtype, device) for name, _, m, cands in plan for cfg in cands]
    print(f"sweep: {len(plan)} (shape, M) points, {len(work)} config runs", flush=True)
    bad = warm_compile(work, jobs, compile_limit) if jobs > 0 else set()
    results, chosen = [], {}
    layer_of = {}
    for name, b, m, cands in plan:
        shape = SHAPES[name]
        if name not in layer_of:
            layer_of.clear()
            layer_of[name] = random_layer(shape, torch.Generator(device=device).manual_seed(0), dtype, device)
        w13, w2 = layer_of[name]
        x, weights, ids = routed_tokens(shape, m, torch.Generator(device=device).manual_seed(m), dtype, device)
        ref = fused_moe_ref(x, w13, w2, weights, ids)
        hit = int(torch.unique(ids).numel())  # the sweep's routing is not the table's: compare like with like
        for cfg in cands:
            entry = {"model": name, "bucket": b, "m": m, "experts_hit": hit, "config": vars(cfg), "us": None,
                     "max_rel_diff": None}
            results.append(entry)
            if (name, m, cfg) in bad:
                entry["error"] = "compile failed or timed out"
                continue
            try:
                fn = lambda cfg=cfg: kernels.fused_moe.triton(x, w13, w2, weights, ids, config=cfg)  # noqa: E731
                entry["max_rel_diff"] = max_rel_diff(fn(), ref)
                if not entry["max_rel_diff"] <= MAX_REL_DIFF:  # NaN fails too
                    entry["error"] = "wrong result"
                    continue
                entry["us"] = graph_time_us(fn, device, rep=40)
            except Exception as exc:  # out of resources at launch, say
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    for name in names:
        experts, top_k, hidden, inter = SHAPES[name]
        for b in (*ROW_BUCKETS, 0):
            runs = [r for r in results if r["model"] == name and r["bucket"] == b]
            ms = sorted({r["m"] for r in runs})
            default = vars(DEFAULT_CONFIGS[b])
            base = {r["m"]: r["us"] for r in runs if r["config"] == default and r["us"]}
            scores: dict[tuple, dict[int, float | None]] = {}
            for r in runs:
                scores.setdefault(tuple(sorted(r["config"].items())), {})[r["m"]] = r["us"]
            # Sum of times relative to the default's (to the best one's where the default failed),
            # so that each M counts alike; only candidates that ran at every M compete.
            valid = {k: t for k, t in scores.items() if all(t.get(m) for m in ms)}
            if not valid:
                print(f"{name:15} bucket {b or 'big':>4}: no candidate ran correctly at M = {ms}")
                continue
            unit = {m: base.get(m) or min(t[m] for t in valid.values()) for m in ms}
            best_key = min(valid, key=lambda k: sum(valid[k][m] / unit[m] for m in ms))
            best = FusedMoEConfig(**dict(best_key))
            chosen[config_key(experts, top_k, hidden, inter, dtype, b)] = best
            times = ", ".join(f"M={m} {valid[best_key][m]:.1f} us (default {base.get(m, float('nan')):.1f})"
                              for m in ms)
            print(f"{name:15} bucket {b or 'big':>4}: {cfg_name(best)}  {times}  "
                  f"[{len(valid)} of {len(scores)} candidates ran]", flush=True)
    return results, chosen


def write_configs(path: str, gpu: str, chosen: dict[str, FusedMoEConfig]) -> None:
    table = {"about": "Fastest fused_moe config per GPU model, layer shape (experts, top-k, hidden, expert "
                      "intermediate), weight dtype and bucket of rows per expert; others take the defaults "
                      "of kernels/moe.py. benchmarks/kernels/fused_moe.py --sweep --write-configs rewrites "
                      "a GPU's entries from a new sweep.", "configs": {}}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    table.setdefault("configs", {}).setdefault(gpu, {}).update({k: vars(c) for k, c in chosen.items()})
    table.setdefault("provenance", {})[gpu] = (
        f"{datetime.date.today().isoformat()} sweep by benchmarks/kernels/fused_moe.py --sweep --write-configs: "
        "the fastest config for each shape and bucket, in sum of times relative to the default at the "
        "benchmark's M values in the bucket (CUDA graph replays)")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--copy-tbs", type=float, default=3.0, help="the card's copy rate, TB/s (H100: 3.0)")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="the card's bf16 peak, TFLOP/s")
    parser.add_argument("--shapes", default=",".join(MODELS), help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="the M values (default: %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--device", default="cuda", help="cpu: a rehearsal in Triton's interpreter")
    parser.add_argument("--sweep", action="store_true", help="time the configs of SWEEP instead of the table")
    parser.add_argument("--write-configs", metavar="PATH", help="with --sweep: merge the fastest configs here")
    parser.add_argument("--jobs", type=int, default=None,
                        help="with --sweep: processes compiling the configs first (0: compile as they are timed; "
                             "default: up to 12 on a GPU, 0 on the CPU)")
    parser.add_argument("--compile-limit", type=float, default=150,
                        help="seconds for all the compiles; a run still going then is reported and not timed")
    parser.add_argument("--max-configs", type=int, default=None, help="with --sweep: the first N candidates a bucket")
    args = parser.parse_args()
    names = args.shapes.split(",")
    for name in names:
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    rows_m = tuple(int(m) for m in args.rows.split(","))
    dtype = DTYPES[args.dtype]
    if args.jobs is None:
        args.jobs = min(12, os.cpu_count() or 1) if args.device == "cuda" else 0
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    if args.sweep:
        start = time.time()
        results, chosen = sweep(names, rows_m, dtype, args.device, args.jobs, args.compile_limit, args.max_configs)
        print(f"sweep took {time.time() - start:.0f} s")
        if args.write_configs and chosen:
            write_configs(args.write_configs, gpu, chosen)
            print(f"wrote {len(chosen)} configs for {gpu} to {args.write_configs}")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"gpu": gpu, "date": datetime.date.today().isoformat(), "dtype": args.dtype,
                           "results": results, "chosen": {k: vars(c) for k, c in chosen.items()}}, f, indent=1)
        return
    rows = []
    print(f"{gpu}  copy {args.copy_tbs} TB/s  peak {args.peak_tflops} TFLOP/s")
    print(f"{'model':15} {'M':>5} {'hit':>4} {'kernel us':>10} {'ref us':>10} {'floor us':>9} "
          f"{'of floor':>8} {'max rel diff':>12} {'align us':>9}  config")
    for name in names:
        for m in rows_m:
            r = row(name, SHAPES[name], m, args.copy_tbs, args.peak_tflops, dtype, args.device)
            rows.append(r)
            ref = f"{r['reference_us']:10.1f}" if r["reference_us"] is not None else f"{'-':>10}"
            print(f"{name:15} {m:5d} {r['experts_hit']:4d} {r['kernel_us']:10.1f} {ref} {r['floor_us']:9.1f} "
                  f"{r['of_floor']:8.2f} {r['max_rel_diff']:12.2e} {r['align_us']:9.1f}  "
                  f"{cfg_name(FusedMoEConfig(**r['config']))}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"gpu": gpu, "date": datetime.date.today().isoformat(), "dtype": args.dtype,
                       "copy_tbs": args.copy_tbs, "peak_tflops": args.peak_tflops, "rows": rows}, f, indent=1)

if __name__ == "__main__":
    main()
