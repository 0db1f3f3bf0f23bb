#!/usr/bin/env python3
"""Benchmark Tritium's Triton kernels on one GPU against PyTorch, and sweep their launch configs.

From the repository root on the GPU machine:
    python3 benchmarks/kernels/kernel_table.py            # defaults + config sweep (about 2-3 minutes)
    python3 benchmarks/kernels/kernel_table.py --quick    # defaults only
Prints a summary table last and writes every number as JSON to --out (default $OUT/kernels.json
when OUT is set). Each variant is checked against the PyTorch reference before it is timed; a
wrong or failing variant is reported and not timed. Times are triton.testing.do_bench medians,
which flush L2 before every run. Shapes are Llama-3-8B's: 32 query / 8 KV heads, head dim 128,
bf16, block size 16, physical blocks shuffled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import triton

from tritium import kernels
from tritium.kernels import reference
from tritium.kernels.decode_attention import DecodeConfig
from tritium.kernels.prefill_attention import PrefillConfig

DEVICE = "cuda"  # a module global so a CPU dry run (interpreter) can swap it
HQ, HKV, D, BS, DT = 32, 8, 128, 16, torch.bfloat16
SCALE = D ** -0.5
DECODE_CASES = [(1, 32768), (64, 4096), (256, 1024)]  # (batch, context)
PREFILL_T = 4096
TOKENS, HIDDEN, INTER = 8192, 4096, 14336
TOL = 1e-2  # relative error vs the fp32 reference; bf16 output rounding alone is ~2e-3

DECODE_SWEEP = [DecodeConfig(block_n=n, num_warps=w, num_stages=s)
                for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
SPLIT_SWEEP = (1, 2, 4, 8, 16, 32, 64)
PREFILL_SWEEP = [PrefillConfig(*c) for c in [
    (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
    (128, 32, 4, 3), (128, 32, 8, 4), (128, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4),
    (64, 128, 4, 3), (64, 32, 4, 4)]]
SMALL_SWEEP = {"rms_norm": [{"num_warps": w} for w in (4, 8, 16)],
               "apply_rotary_emb": [{"num_warps": w} for w in (1, 2, 4, 8)],
               "silu_and_mul": [{"block": b, "num_warps": w} for b in (1024, 2048) for w in (4, 8)],
               "store_kv_cache": [{"num_warps": w} for w in (1, 2, 4)]}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float("inf") if not torch.isfinite(out).all() else ((out - ref).norm() / ref.norm()).item()


# ---- inputs (also used at small sizes by the compile warm-up) ------------------------------------

def decode_inputs(batch: int, ctx: int):
    blocks = ctx // BS
    k_cache = torch.randn(batch * blocks, BS, HKV, D, device=DEVICE, dtype=DT)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(batch * blocks, device=DEVICE).view(batch, blocks).int()
    context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch, HQ, D, device=DEVICE, dtype=DT)
    return query, k_cache, v_cache, block_tables, context_lens


def prefill_inputs(tokens: int):
    query, k_cache, v_cache, block_tables, context_lens = decode_inputs(1, tokens)
    query = torch.randn(tokens, HQ, D, device=DEVICE, dtype=DT)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=DEVICE)
    return query, k_cache, v_cache, block_tables, cu, context_lens


def small_op_inputs(tokens: int):
    g = lambda *s: torch.randn(*s, device=DEVICE, dtype=DT)  # noqa: E731
    max_pos = 2 * tokens
    freqs = torch.outer(torch.arange(max_pos, device=DEVICE, dtype=torch.float32),
                        1.0 / 500000 ** (torch.arange(0, D, 2, device=DEVICE, dtype=torch.float32) / D))
    slots = torch.randperm(2 * tokens, device=DEVICE)[:tokens]
    return {"x": g(tokens, HIDDEN), "residual": g(tokens, HIDDEN), "weight": g(HIDDEN),
            "q": g(tokens, HQ * D), "k": g(tokens, HKV * D),
            "positions": torch.randint(0, max_pos, (tokens,), device=DEVICE),
            "cos_sin": torch.cat((freqs.cos(), freqs.sin()), dim=-1),
            "gate_up": g(tokens, 2 * INTER), "key": g(tokens, HKV, D), "value": g(tokens, HKV, D),
            "slots": slots, "k_cache": torch.zeros(2 * tokens // BS, BS, HKV, D, device=DEVICE, dtype=DT),
            "v_cache": torch.zeros(2 * tokens // BS, BS, HKV, D, device=DEVICE, dtype=DT)}


def small_op_calls(inp, opts=None):
    """name -> (kernel call, eager PyTorch call, bytes moved) for the fused elementwise ops."""
    o = opts or {}
    t = inp["x"].shape[0]

    def rms_eager():
        h = inp["x"] + inp["residual"]
        hf = h.float()
        return inp["weight"] * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(DT), h

    def rotary_eager():
        cos, sin = inp["cos_sin"][inp["positions"]].chunk(2, dim=-1)
        cos, sin = cos[:, None], sin[:, None]
        for x in (inp["q"], inp["k"]):
            xv = x.view(t, -1, D)
            x1, x2 = xv[..., :D // 2].float(), xv[..., D // 2:].float()
            xv.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))

    def store_eager():
        inp["k_cache"].view(-1, HKV, D)[inp["slots"]] = inp["key"]
        inp["v_cache"].view(-1, HKV, D)[inp["slots"]] = inp["value"]

    e = 2  # bytes per bf16 element
    return {
        "rms_norm": (lambda: kernels.rms_norm.triton(inp["x"], inp["weight"], 1e-5, inp["residual"], **o),
                     rms_eager, 4 * t * HIDDEN * e),
        "apply_rotary_emb": (lambda: kernels.apply_rotary_emb.triton(inp["q"], inp["k"], inp["positions"],
                                                              inp["cos_sin"], **o),
                             rotary_eager, 2 * t * (HQ + HKV) * D * e + t * D * 4),
        "silu_and_mul": (lambda: kernels.silu_and_mul.triton(inp["gate_up"], **o),
                         lambda: F.silu(inp["gate_up"][:, :INTER]) * inp["gate_up"][:, INTER:],
                         3 * t * INTER * e),
        "store_kv_cache": (lambda: kernels.store_kv_cache.triton(inp["key"], inp["value"], inp["k_cache"],
                                                          inp["v_cache"], inp["slots"], **o),
                           store_eager, 4 * t * HKV * D * e + 8 * t),
    }


# ---- compile warm-up: fill Triton's disk cache from several processes at once --------------------

def _warm(job):
    """Compile one variant by running it on a small problem with the same specialisation (all
    strides and sizes divisible by 16) as the benchmark; the main process then loads the binary."""
    kind, cfg = job
    try:
        if kind == "decode":
            q, kc, vc, bt, cl = decode_inputs(2, 512)
            for splits in (1, 2):
                kernels.paged_decode_attention.triton(q, kc, vc, bt, cl, SCALE,
                                               config=DecodeConfig(**{**cfg.__dict__, "num_splits": splits}))
        elif kind == "prefill":
            q, kc, vc, bt, cu, cl = prefill_inputs(256)
            kernels.paged_prefill_attention.triton(q, kc, vc, bt, cu, cl, 256, SCALE, config=cfg)
        else:
            small_op_calls(small_op_inputs(64), cfg)[kind][0]()
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # reported again, with context, when the main process runs it
        return f"{kind} {cfg}: {type(exc).__name__}: {exc}"


def warm_compile(jobs: int, quick: bool) -> None:
    work = [("decode", DecodeConfig()), ("prefill", None)] + [(k, None) for k in SMALL_SWEEP]
    if not quick:
        work += [("decode", c) for c in DECODE_SWEEP] + [("prefill", c) for c in PREFILL_SWEEP]
        work += [(k, o) for k, opts in SMALL_SWEEP.items() for o in opts]
    start = time.time()
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        errors = [e for e in pool.map(_warm, work) if e]
    print(f"compiled {len(work)} variants in {time.time() - start:.1f} s with {jobs} processes"
          + "".join(f"\n  warm-up failed: {e[:200]}" for e in errors), flush=True)


# ---- measurements ----------------------------------------------------------------------------

class Bench:
    """Timings: triton.testing.do_bench medians, or with `graphs` the median replay of a CUDA
    graph of the call, each after an L2 flush. do_bench launches through the kernel's Python
    wrapper, whose host time shows in the timing once
    the kernel takes less than the flush before it; the engine runs decode and small prefills
    in CUDA graphs, so `graphs` is what it sees."""

    def __init__(self, quick: bool, graphs: bool = False) -> None:
        self.warmup, self.rep = (10, 20) if quick else (25, 60)
        self.graphs = graphs
        self._flush = None

    def time_ms(self, fn) -> float:
        if not self.graphs:
            return triton.testing.do_bench(fn, warmup=self.warmup, rep=self.rep, return_mode="median")
        return self._graph_ms(fn)

    def _graph_ms(self, fn, reps: int = 40) -> float:
        if self._flush is None:
            self._flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # compile and allocate outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        times = []
        for i in range(reps + 5):
            self._flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if i >= 5:
                times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    def checked(self, label: str, fn, check) -> dict:
        """Run fn once, check it, then time it. Returns {label, err, ms} or {label, error}."""
        try:
            err = check(fn())
            if not err <= TOL:
                return {"variant": label, "error": f"wrong result: rel err {err:.3g}"}
            return {"variant": label, "rel_err": err, "ms": self.time_ms(fn)}
        except Exception as exc:
            return {"variant": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def measure_ceilings(b: Bench) -> dict:
    # do_bench, not a graph: captured, the copy becomes a memcpy node on the copy engines,
    # which are slower than the copy kernel
    plain = Bench(quick=b.warmup == 10)
    src = torch.randint(0, 255, (2 << 30,), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    copy_ms = plain.time_ms(lambda: dst.copy_(src))
    del src, dst
    a = torch.randn(8192, 8192, device=DEVICE, dtype=DT)
    c = torch.randn(8192, 8192, device=DEVICE, dtype=DT)
    mm_ms = plain.time_ms(lambda: a @ c)
    return {"copy_GBps": 2 * (2 << 30) / copy_ms / 1e6, "bf16_matmul_TFLOPs": 2 * 8192 ** 3 / mm_ms / 1e9}


def bench_decode(b: Bench, batch: int, ctx: int, sweep: bool, copy_gbps: float) -> dict:
    q, kc, vc, bt, cl = decode_inputs(batch, ctx)
    ref = reference.paged_decode_attention_ref(q.float(), kc.float(), vc.float(), bt, cl, SCALE)
    kv_bytes = 2 * batch * ctx * HKV * D * 2
    check = lambda out: rel_err(out, ref)  # noqa: E731
    run = lambda cfg: lambda: kernels.paged_decode_attention.triton(q, kc, vc, bt, cl, SCALE, config=cfg)  # noqa: E731
    rows = [b.checked("triton default", run(None), check)]
    if sweep:
        rows += [b.checked(f"triton {c}", run(c), check) for c in DECODE_SWEEP]
        ok = [r for r in rows[1:] if "ms" in r]
        if ok:
            best = DECODE_SWEEP[rows.index(min(ok, key=lambda r: r["ms"])) - 1]
            for s in SPLIT_SWEEP:
                if ctx // s >= best.block_n:
                    cfg = DecodeConfig(**{**best.__dict__, "num_splits": s})
                    rows.append(b.checked(f"triton {cfg}", run(cfg), check))
    # PyTorch SDPA on contiguous K/V gathered beforehand (not timed).
    k = kc[bt.long()].view(batch, ctx, HKV, D).transpose(1, 2).contiguous()
    v = vc[bt.long()].view(batch, ctx, HKV, D).transpose(1, 2).contiguous()
    q4 = q[:, :, None, :]
    sdpa = lambda: F.scaled_dot_product_attention(q4, k, v, scale=SCALE, enable_gqa=True)  # noqa: E731
    rows.append(b.checked("torch sdpa (contiguous K/V, enable_gqa)", sdpa, lambda o: rel_err(o[:, :, 0], ref)))
    for r in rows:
        if "ms" in r:
            r["GBps"] = kv_bytes / r["ms"] / 1e6
            r["frac_copy_bw"] = r["GBps"] / copy_gbps
    return {"batch": batch, "context": ctx, "kv_bytes": kv_bytes,
            "floor_us": kv_bytes / copy_gbps / 1e3, "rows": rows}


def bench_prefill(b: Bench, sweep: bool, matmul_tflops: float) -> dict:
    t = PREFILL_T
    q, kc, vc, bt, cu, cl = prefill_inputs(t)
    ref = reference.paged_prefill_attention_ref(q.float(), kc.float(), vc.float(), bt, cu, cl, t, SCALE)
    flops = 4 * HQ * D * t * (t + 1) / 2  # causal: only the key/query pairs that are computed
    check = lambda out: rel_err(out, ref)  # noqa: E731
    run = lambda cfg: lambda: kernels.paged_prefill_attention.triton(q, kc, vc, bt, cu, cl, t, SCALE, config=cfg)  # noqa: E731
    rows = [b.checked("triton default", run(None), check)]
    if sweep:
        rows += [b.checked(f"triton {c}", run(c), check) for c in PREFILL_SWEEP]
    k = kc[bt.long()].view(1, t, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, dim=1).contiguous()
    v = vc[bt.long()].view(1, t, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, dim=1).contiguous()
    q4 = q.transpose(0, 1)[None].contiguous()

    def sdpa_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=SCALE)
    rows.append(b.checked("torch sdpa flash (is_causal)", sdpa_flash, lambda o: rel_err(o[0].transpose(0, 1), ref)))
    for r in rows:
        if "ms" in r:
            r["TFLOPs"] = flops / r["ms"] / 1e9
    return {"tokens": t, "flops": flops, "floor_us": flops / matmul_tflops / 1e6, "rows": rows}


def bench_small_ops(b: Bench, sweep: bool, copy_gbps: float) -> list[dict]:
    inp = small_op_inputs(TOKENS)
    q_orig, k_orig = inp["q"].clone(), inp["k"].clone()
    q_ref, k_ref = q_orig.clone(), k_orig.clone()
    reference.apply_rotary_emb_ref(q_ref, k_ref, inp["positions"], inp["cos_sin"])
    rms_ref = reference.rms_norm_ref(inp["x"], inp["weight"], 1e-5, inp["residual"])[0]
    silu_ref = reference.silu_and_mul_ref(inp["gate_up"])
    checks = {
        "rms_norm": lambda out: rel_err(out[0], rms_ref),
        "silu_and_mul": lambda out: rel_err(out, silu_ref),
        # In place: the check sees exactly one application to the original q and k.
        "apply_rotary_emb": lambda _: max(rel_err(inp["q"], q_ref), rel_err(inp["k"], k_ref)),
        "store_kv_cache": lambda _: 0.0 if torch.equal(inp["k_cache"].view(-1, HKV, D)[inp["slots"]],
                                                      inp["key"]) else float("inf"),
    }
    results = []
    for name, check in checks.items():
        rows = []
        for opts in [None] + (SMALL_SWEEP[name] if sweep else []):
            inp["q"].copy_(q_orig)
            inp["k"].copy_(k_orig)
            inp["k_cache"].zero_()
            kernel, _, _ = small_op_calls(inp, opts)[name]
            rows.append(b.checked(f"triton {opts or 'default'}", kernel, check))
        _, eager, nbytes = small_op_calls(inp)[name]
        rows.append({"variant": "torch eager", "ms": b.time_ms(eager)})
        for r in rows:
            if "ms" in r:
                r["GBps"] = nbytes / r["ms"] / 1e6
                r["frac_copy_bw"] = r["GBps"] / copy_gbps
        results.append({"op": name, "tokens": TOKENS, "bytes": nbytes, "rows": rows})
    return results


# ---- report ----------------------------------------------------------------------------------

def _best(rows: list[dict], prefix: str = "triton") -> dict | None:
    timed = [r for r in rows if "ms" in r and r["variant"].startswith(prefix)]
    return min(timed, key=lambda r: r["ms"]) if timed else None


def _fmt(r: dict | None, key: str, unit: str) -> str:
    if r is None:
        return "n/a"
    extra = f" ({100 * r['frac_copy_bw']:.0f}% copy)" if "frac_copy_bw" in r else ""
    return f"{1e3 * r['ms']:8.1f} us {r[key]:7.1f} {unit}{extra}"


def print_summary(res: dict) -> None:
    c = res["ceilings"]
    print("\n=== Tritium kernels on", res["device"], "===")
    print(f"copy {c['copy_GBps']:.0f} GB/s (read+write), bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    print("\ndecode (32/8 heads, d128, bf16, bs16)   floor      triton default              triton best"
          "                 torch sdpa")
    for d in res["decode"]:
        rows = d["rows"]
        print(f"  {d['batch']:>4} x {d['context']:<6} {d['floor_us']:8.1f} us  "
              f"{_fmt(rows[0], 'GBps', 'GB/s'):34s} {_fmt(_best(rows), 'GBps', 'GB/s'):34s} "
              f"{_fmt(_best(rows, 'torch'), 'GBps', 'GB/s')}")
        best = _best(rows)
        if best:
            print(f"      best: {best['variant']}")
    p = res["prefill"]
    rows = p["rows"]
    best, sdpa = _best(rows), _best(rows, "torch")
    ratio = f"{100 * best['TFLOPs'] / sdpa['TFLOPs']:.0f}% of sdpa" if best and sdpa else ""
    print(f"\nprefill causal {p['tokens']} tokens: floor {p['floor_us']:.1f} us")
    print(f"  triton default {_fmt(rows[0], 'TFLOPs', 'TFLOP/s')}\n  triton best    "
          f"{_fmt(best, 'TFLOPs', 'TFLOP/s')} {ratio}\n  torch sdpa     {_fmt(sdpa, 'TFLOPs', 'TFLOP/s')}")
    if best:
        print(f"      best: {best['variant']}")
    print(f"\nfused ops, T={TOKENS}, hidden {HIDDEN} (silu: I={INTER})")
    for op in res["small_ops"]:
        rows = op["rows"]
        print(f"  {op['op']:17s} triton default {_fmt(rows[0], 'GBps', 'GB/s'):34s} best "
              f"{_fmt(_best(rows), 'GBps', 'GB/s'):34s} eager {_fmt(_best(rows, 'torch'), 'GBps', 'GB/s')}")
    print("\ntargets (best triton variant):")
    for d in res["decode"]:
        if (d["batch"], d["context"]) in ((64, 4096), (256, 1024)):
            best = _best(d["rows"])
            frac = best["frac_copy_bw"] if best else 0.0
            print(f"  decode {d['batch']} x {d['context']}: {100 * frac:.0f}% of copy bandwidth "
                  f"(target >= 80%): {'MET' if frac >= 0.8 else 'NOT MET'}")
    if best_p := _best(res["prefill"]["rows"]):
        sdpa_p = _best(res["prefill"]["rows"], "torch")
        frac = best_p["TFLOPs"] / sdpa_p["TFLOPs"] if sdpa_p else float("nan")
        print(f"  prefill: {100 * frac:.0f}% of sdpa flash (target >= 60%): {'MET' if frac >= 0.6 else 'NOT MET'}")
    failed = [(sec, r["variant"], r["error"]) for sec in ("decode", "prefill", "small_ops")
              for group in (res[sec] if isinstance(res[sec], list) else [res[sec]])
              for r in group["rows"] if "error" in r]
    for sec, variant, error in failed:
        print(f"  FAILED {sec} {variant}: {error[:160]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="default configs only, shorter timing")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/kernels.json if OUT is set)")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                    help="processes compiling variants ahead of timing (0: compile inline)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_table.py needs a CUDA GPU")
    out_path = args.out or (os.path.join(os.environ["OUT"], "kernels.json") if os.environ.get("OUT") else None)
    start = time.time()
    sweep = not args.quick
    props = torch.cuda.get_device_properties(0)
    res = {"device": f"{props.name}, {props.multi_processor_count} SMs",
           "versions": {"torch": torch.__version__, "triton": triton.__version__},
           "mode": "quick" if args.quick else "sweep"}
    if args.jobs > 0:
        warm_compile(args.jobs, args.quick)
    b = Bench(args.quick)
    res["ceilings"] = measure_ceilings(b)
    print(f"ceilings: {res['ceilings']}", flush=True)
    res["decode"] = []
    for batch, ctx in DECODE_CASES:
        res["decode"].append(bench_decode(b, batch, ctx, sweep, res["ceilings"]["copy_GBps"]))
        torch.cuda.empty_cache()
        print(f"decode {batch} x {ctx} done ({time.time() - start:.0f} s)", flush=True)
    res["prefill"] = bench_prefill(b, sweep, res["ceilings"]["bf16_matmul_TFLOPs"])
    torch.cuda.empty_cache()
    print(f"prefill done ({time.time() - start:.0f} s)", flush=True)
    res["small_ops"] = bench_small_ops(b, sweep, res["ceilings"]["copy_GBps"])
    res["seconds"] = time.time() - start
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(res, indent=1, default=str))
    print_summary(res)
    print(f"\ntotal {res['seconds']:.0f} s" + (f"; JSON: {out_path}" if out_path else "; no --out/OUT: JSON not written"))


if __name__ == "__main__":
    main()
