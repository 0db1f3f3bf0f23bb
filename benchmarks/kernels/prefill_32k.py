#!/usr/bin/env python3
"""Long-prompt prefill attention as the engine runs it against PyTorch SDPA on the whole prompt:
Qwen2.5-7B's heads (28 query, 4 KV, head dim 128, bf16), one prompt of 32,640 tokens (workload
L) in chunks of max_num_batched_tokens (8,192 by default), each chunk attending to the paged
cache (16-token blocks, shuffled) of everything before it and to its own keys and values;
SDPA computes the same causal attention over contiguous K/V in one call, as Hugging Face's
model does. Prints each chunk's time, their sum and SDPA's, the causal TFLOP/s of both, and a
few PrefillConfig choices (--configs); writes JSON.

    python3 benchmarks/kernels/prefill_32k.py --json $OUT/prefill_32k.json
    TRITON_INTERPRET=1 python3 benchmarks/kernels/prefill_32k.py --device cpu --dtype float32 \
        --tokens 80 --chunk 32 --configs 16:16:4:2      # a CPU rehearsal (wall-clock timings)
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

from tritium import kernels
from tritium.kernels.prefill_attention import PrefillConfig

HQ, HKV, D, BS = 28, 4, 128, 16
SCALE = D ** -0.5


def parse_config(text: str) -> PrefillConfig:
    """BLOCK_M:BLOCK_N:WARPS:STAGES[:PREFIX_STAGES]"""
    bm, bn, w, st, *prefix = (int(x) for x in text.split(":"))
    return PrefillConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st, kv_tma=True,
                         prefix_stages=prefix[0] if prefix else 0)


def causal_flops(q_start: int, q_len: int) -> float:
    """QK^T and PV over each query's keys (its position + 1), all heads."""
    keys = q_len * q_start + q_len * (q_len + 1) / 2
    return 4.0 * D * HQ * keys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32640)
    ap.add_argument("--chunk", type=int, default=8192, help="the engine's max_num_batched_tokens")
    ap.add_argument("--configs", default="128:64:4:2,128:64:8:3,128:128:8:2,64:64:4:2",
                    help="BLOCK_M:BLOCK_N:WARPS:STAGES[:PREFIX_STAGES] choices timed besides the default")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.manual_seed(0)
    t, dev, DT = a.tokens, a.device, getattr(torch, a.dtype)
    q = torch.randn(t, HQ, D, device=dev, dtype=DT)
    k = torch.randn(t, HKV, D, device=dev, dtype=DT)
    v = torch.randn(t, HKV, D, device=dev, dtype=DT)
    blocks = -(-t // BS)
    table = torch.randperm(blocks, device=dev).int()
    k_cache = torch.zeros(blocks, BS, HKV, D, device=dev, dtype=DT)
    v_cache = torch.zeros_like(k_cache)
    slots = (table.long()[:, None] * BS + torch.arange(BS, device=dev)).flatten()[:t]
    k_cache.view(-1, HKV, D)[slots] = k
    v_cache.view(-1, HKV, D)[slots] = v
    tables = table[None]

    def chunk_call(start: int, end: int, cfg: PrefillConfig | None):
        n = end - start
        cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
        lens = torch.tensor([end], dtype=torch.int32, device=dev)
        qc, kc, vc = q[start:end], k[start:end], v[start:end]
        return lambda: kernels.paged_prefill_attention.triton(qc, k_cache, v_cache, tables, cu, lens, n, SCALE,
                                                       config=cfg, key=kc, value=vc)

    chunks = [(s, min(s + a.chunk, t)) for s in range(0, t, a.chunk)]
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    sdpa = lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=SCALE,  # noqa: E731
                                                  enable_gqa=True)
    ref = sdpa()[0].transpose(0, 1).float()
    def bench(fn) -> float:
        if dev != "cpu":
            return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    sdpa_ms = bench(sdpa)
    total_flops = causal_flops(0, t)
    gpu = torch.cuda.get_device_name() if dev != "cpu" else "cpu"
    print(f"{gpu}; {t} tokens, chunks of {a.chunk}, {HQ}/{HKV} heads x {D}, {a.dtype}")
    print(f"sdpa causal, whole prompt: {sdpa_ms:8.2f} ms {total_flops / sdpa_ms / 1e9:6.0f} TFLOP/s")
    result = {"device": gpu, "tokens": t, "chunk": a.chunk, "sdpa_ms": sdpa_ms, "variants": []}
    for label, cfg in [("default", None)] + [(c, parse_config(c)) for c in a.configs.split(",") if c]:
        row = {"config": label, "chunks": []}
        try:
            outs = [chunk_call(s, e, cfg)() for s, e in chunks]
            err = ((torch.cat(outs).float() - ref).norm() / ref.norm()).item()
            for s, e in chunks:
                ms = bench(chunk_call(s, e, cfg))
                row["chunks"].append({"start": s, "end": e, "ms": ms,
                                      "tflops": causal_flops(s, e - s) / ms / 1e9})
        except Exception as exc:  # a config that does not fit (shared memory)
            print(f"{label:>14}: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        row.update(ms=sum(c["ms"] for c in row["chunks"]), rel_err=err)
        row["tflops"] = total_flops / row["ms"] / 1e9
        result["variants"].append(row)
        per_chunk = " ".join(f"{c['ms']:.2f}" for c in row["chunks"])
        print(f"{label:>14}: {row['ms']:8.2f} ms {row['tflops']:6.0f} TFLOP/s "
              f"{100 * sdpa_ms / row['ms']:5.0f}% of SDPA  rel err {err:.1e}  chunks {per_chunk} ms")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
