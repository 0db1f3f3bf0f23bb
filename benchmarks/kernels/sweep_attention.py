#!/usr/bin/env python3
"""Sweep the attention kernels' launch configs at the shapes the engine actually runs (GPU only).

kernel_table.py measures square cases (uniform contexts, one 4k prompt); a serving step is
different: workload A's decode steps are 256 sequences of ~520-770 tokens, its prefill steps are
16 prompts of 512 tokens packed in one call. This prints, per case, every config's time and
bandwidth (decode) or TFLOP/s (prefill), best first, and writes JSON with --out.
--kv-cache-dtype fp8 sweeps the same cases over an FP8 cache (bandwidth counts its bytes);
--decode-cases / --prefill-cases pick cases (B:LO:HI and P:LEN, comma-separated; "" for none)
and --small sweeps 12 decode configs instead of 36, without the unsplit variants. --chunk-kv
cache,direct,tma times prefill also with the chunk's keys and values passed (plain loads, TMA).

    python3 benchmarks/kernels/sweep_attention.py --out $OUT/sweep.json
    python3 benchmarks/kernels/sweep_attention.py --kv-cache-dtype fp8 --small --decode-cases 256:512:768 \
        --prefill-cases 16:512 --jobs 0
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import kernel_table as bk
from tritium import kernels
from tritium.kernels import reference
from tritium.kernels.decode_attention import DecodeConfig
from tritium.kernels.prefill_attention import PrefillConfig
from tritium.kernels.prefill_attention import default_config as default_prefill_config

DECODE_CASES = [(256, 512, 768), (256, 1024, 1024), (64, 4096, 4096), (1, 640, 640), (1, 32768, 32768)]
PREFILL_CASES = [(16, 512), (2, 4096)]  # (prompts, tokens each), packed in one call
PREFILL_SWEEP = bk.PREFILL_SWEEP + [PrefillConfig(*c) for c in [
    (64, 64, 4, 2), (64, 32, 4, 3), (64, 64, 8, 3), (128, 64, 4, 2), (128, 128, 8, 4)]]


SMALL_DECODE_SWEEP = [DecodeConfig(block_n=n, num_warps=w, num_stages=st)
                      for n in (64, 128) for w in (4, 8) for st in (2, 3, 4)]
FP8_PREFILL_SWEEP = [PrefillConfig(*c) for c in [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3),
                                                 (128, 64, 4, 2), (128, 64, 8, 3)]]


def fp8_variants(configs):
    """Each config with the FP8 tiles widened to float16 and to the query's dtype (bf16)."""
    return [c.__class__(**{**c.__dict__, "fp8_compute": f}) for c in configs for f in ("float16", "query")]


def _caches(shape, fp8: bool):
    """Random K and V caches; FP8 ones hold the rounded values (scale 1.0), V transposed per
    block as the engine keeps it."""
    k = torch.randn(*shape, device="cuda", dtype=bk.DT)
    v = torch.randn_like(k)
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.permute(0, 2, 3, 1).contiguous().to(torch.float8_e4m3fn)
    return k, v


def _ref_caches(k, v):
    """float32 caches in the reference's 16-bit layout (V token-major again)."""
    if k.dtype == torch.float8_e4m3fn:
        return k.float(), v.float().permute(0, 3, 1, 2).contiguous()
    return k.float(), v.float()


def decode_case(b: bk.Bench, batch: int, lo: int, hi: int, copy_gbps: float, fp8: bool = False,
                sweep=None, both_fp8_computes: bool = True, max_context: int | None = None) -> dict:
    """max_context: the bound the split choice sees (the engine's decode graphs pass their
    context bucket, 4096 or max_model_len, not the batch's longest context)."""
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(lo, hi + 1, (batch,), generator=g)
    width = max(int(ctx.max()), max_context or 0) // bk.BS + 1
    k_cache, v_cache = _caches((batch * width, bk.BS, bk.HKV, bk.D), fp8)
    tables = torch.randperm(batch * width, device="cuda").view(batch, width).int()
    lens = ctx.to(device="cuda", dtype=torch.int32)
    q = torch.randn(batch, bk.HQ, bk.D, device="cuda", dtype=bk.DT)
    ref = reference.paged_decode_attention_ref(q.float(), *_ref_caches(k_cache, v_cache), tables,
                                               lens, bk.SCALE)
    kv_bytes = int(ctx.sum()) * 2 * bk.HKV * bk.D * k_cache.element_size()
    rows = []
    configs = sweep if sweep is not None else [DecodeConfig(**{**c.__dict__, "num_splits": s})
                                               for c in bk.DECODE_SWEEP for s in (None, 1)]
    if fp8 and both_fp8_computes:
        configs = fp8_variants(configs)
    for cfg in [None] + configs:
        fn = lambda cfg=cfg: kernels.paged_decode_attention.triton(  # noqa: E731
            q, k_cache, v_cache, tables, lens, bk.SCALE, config=cfg,
            max_context_len=max_context or int(ctx.max()))
        r = b.checked(f"{cfg or 'default'}", fn, lambda out: bk.rel_err(out, ref))
        if "ms" in r:
            r["GBps"] = kv_bytes / r["ms"] / 1e6
            r["frac_copy_bw"] = r["GBps"] / copy_gbps
        rows.append(r)
    return {"batch": batch, "context": [lo, hi], "kv_bytes": kv_bytes, "fp8": fp8, "rows": rows}


def _chunk_kv(k_cache, v_cache, tables, length: int):
    """The prompts' keys and values as the engine passes them with the chunk: strided views into
    a fused [T, (Hq + 2 Hkv) * D] projection output, equal to what the cache holds."""
    prompts = tables.shape[0]
    pos = torch.arange(length, device="cuda")
    slots = (tables.long()[:, pos // bk.BS] * bk.BS + pos % bk.BS).reshape(-1)
    qkv = torch.empty(prompts * length, (bk.HQ + 2 * bk.HKV) * bk.D, device="cuda", dtype=bk.DT)
    key = qkv[:, bk.HQ * bk.D:(bk.HQ + bk.HKV) * bk.D].view(-1, bk.HKV, bk.D)
    value = qkv[:, (bk.HQ + bk.HKV) * bk.D:].view(-1, bk.HKV, bk.D)
    key.copy_(k_cache.view(-1, bk.HKV, bk.D)[slots])
    value.copy_(v_cache.view(-1, bk.HKV, bk.D)[slots])
    return key, value


def prefill_case(b: bk.Bench, prompts: int, length: int, fp8: bool = False,
                 chunk_modes: tuple[str, ...] = ("cache",)) -> dict:
    """chunk_modes: "cache" reads every key through the block table; "direct" / "tma" pass the
    chunk's keys and values (16-bit caches), read with plain loads / TMA descriptors."""
    t = prompts * length
    blocks = length // bk.BS
    k_cache, v_cache = _caches((prompts * blocks, bk.BS, bk.HKV, bk.D), fp8)
    tables = torch.randperm(prompts * blocks, device="cuda").view(prompts, blocks).int()
    cu = torch.arange(0, t + 1, length, device="cuda", dtype=torch.int32)
    lens = torch.full((prompts,), length, device="cuda", dtype=torch.int32)
    q = torch.randn(t, bk.HQ, bk.D, device="cuda", dtype=bk.DT)
    ref = reference.paged_prefill_attention_ref(q.float(), *_ref_caches(k_cache, v_cache), tables,
                                                cu, lens, length, bk.SCALE)
    flops = prompts * 4 * bk.HQ * bk.D * length * (length + 1) / 2
    key, value = (None, None) if fp8 else _chunk_kv(k_cache, v_cache, tables, length)
    variants = []
    for cfg in [None] + (fp8_variants(FP8_PREFILL_SWEEP) if fp8 else PREFILL_SWEEP):
        for mode in ("cache",) if fp8 else chunk_modes:
            if mode == "cache":
                variants.append((f"{cfg or 'default'}", cfg, {}))
            else:
                base = cfg or default_prefill_config(bk.DT, bk.D, length, mode == "tma")
                chunk_cfg = PrefillConfig(**{**base.__dict__, "kv_tma": mode == "tma"})
                variants.append((f"{mode} {chunk_cfg}", chunk_cfg, {"key": key, "value": value}))
    rows = []
    for label, cfg, chunk in variants:
        fn = lambda cfg=cfg, chunk=chunk: kernels.paged_prefill_attention.triton(  # noqa: E731
            q, k_cache, v_cache, tables, cu, lens, length, bk.SCALE, config=cfg, **chunk)
        r = b.checked(label, fn, lambda out: bk.rel_err(out, ref))
        if "ms" in r:
            r["TFLOPs"] = flops / r["ms"] / 1e9
        rows.append(r)
    return {"prompts": prompts, "length": length, "flops": flops, "fp8": fp8, "rows": rows}


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


def _cases(text: str | None, default: list) -> list:
    """"256:512:768,1:32768:32768" -> [(256, 512, 768), (1, 32768, 32768)]; None -> default."""
    if text is None:
        return default
    return [tuple(int(x) for x in item.split(":")) for item in text.split(",") if item]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    ap.add_argument("--decode-cases", help="B:LO:HI,... (default: the engine's five)")
    ap.add_argument("--prefill-cases", help="PROMPTS:LEN,... (default: 16:512,2:4096)")
    ap.add_argument("--small", action="store_true", help="12 decode configs, splits chosen")
    ap.add_argument("--decode-configs",
                    help="BN:WARPS:STAGES[:SPLITS],... instead of the decode sweep (splits "
                         "chosen unless given)")
    ap.add_argument("--decode-max-context", type=int,
                    help="the context bound decode's split choice sees (the engine's graph bucket)")
    ap.add_argument("--no-graphs", action="store_true",
                    help="time with do_bench through the Python wrapper (before 2026-12-01 06:10 UTC: "
                         "its host time inflated small cases) instead of CUDA graph replays")
    ap.add_argument("--prefill-configs",
                    help="BM:BN:WARPS:STAGES,... instead of the prefill sweep's 17 configs")
    ap.add_argument("--chunk-kv", default="cache",
                    help="prefill: comma-separated modes among cache, direct, tma (16-bit caches)")
    a = ap.parse_args()
    fp8 = a.kv_cache_dtype == "fp8"
    decode_cases = _cases(a.decode_cases, DECODE_CASES)
    prefill_cases = _cases(a.prefill_cases, PREFILL_CASES)
    start = time.time()
    global PREFILL_SWEEP
    decode_sweep = SMALL_DECODE_SWEEP if a.small else None
    if a.decode_configs:
        decode_sweep = [DecodeConfig(block_n=c[0], num_warps=c[1], num_stages=c[2],
                                     num_splits=c[3] if len(c) > 3 else None)
                        for c in _cases(a.decode_configs, [])]
    if a.prefill_configs:
        PREFILL_SWEEP = [PrefillConfig(*c) for c in _cases(a.prefill_configs, [])]
    bk.PREFILL_SWEEP = PREFILL_SWEEP
    if a.jobs:
        bk.warm_compile(a.jobs, quick=False)
    b = bk.Bench(quick=True, graphs=not a.no_graphs)
    ceil = bk.measure_ceilings(b)
    res = {"ceilings": ceil, "kv_cache_dtype": a.kv_cache_dtype, "decode": [], "prefill": []}
    tag = " fp8 cache" if fp8 else ""
    for batch, lo, hi in decode_cases:
        d = decode_case(b, batch, lo, hi, ceil["copy_GBps"], fp8, decode_sweep,
                        both_fp8_computes=not a.decode_configs, max_context=a.decode_max_context)
        res["decode"].append(d)
        show(f"decode{tag} {batch} x [{lo}, {hi}]  (GB/s)", d["rows"], "GBps")
        torch.cuda.empty_cache()
    for prompts, length in prefill_cases:
        p = prefill_case(b, prompts, length, fp8, tuple(a.chunk_kv.split(",")))
        res["prefill"].append(p)
        show(f"prefill{tag} {prompts} x {length} packed (TFLOP/s)", p["rows"], "TFLOPs")
        torch.cuda.empty_cache()
    res["seconds"] = time.time() - start
    print(f"\nceilings {ceil}; {res['seconds']:.0f} s")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
