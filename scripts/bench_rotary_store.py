"""Rotary then store_kv_cache (two kernels) against apply_rotary_emb storing the keys and values
itself (one kernel), at Llama-3-8B's shapes: 32 query and 8 KV heads of 128, a fused qkv row,
for a decode batch and a prefill step's token counts, a 16-bit and an FP8 cache, and a few warp
counts for the fused kernel. Each variant is captured 20 times in a CUDA graph and replayed
after an L2 flush (bench_kernels.Bench's graph timing); the time per call is the replay's / 20.

    python3 scripts/bench_rotary_store.py [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402
import kernels  # noqa: E402

HQ, HKV, D, BLOCK = 32, 8, 128, 16
CALLS = 20


def time_us(bench: bk.Bench, fn) -> float:
    """Per call: a CUDA graph of CALLS calls, replayed after an L2 flush (bench_kernels.Bench)."""
    return bench.time_ms(lambda: [fn() for _ in range(CALLS)]) * 1000 / CALLS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = "cuda"
    bench = bk.Bench(quick=False, graphs=True)
    cos_sin = torch.randn(8192, D, device=dev)
    rows = []
    for tokens in (1, 256, 8192):
        qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, device=dev).to(torch.bfloat16)
        q, k, v = qkv[:, :HQ * D], qkv[:, HQ * D:(HQ + HKV) * D], qkv[:, (HQ + HKV) * D:]
        positions = torch.randint(0, 8192, (tokens,), device=dev)
        num_blocks = tokens // BLOCK + 2
        slots = torch.arange(tokens, device=dev)
        for cache in ("bf16", "fp8"):
            dt = torch.float8_e4m3fn if cache == "fp8" else torch.bfloat16
            k_cache = torch.zeros(num_blocks, BLOCK, HKV, D, device=dev).to(dt)
            v_shape = (num_blocks, HKV, D, BLOCK) if cache == "fp8" else (num_blocks, BLOCK, HKV, D)
            v_cache = torch.zeros(v_shape, device=dev).to(dt)
            k3, v3 = k.view(tokens, HKV, D), v.view(tokens, HKV, D)

            def apart():
                kernels.apply_rotary_emb(q, k, positions, cos_sin, D)
                kernels.store_kv_cache(k3, v3, k_cache, v_cache, slots, 0.5, 2.0)

            row = {"tokens": tokens, "cache": cache, "two_kernels_us": time_us(bench, apart)}
            for warps in (1, 2, 4, 8):
                row[f"fused_w{warps}_us"] = time_us(
                    bench, lambda warps=warps: kernels.apply_rotary_emb(
                        q, k, positions, cos_sin, D, value=v, k_cache=k_cache, v_cache=v_cache,
                        slot_mapping=slots, k_scale=0.5, v_scale=2.0, num_warps=warps))
            for warps in (1, 2, 8):
                row[f"rotary_only_w{warps}_us"] = time_us(
                    bench, lambda warps=warps: kernels.apply_rotary_emb(q, k, positions, cos_sin, D,
                                                                        num_warps=warps))
            rows.append(row)
            print(" ".join(f"{n}={v:.2f}" if isinstance(v, float) else f"{n}={v}" for n, v in row.items()),
                  flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
