#!/usr/bin/env python3
"""Paged decode at batch 1 x 32k (Llama-3-8B heads) against SDPA on contiguous K/V, over
tile, warp, stage and split choices (splits past the defaults' 64 included), timed as CUDA graph
replays after an L2 flush. With --ncu-config BN:WARPS:STAGES:SPLITS it instead launches that one
config a few times for Nsight Compute to profile.

    python3 benchmarks/kernels/decode_32k.py --json $OUT/decode_32k.json
    ncu --clock-control none -k regex:_decode_kernel -c 1 --section SpeedOfLight \
        python3 benchmarks/kernels/decode_32k.py --ncu-config 128:4:2:64
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from tritium import kernels
import tritium.kernels.reference  # noqa: F401  (binds kernels.reference)
from tritium.kernels.decode_attention import DecodeConfig
import kernel_table as bk

CTX = 32768


def parse(text: str) -> DecodeConfig:
    bn, w, st, sp = (int(x) for x in text.split(":"))
    return DecodeConfig(block_n=bn, num_warps=w, num_stages=st, num_splits=sp)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--ncu-config")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--splits", default="32,64,128,256")
    a = ap.parse_args()
    torch.manual_seed(0)
    q, k_cache, v_cache, tables, lens = bk.decode_inputs(1, CTX)
    call = lambda cfg: kernels.paged_decode_attention.triton(  # noqa: E731
        q, k_cache, v_cache, tables, lens, bk.SCALE, config=cfg, max_context_len=CTX)
    if a.ncu_config:
        for _ in range(3):
            call(parse(a.ncu_config))
        torch.cuda.synchronize()
        return
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    b = bk.Bench(quick=True, graphs=True)
    ceil = bk.measure_ceilings(b)
    ref = kernels.reference.paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(),
                                                       tables, lens, bk.SCALE)
    kv_bytes = CTX * 2 * bk.HKV * bk.D * k_cache.element_size()
    idx = tables[0].long()
    k = k_cache[idx].reshape(CTX, bk.HKV, bk.D).transpose(0, 1).unsqueeze(0).contiguous()
    v = v_cache[idx].reshape(CTX, bk.HKV, bk.D).transpose(0, 1).unsqueeze(0).contiguous()
    q4 = q.unsqueeze(2)
    rows = [b.checked("sdpa contiguous", lambda: F.scaled_dot_product_attention(
        q4, k, v, scale=bk.SCALE, enable_gqa=True), lambda o: bk.rel_err(o[:, :, 0], ref))]
    configs = [None] + [DecodeConfig(block_n=n, num_warps=w, num_stages=st, num_splits=sp)
                        for n, w, st, sp in itertools.product(ints(a.block_n), ints(a.warps),
                                                              ints(a.stages), ints(a.splits))]
    for cfg in configs:
        rows.append(b.checked(str(cfg or "default"), lambda cfg=cfg: call(cfg),
                              lambda o: bk.rel_err(o, ref)))
    for r in rows:
        if "ms" in r:
            r["GBps"] = kv_bytes / r["ms"] / 1e6
    sdpa = rows[0].get("ms")
    timed = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    print(f"ceilings {ceil}; KV {kv_bytes / 1e6:.1f} MB, floor {kv_bytes / ceil['copy_GBps'] / 1e3:.1f} us")
    for r in [rows[0], rows[1]] + timed[:12]:
        if "ms" in r:
            print(f"{1e3 * r['ms']:8.1f} us {r['GBps']:7.0f} GB/s {100 * sdpa / r['ms']:5.0f}% of SDPA  {r['variant']}")
    for r in rows:
        if "error" in r:
            print(f"FAILED {r['variant']}: {r['error'][:160]}")
    if a.json:
        Path(a.json).write_text(json.dumps({"ceilings": ceil, "kv_bytes": kv_bytes, "rows": rows},
                                           indent=1, default=str))


if __name__ == "__main__":
    main()
