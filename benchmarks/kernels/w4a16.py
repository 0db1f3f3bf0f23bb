"""W4A16 matmul on the GPU: kernels.w4a16_matmul (4-bit weights, groups of 128, as AWQ / GPTQ
checkpoints hold them) against cuBLAS bf16 (F.linear) at Llama-3-8B's projections (qkv
4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096) for M = 1, 8, 16, 64, 256,
4096 rows; each timed as a CUDA graph replay (triton.testing.do_bench_cudagraph, no launch
cost), with the speedup over bf16, the weight bandwidth, and the largest difference from the
dequantized weight through F.linear. Each timed call takes the next of several copies of the
weights, at least 256 MB in all, so that they come from DRAM as a model's layers do, not from L2
(which holds a small projection whole); --warm-l2 times one copy again and again. --paths also times each path (the GEMV, the tensor-core
kernel, dequantize + cuBLAS) at its config for that shape and row count. --sweep also times a set of tile configs per row bucket;
--write-configs merges the fastest per (shape, bucket) into the table the kernel reads for this
GPU model. Then the load-time repacking of one layer's projections (AWQ and GPTQ act-order
checkpoint tensors -> the kernel's layout, through backend/layers/int4.py). Prints tables,
writes JSON.

    python3 benchmarks/kernels/w4a16.py --json out.json [--sweep] [--write-configs kernels/configs/w4a16.json]
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, wait
from multiprocessing import get_context

import torch
import triton.testing

from tritium import kernels
from fp8_matmul import linear_shapes
from tritium.kernels.reference import w4a16_dequantize_ref
from tritium.kernels.w4a16 import DEFAULT_CONFIGS, METHODS, W4A16Config, choose_config, config_key, row_bucket

ROWS = (1, 8, 16, 64, 256, 512, 4096)
GROUP = 128
SWEEP = {  # row bucket -> configs tried besides the default
    # The GEMV at one, two and four 4-byte words a thread (block_n / (8 * 32 * num_warps)): more
    # words share each row's activation but leave fewer warps; K slices of auto (about eight
    # warps an SM) or 32, their partial sums added in PyTorch or in the kernel; tiles loaded one
    # or (up to two words a thread: registers) two steps ahead. num_stages does nothing there.
    1: [W4A16Config(1, bn, bk, split, 1, w, 1, method="gemv", fused_reduce=fused, prefetch=ahead)
        for bn, bk, w in ((256, 16, 1), (512, 32, 2), (1024, 32, 4), (512, 16, 1), (1024, 16, 2),
                          (1024, 16, 1), (2048, 16, 2), (4096, 16, 4))
        for split, ahead in ((0, 1), (32, 1), (0, 2)) if ahead == 1 or bn // w <= 512
        for fused in (False, True)]
       + [W4A16Config(16, 64, 128, 0, 1, 4, 4)],
    16: [W4A16Config(16, bn, bk, 0, 1, w, st) for bn, bk, w, st in
         itertools.product((32, 64, 128), (64, 128), (4,), (3, 4, 5))]
        + [W4A16Config(1, 1024, 32, 0, 1, 4, 1, method="gemv")],
    # 2-8 rows: the 16-row bucket's tiles and the GEMV of several rows a program
    # (kernels/w4a16_gemv_rows.py: one warp, whose registers hold 2-8 rows of sums).
    8: [W4A16Config(16, bn, bk, 0, 1, w, st) for bn, bk, w, st in
        itertools.product((32, 64, 128), (64, 128), (4,), (3, 4, 5))]
       + [W4A16Config(bm, bn, 16, split, 1, 1, 1, method="gemv")
          for bm, bn in ((2, 512), (4, 256), (4, 512), (8, 256)) for split in (0, 16)],
    64: [W4A16Config(bm, bn, bk, 0, 8, 4, st) for bm, bn, bk, st in
         itertools.product((32, 64), (64, 128), (64, 128), (3, 4))],
    256: [W4A16Config(bm, bn, bk, 0, 8, w, st) for bm, bn, bk, w, st in
          itertools.product((64, 128), (128, 256), (64, 128), (4, 8), (3, 4))],
    0: [W4A16Config(bm, bn, bk, 1, 8, w, st) for bm, bn, bk, w, st in
        itertools.product((128,), (128, 256), (64, 128), (4, 8), (3, 4))],
    1024: [],  # the swapped kernel's tiles below, against dequantize-then-cuBLAS
}
SWEEP[64].append(W4A16Config(64, 128, 64, 0, 8, 4, 4, method="dequant"))
# --paths: each path's config where the engine's choice for that row count is another path.
PATH_DEFAULTS = {
    "gemv": {b: W4A16Config(4, 512, 16, 0, 1, 1, 1, method="gemv") if b in (8, 16) else DEFAULT_CONFIGS[1]
             for b in DEFAULT_CONFIGS},
    "mma": {1: DEFAULT_CONFIGS[16], 8: DEFAULT_CONFIGS[16], 16: DEFAULT_CONFIGS[16], 64: DEFAULT_CONFIGS[64],
            256: W4A16Config(64, 128, 64, 0, 8, 4, 4), 1024: W4A16Config(128, 128, 64, 1, 8, 8, 3),
            0: W4A16Config(128, 128, 64, 1, 8, 8, 3)},
    "dequant": {b: W4A16Config(64, 128, 64, 0, 8, 4, 4, method="dequant") for b in DEFAULT_CONFIGS},
}


def path_configs(m: int, n: int, k: int) -> dict[str, W4A16Config]:
    """Each path's config at this shape: the engine's choice for its own path, else the path's default."""
    chosen = choose_config(m, n, k, 4, GROUP, torch.device("cuda"))
    return {p: chosen if chosen.method == p else PATH_DEFAULTS[p][row_bucket(m)] for p in METHODS}
SWEEP[256].append(W4A16Config(64, 128, 64, 0, 8, 4, 4))  # the tensor-core kernel, now not the default
# All 256 rows in one tile, so that each weight is widened once (sm_90 builds without spills).
SWEEP[256] += [W4A16Config(256, bn, 64, 0, 8, 8, 3) for bn in (64, 128)]
# The weight as the MMA's first operand (swap_ab): the widened tile goes from registers into
# wgmma. Tiles of (activation rows, columns, warps) whose float32 sums fit the registers (a
# warpgroup takes 64 columns a wgmma), K steps of 64 and 128, automatic or no K slices (at 256
# rows a K slice's float32 partials are large: 128 x 64 tiles fill the card at N = 4096 without).
SWAPPED = {
    1: [(16, 64, 4), (16, 128, 8)],  # against the GEMV: the tensor cores take the FMAs, the widening stays
    8: [(16, 64, 4), (16, 128, 4), (16, 128, 8)], 16: [(16, 64, 4), (16, 128, 4), (16, 128, 8)],
    64: [(64, 64, 4), (64, 128, 4), (64, 128, 8), (32, 128, 4)],
    256: [(256, 128, 8), (256, 64, 4), (128, 128, 4), (128, 128, 8), (128, 256, 8), (128, 64, 4)],
    1024: [(256, 128, 8), (128, 128, 8), (128, 256, 8), (256, 64, 4)],
    0: [(256, 128, 8), (128, 128, 8), (128, 256, 8)],
}
for _bucket, _tiles in SWAPPED.items():
    SWEEP[_bucket] += [W4A16Config(bm, bn, bk, split, 8, w, st, swap_ab=True)
                       for bm, bn, w in _tiles for bk in (64, 128) for st in (3, 4)
                       for split in ((0, 1) if _bucket == 256 else (0,))]


def time_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1000


def random_layer(n: int, k: int):
    """Random 4-bit words, fp16 scales ~1e-3 and zeros 0..15: the kernel's layout."""
    qweight = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device="cuda")
    scales = (torch.rand(k // GROUP, n, device="cuda") * 1e-3 + 1e-3).half()
    zeros = torch.randint(0, 16, (k // GROUP, n), device="cuda").half()
    return qweight, scales, zeros


COLD_BYTES = 256e6  # more than any GPU's L2


def cycling(make, nbytes: int, warm: bool):
    """A function returning the next of enough copies from make() to exceed L2 (one if warm)."""
    copies = [make() for _ in range(1 if warm else max(1, math.ceil(COLD_BYTES / nbytes)))]
    return itertools.cycle(copies).__next__


def cfg_name(c: W4A16Config) -> str:
    return (f"{c.method} m{c.block_m} n{c.block_n} k{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}"
            + (" fused" if c.fused_reduce else "") + (f" prefetch{c.prefetch}" if c.prefetch > 1 else "")
            + (" swap" if c.swap_ab else ""))


def _warm(job: tuple) -> str | None:
    """Compile one config at one shape by running it once (Triton's disk cache keeps the binary
    for the main process); an error is returned, and reported again when the config is timed."""
    n, k, m, cfg = job
    try:
        qweight, scales, zeros = random_layer(n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        kernels.w4a16_matmul.triton(x, qweight, scales, zeros, GROUP, config=cfg)
        torch.cuda.synchronize()
        return None
    except Exception as exc:
        return f"{n}x{k} m{m} {cfg_name(cfg)}: {type(exc).__name__}: {exc}"


def warm_compile(shapes: dict, rows: tuple[int, ...], jobs: int, sweep: bool, paths: bool,
                 limit_s: float) -> set:
    """The sweep's and the paths' compiles, several processes at once: inline they take most of
    a sweep's time. Returns the (n, k, m, config) runs that failed or did not finish within
    limit_s (a kernel that never returns would stop the whole sweep), which are not timed."""
    work = [(n, k, m, cfg) for n, k in shapes.values() for m in rows
            for cfg in ([DEFAULT_CONFIGS[row_bucket(m)], *SWEEP[row_bucket(m)]] if sweep else [])
            + (list(path_configs(m, n, k).values()) if paths else [])]
    start = time.time()
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"))
    futures = {pool.submit(_warm, job): job for job in work}
    done, pending = wait(futures, timeout=limit_s)
    bad = {futures[f] for f in pending}
    errors = [f"{futures[f][0]}x{futures[f][1]} m{futures[f][2]} {cfg_name(futures[f][3])}: "
              f"did not finish in {limit_s:.0f} s" for f in pending]
    for f in done:
        if f.result():
            bad.add(futures[f])
            errors.append(f.result())
    if pending:  # the workers stuck in a kernel are ended, not waited for
        for proc in list(pool._processes.values()):
            proc.kill()
    pool.shutdown(wait=not pending, cancel_futures=True)
    print(f"compiled {len(work)} config runs in {time.time() - start:.1f} s with {jobs} processes"
          + "".join(f"\n  warm-up failed: {e[:200]}" for e in errors), flush=True)
    return bad


def bench_matmuls(shapes: dict, sweep: bool, rows: tuple[int, ...] = ROWS, paths: bool = False,
                  warm_l2: bool = False, after_layer: Callable[[dict], None] | None = None,
                  skip: frozenset = frozenset()) -> tuple[list, dict]:
    """Each shape at each row count; after_layer gets the best configs so far after each shape,
    so that a sweep cut short by a time limit still leaves the shapes it finished. The
    (n, k, m, config) runs in skip (failed or hung when compiled) are left out."""
    results, best = [], {}
    print(f"{'layer':8} {'N x K':>13} {'M':>5} {'bf16 us':>8} {'w4a16 us':>9} {'speedup':>8} "
          f"{'wt GB/s':>8} {'rel diff':>9}" + "".join(f" {p + ' us':>10}" for p in METHODS if paths)
          + ("  best (sweep)" if sweep else ""))
    for layer, (n, k) in shapes.items():
        next_w16 = cycling(lambda: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, 2 * n * k, warm_l2)
        qweight, scales, zeros = random_layer(n, k)
        wdq = w4a16_dequantize_ref(qweight, scales, zeros, GROUP, dtype=torch.bfloat16)
        weight_bytes = qweight.numel() * 4 + scales.numel() * 2 + zeros.numel() * 2
        next_q = cycling(lambda: random_layer(n, k), weight_bytes, warm_l2)

        def w4(x, cfg=None):
            return kernels.w4a16_matmul.triton(x, *next_q(), GROUP, config=cfg)

        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t16 = time_us(lambda: torch.nn.functional.linear(x, next_w16()))
            ref = torch.nn.functional.linear(x, wdq).float()
            out = kernels.w4a16_matmul.triton(x, qweight, scales, zeros, GROUP).float()
            diff = ((out - ref).abs().max() / ref.abs().max()).item()
            t = time_us(lambda: w4(x))
            row = {"layer": layer, "n": n, "k": k, "rows": m, "bf16_us": t16, "w4a16_us": t,
                   "speedup": t16 / t, "weight_gb_s": weight_bytes / t / 1e3,
                   "max_rel_diff": diff, "bucket": row_bucket(m)}
            line = (f"{layer:8} {n:>5} x {k:<5} {m:>5} {t16:8.1f} {t:9.1f} {t16 / t:7.2f}x "
                    f"{weight_bytes / t / 1e3:8.0f} {diff:9.2e}")
            if paths:
                row["paths"] = {}
                for p, cfg in path_configs(m, n, k).items():
                    if (n, k, m, cfg) in skip:
                        line += f" {'failed':>10}"
                        continue
                    got = kernels.w4a16_matmul.triton(x, qweight, scales, zeros, GROUP, config=cfg).float()
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    tp = time_us(lambda: w4(x, cfg))
                    row["paths"][p] = {"us": tp, "speedup": t16 / tp, "max_rel_diff": err, "config": vars(cfg)}
                    line += f" {tp:10.1f}"
            if sweep:
                timed = [(t, DEFAULT_CONFIGS[row_bucket(m)])]
                for cfg in (c for c in SWEEP[row_bucket(m)] if c != DEFAULT_CONFIGS[row_bucket(m)]):
                    if (n, k, m, cfg) in skip:
                        continue
                    try:
                        # Each config is checked as the default is before it is timed: a wrong
                        # result (a race, say) is reported and never chosen.
                        got = kernels.w4a16_matmul.triton(x, qweight, scales, zeros, GROUP, config=cfg).float()
                        err = ((got - ref).abs().max() / ref.abs().max()).item()
                        if not err <= max(2 * diff, 1e-2):
                            print(f"  WRONG {cfg_name(cfg)}: max rel diff {err:.3g}")
                            continue
                        timed.append((time_us(lambda: w4(x, cfg)), cfg))
                    except Exception as e:  # a config that does not fit (shared memory)
                        print(f"  skip {cfg_name(cfg)}: {type(e).__name__}")
                tb, cb = min(timed, key=lambda r: r[0])
                row.update(best_us=tb, best_config=vars(cb), best_speedup=t16 / tb,
                           swept={cfg_name(c): round(tc, 2) for tc, c in timed})
                key = config_key(n, k, 4, GROUP, row_bucket(m))
                if key not in best or tb / t16 < best[key][0]:
                    best[key] = (tb / t16, cb)
                line += f"  {tb:7.1f} ({t16 / tb:.2f}x) {cfg_name(cb)}"
            print(line, flush=True)
            results.append(row)
        if after_layer and best:
            after_layer({key: cfg for key, (_, cfg) in best.items()})
    return results, {key: cfg for key, (_, cfg) in best.items()}


def bench_repacking(shapes: dict, device: str = "cuda") -> list:
    """One Llama-3-8B layer's projections from checkpoint tensors to the kernel's layout, through
    the engine's loading path (checkpoint_rows, weight_loader, process_weights_after_loading)."""
    from tritium.layers.int4 import Int4Config, Int4LinearMethod
    from tritium.layers.linear import ReplicatedLinear
    rows = []
    for fmt, declared in (("awq", {"bits": 4, "group_size": GROUP}),
                          ("gptq", {"bits": 4, "group_size": GROUP, "desc_act": True})):
        total = 0.0
        for layer_name, (n, k) in shapes.items():
            method = Int4LinearMethod(Int4Config.from_config(fmt, declared))
            with torch.device(device):
                layer = ReplicatedLinear(k, n, linear_method=method)
            ckpt = {"qweight": torch.randint(-2**31, 2**31 - 1, (k, n // 8) if fmt == "awq" else (k // 8, n),
                                             dtype=torch.int32, device=device),
                    "qzeros": torch.randint(-2**31, 2**31 - 1, (k // GROUP, n // 8), dtype=torch.int32,
                                            device=device),
                    "scales": torch.rand(k // GROUP, n, device=device).half()}
            if fmt == "gptq":
                ckpt["g_idx"] = (torch.randperm(k, device=device) // GROUP).to(torch.int32)
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            sync()
            start = time.perf_counter()
            for name, t in ckpt.items():
                param = getattr(layer, name)
                to_rows = getattr(param, "checkpoint_rows", None)
                param.weight_loader(param, to_rows(name, t) if to_rows else t)
            method.process_weights_after_loading(layer)
            sync()
            ms = (time.perf_counter() - start) * 1e3
            total += ms
            rows.append({"format": fmt, "layer": layer_name, "n": n, "k": k, "ms": ms})
            print(f"repack {fmt:4} {layer_name:8} {n:>5} x {k:<5} {ms:8.2f} ms")
        print(f"repack {fmt:4} one layer {total:.1f} ms; 32 layers ~{total * 32 / 1e3:.2f} s")
    return rows


def write_configs(path: str, gpu: str, best: dict) -> None:
    table = {"configs": {}}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    table.setdefault("configs", {}).setdefault(gpu, {}).update({k: vars(c) for k, c in best.items()})
    table.setdefault("provenance", {})[gpu] = (
        f"{datetime.date.today().isoformat()} sweep by benchmarks/kernels/w4a16.py --write-configs: "
        "the fastest config for each weight shape and row bucket")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--json")
    ap.add_argument("--sweep", action="store_true", help="also time the configs of SWEEP")
    ap.add_argument("--paths", action="store_true", help="also time each path (gemv, mma, dequant)")
    ap.add_argument("--warm-l2", action="store_true", help="time one copy of the weights again and again")
    ap.add_argument("--write-configs", metavar="PATH", help="with --sweep: merge the fastest configs here")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="the M values (default: all six)")
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                    help="with --sweep or --paths: processes compiling the configs first (0: compile as they are timed)")
    ap.add_argument("--compile-limit", type=float, default=100,
                    help="seconds for all the compiles; a run still going then is reported and not timed")
    ap.add_argument("--repack-only-on", metavar="DEVICE", help="only time the repacking, on DEVICE (cpu works)")
    a = ap.parse_args()
    torch.manual_seed(0)
    shapes = linear_shapes(a.model)
    if a.repack_only_on:
        bench_repacking(shapes, a.repack_only_on)
        return
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}; {a.model}; 4-bit weights, groups of {GROUP}, bf16 activations; "
          + ("one copy of the weights (warm in L2)" if a.warm_l2 else "weights from DRAM (copies cycled)"))
    rows = tuple(int(r) for r in a.rows.split(","))
    skip = (warm_compile(shapes, rows, a.jobs, a.sweep, a.paths, a.compile_limit)
            if (a.sweep or a.paths) and a.jobs > 0 else set())
    save = (lambda best: write_configs(a.write_configs, gpu, best)) if a.write_configs else None
    results, best = bench_matmuls(shapes, a.sweep, rows, a.paths, a.warm_l2, after_layer=save, skip=frozenset(skip))
    repack = [] if a.no_repack else bench_repacking(shapes)
    if save and best:
        print(f"wrote {len(best)} configs for {gpu} to {a.write_configs}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"gpu": gpu, "model": a.model, "group_size": GROUP, "results": results,
                       "weights": "one copy, warm in L2" if a.warm_l2 else f"copies cycled, >= {COLD_BYTES:.0f} bytes",
                       "repack_ms": repack, "chosen": {k: vars(c) for k, c in best.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
