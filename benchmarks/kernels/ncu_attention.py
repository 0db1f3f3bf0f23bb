#!/usr/bin/env python3
"""Launch one attention kernel at workload A's shapes a few times, for Nsight Compute (GPU only).

Cases: decode = 256 sequences of 512-768 tokens (a full decode step's layer), prefill = 16
prompts of 512 tokens packed in one call; each over a bf16 or an FP8 cache (the sweep's inputs,
benchmarks/kernels/sweep_attention.py). The kernel runs --iters times, so `ncu --launch-skip N
--launch-count 1` profiles a warm launch:

    ncu --clock-control none -k regex:_decode_kernel --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python3 benchmarks/kernels/ncu_attention.py fp8_decode
With --time it then prints the kernel's median time (triton.testing.do_bench).
"""
from __future__ import annotations

import argparse

import torch
import triton

import kernel_table as bk
from tritium import kernels
from tritium.kernels.decode_attention import DecodeConfig
from tritium.kernels.prefill_attention import PrefillConfig
from sweep_attention import _caches


def decode_call(fp8: bool, config: DecodeConfig | None, sequential: bool):
    g = torch.Generator().manual_seed(0)
    batch = 256
    ctx = torch.randint(512, 769, (batch,), generator=g)
    width = int(ctx.max()) // bk.BS + 1
    k_cache, v_cache = _caches((batch * width, bk.BS, bk.HKV, bk.D), fp8)
    # sequential: each sequence's blocks adjacent, as a fresh engine allocates them
    order = torch.arange(batch * width, device="cuda") if sequential else torch.randperm(
        batch * width, device="cuda")
    tables = order.view(batch, width).int()
    lens = ctx.to(device="cuda", dtype=torch.int32)
    q = torch.randn(batch, bk.HQ, bk.D, device="cuda", dtype=bk.DT)
    out = torch.empty_like(q)
    max_len = int(ctx.max())
    return lambda: kernels.paged_decode_attention.triton(q, k_cache, v_cache, tables, lens, bk.SCALE, out,
                                                  config=config, max_context_len=max_len)


def prefill_call(fp8: bool, config: PrefillConfig | None, sequential: bool):
    prompts, length = 16, 512
    t, blocks = prompts * length, length // bk.BS
    k_cache, v_cache = _caches((prompts * blocks, bk.BS, bk.HKV, bk.D), fp8)
    order = torch.arange(prompts * blocks, device="cuda") if sequential else torch.randperm(
        prompts * blocks, device="cuda")
    tables = order.view(prompts, blocks).int()
    cu = torch.arange(0, t + 1, length, device="cuda", dtype=torch.int32)
    lens = torch.full((prompts,), length, device="cuda", dtype=torch.int32)
    q = torch.randn(t, bk.HQ, bk.D, device="cuda", dtype=bk.DT)
    out = torch.empty_like(q)
    return lambda: kernels.paged_prefill_attention.triton(q, k_cache, v_cache, tables, cu, lens, length,
                                                   bk.SCALE, out, config=config)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("case", choices=["bf16_decode", "fp8_decode", "bf16_prefill", "fp8_prefill"])
    ap.add_argument("--config", default=None,
                    help="launch config fields, e.g. block_n=256,num_warps=8,num_stages=2")
    ap.add_argument("--sequential", action="store_true", help="blocks in order, not shuffled")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--time", action="store_true", help="then time it (triton do_bench)")
    args = ap.parse_args()
    dtype, kind = args.case.split("_")
    cls = DecodeConfig if kind == "decode" else PrefillConfig
    config = None
    if args.config:
        fields = {}
        for item in args.config.split(","):
            key, value = item.split("=")
            fields[key] = value if key == "fp8_compute" else int(value)
        config = cls(**fields)
    make = decode_call if kind == "decode" else prefill_call
    fn = make(dtype == "fp8", config, args.sequential)
    for _ in range(args.iters):  # the launches ncu picks from
        fn()
    torch.cuda.synchronize()
    if args.time:
        # do_bench queues a cache flush before each launch, so the wrapper's host time is hidden
        us = 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        print(f"{args.case} {config or 'default'}{' sequential' if args.sequential else ''}: "
              f"{us:.1f} us (median)")


if __name__ == "__main__":
    main()
