#!/usr/bin/env python3
"""Sweep the attention kernels' launch configs at the shapes the engine actually runs (GPU only).

bench_kernels.py measures square cases (uniform contexts, one 4k prompt); a serving step is
different: workload A's decode steps are 256 sequences of ~520-770 tokens, its prefill steps are
16 prompts of 512 tokens packed in one call. This prints, per case, every config's time and
bandwidth (decode) or TFLOP/s (prefill), best first, and writes JSON with --out.

    python3 scripts/sweep_attention.py --out $OUT/sweep.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import bench_kernels as bk  # noqa: E402
import kernels  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.decode_attention import DecodeConfig  # noqa: E402
from kernels.prefill_attention import PrefillConfig  # noqa: E402

DECODE_CASES = [(256, 512, 768), (256, 1024, 1024), (64, 4096, 4096), (1, 640, 640), (1, 32768, 32768)]
PREFILL_CASES = [(16, 512), (2, 4096)]  # (prompts, tokens each), packed in one call
PREFILL_SWEEP = bk.PREFILL_SWEEP + [PrefillConfig(*c) for c in [
    (64, 64, 4, 2), (64, 32, 4, 3), (64, 64, 8, 3), (128, 64, 4, 2), (128, 128, 8, 4)]]


def decode_case(b: bk.Bench, batch: int, lo: int, hi: int, copy_gbps: float) -> dict:
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(lo, hi + 1, (batch,), generator=g)
    width = int(ctx.max()) // bk.BS + 1
    k_cache = torch.randn(batch * width, bk.BS, bk.HKV, bk.D, device="cuda", dtype=bk.DT)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * width, device="cuda").view(batch, width).int()
    lens = ctx.to(device="cuda", dtype=torch.int32)
    q = torch.randn(batch, bk.HQ, bk.D, device="cuda", dtype=bk.DT)
    ref = reference.paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables,
                                               lens, bk.SCALE)
    kv_bytes = int(ctx.sum()) * 2 * bk.HKV * bk.D * 2
    rows = []
    for cfg in [None] + [DecodeConfig(**{**c.__dict__, "num_splits": s})
                         for c in bk.DECODE_SWEEP for s in (None, 1)]:
        fn = lambda cfg=cfg: kernels.paged_decode_attention(  # noqa: E731
            q, k_cache, v_cache, tables, lens, bk.SCALE, config=cfg, max_context_len=int(ctx.max()))
        r = b.checked(f"{cfg or 'default'}", fn, lambda out: bk.rel_err(out, ref))
        if "ms" in r:
            r["GBps"] = kv_bytes / r["ms"] / 1e6
            r["frac_copy_bw"] = r["GBps"] / copy_gbps
        rows.append(r)
    return {"batch": batch, "context": [lo, hi], "kv_bytes": kv_bytes, "rows": rows}


def prefill_case(b: bk.Bench, prompts: int, length: int) -> dict:
    t = prompts * length
    blocks = length // bk.BS
    k_cache = torch.randn(prompts * blocks, bk.BS, bk.HKV, bk.D, device="cuda", dtype=bk.DT)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(prompts * blocks, device="cuda").view(prompts, blocks).int()
    cu = torch.arange(0, t + 1, length, device="cuda", dtype=torch.int32)
    lens = torch.full((prompts,), length, device="cuda", dtype=torch.int32)
    q = torch.randn(t, bk.HQ, bk.D, device="cuda", dtype=bk.DT)
    ref = reference.paged_prefill_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables,
                                                cu, lens, length, bk.SCALE)
    flops = prompts * 4 * bk.HQ * bk.D * length * (length + 1) / 2
    rows = []
    for cfg in [None] + PREFILL_SWEEP:
        fn = lambda cfg=cfg: kernels.paged_prefill_attention(  # noqa: E731
            q, k_cache, v_cache, tables, cu, lens, length, bk.SCALE, config=cfg)
        r = b.checked(f"{cfg or 'default'}", fn, lambda out: bk.rel_err(out, ref))
        if "ms" in r:
            r["TFLOPs"] = flops / r["ms"] / 1e9
        rows.append(r)
    return {"prompts": prompts, "length": length, "flops": flops, "rows": rows}


def show(title: str, rows: list[dict], key: str) -> None:
    print(f"\n== {title}")
    timed = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    default = next((r for r in rows if r["variant"] == "default" and "ms" in r), None)
    if default:
        print(f"  default {1e3 * default['ms']:8.1f} us  {default[key]:8.1f}")
    for r in timed[:8]:
        print(f"  {1e3 * r['ms']:8.1f} us  {r[key]:8.1f}  {r['variant']}")
    for r in rows:
        if "error" in r:
            print(f"  FAILED {r['variant']}: {r['error'][:150]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--jobs", type=int, default=8)
    a = ap.parse_args()
    start = time.time()
    bk.PREFILL_SWEEP = PREFILL_SWEEP
    if a.jobs:
        bk.warm_compile(a.jobs, quick=False)
    b = bk.Bench(quick=True)
    ceil = bk.measure_ceilings(b)
    res = {"ceilings": ceil, "decode": [], "prefill": []}
    for batch, lo, hi in DECODE_CASES:
        d = decode_case(b, batch, lo, hi, ceil["copy_GBps"])
        res["decode"].append(d)
        show(f"decode {batch} x [{lo}, {hi}]  (GB/s)", d["rows"], "GBps")
        torch.cuda.empty_cache()
    for prompts, length in PREFILL_CASES:
        p = prefill_case(b, prompts, length)
        res["prefill"].append(p)
        show(f"prefill {prompts} x {length} packed (TFLOP/s)", p["rows"], "TFLOPs")
        torch.cuda.empty_cache()
    res["seconds"] = time.time() - start
    print(f"\nceilings {ceil}; {res['seconds']:.0f} s")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
