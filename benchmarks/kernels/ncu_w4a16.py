#!/usr/bin/env python3
"""Launch the W4A16 matmul at one Llama-3-8B projection a few times, for Nsight Compute (GPU only).

The config is the one the engine would pick (kernels/configs/w4a16.json for this GPU, else the
default), or --config. The kernel runs --iters times, so `ncu --launch-skip N --launch-count 1`
profiles a warm launch:

    ncu --clock-control none -k regex:_w4a16 --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python3 benchmarks/kernels/ncu_w4a16.py gate_up
With --time it then prints the kernel's time as a CUDA-graph replay, beside cuBLAS bf16's.
"""
from __future__ import annotations

import argparse
import os

import torch

from tritium import kernels
from fp8_matmul import linear_shapes
from tritium.kernels.w4a16 import W4A16Config, choose_config
from w4a16 import GROUP, cfg_name, random_layer, time_us

BOOL_FIELDS = ("fused_reduce",)


def parse_config(text: str) -> W4A16Config:
    """'method=gemv,block_n=512,...' -> W4A16Config (integers but for method and booleans)."""
    fields: dict = {}
    for item in text.split(","):
        key, value = item.split("=")
        if key == "method":
            fields[key] = value
        elif key in BOOL_FIELDS:
            fields[key] = value.lower() in ("1", "true", "yes")
        else:
            fields[key] = int(value)
    return W4A16Config(**fields)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("layer", choices=["qkv", "o", "gate_up", "down"])
    ap.add_argument("--model", default="llama-3-8b", help="a name under models/configs")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--config", default=None, help="e.g. method=gemv,block_m=1,block_n=512,block_k=16,"
                    "num_warps=1,num_stages=2,fused_reduce=1")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--time", action="store_true", help="then time it and cuBLAS bf16 (graph replays)")
    args = ap.parse_args()
    n, k = linear_shapes(args.model)[args.layer]
    qweight, scales, zeros = random_layer(n, k)
    x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
    config = parse_config(args.config) if args.config else choose_config(args.rows, n, k, 4, GROUP, x.device)

    def fn():
        return kernels.w4a16_matmul.triton(x, qweight, scales, zeros, GROUP, config=config)

    for _ in range(args.iters):  # the launches ncu picks from
        fn()
    torch.cuda.synchronize()
    if args.time:
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        t16 = time_us(lambda: torch.nn.functional.linear(x, w16))
        t = time_us(fn)
        weight_bytes = qweight.numel() * 4 + scales.numel() * 2 + zeros.numel() * 2
        print(f"{args.layer} {n}x{k} M={args.rows} {cfg_name(config)}: {t:.1f} us "
              f"({weight_bytes / t / 1e3:.0f} GB/s of weights), cuBLAS bf16 {t16:.1f} us ({t16 / t:.2f}x)")


if __name__ == "__main__":
    main()
