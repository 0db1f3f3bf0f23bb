"""FP8 matmul for decode batches on the GPU: our kernel (kernels/fp8_matmul.py) against
torch._scaled_mm (row-wise scales) and a bf16 F.linear, at the linear layers of Llama-3-8B and
Qwen2.5-1.5B for 1, 4 and 16 rows; each timed as a CUDA graph replay (no launch cost), with the
weight bandwidth and the largest difference from _scaled_mm. Prints a table, writes JSON.

    python3 scripts/bench_fp8_matmul.py --json out.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # noqa: E402
from kernels.fp8_matmul import Fp8MatmulConfig  # noqa: E402

SHAPES = {  # name: (N, K)
    "llama qkv": (6144, 4096), "llama o": (4096, 4096), "llama gate_up": (28672, 4096),
    "llama down": (4096, 14336), "qwen1.5b qkv": (2048, 1536), "qwen1.5b gate_up": (17920, 1536),
    "qwen1.5b down": (1536, 8960),
}
CONFIGS = [Fp8MatmulConfig()] + [Fp8MatmulConfig(block_n=bn, block_k=bk, num_stages=st, num_warps=w)
                                 for bn, bk, st, w in itertools.product((32, 64, 128), (128, 256), (3, 5), (4,))]


def time_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows_list = [int(r) for r in a.rows.split(",")]
    results = []
    print(f"{'shape':18} {'M':>3} {'bf16 us':>8} {'scaled_mm us':>12} {'ours us':>8} {'ours GB/s':>9} "
          f"{'best config':40} {'max rel diff':>12}")
    for name, (n, k) in SHAPES.items():
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        w_scale = (w16.float().abs().amax(dim=1) / 448.0).view(1, -1)
        w_q = (w16.float() / w_scale.t()).clamp(-448, 448).to(torch.float8_e4m3fn)
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x_q, x_scale = kernels.quantize_fp8_per_token(x)
            t16 = time_us(lambda: torch.nn.functional.linear(x, w16))
            ref = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)
            tsm = time_us(lambda: torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale,
                                                   out_dtype=torch.bfloat16))
            per_config = []
            for cfg in CONFIGS:
                out = kernels.fp8_matmul_few_rows(x_q, x_scale, w_q, w_scale, torch.bfloat16, config=cfg)
                diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                t = time_us(lambda: kernels.fp8_matmul_few_rows(x_q, x_scale, w_q, w_scale,
                                                                torch.bfloat16, config=cfg))
                per_config.append((t, cfg, diff))
            default_t, _, default_diff = per_config[0]
            best_t, best_cfg, best_diff = min(per_config, key=lambda r: r[0])
            row = {"shape": name, "n": n, "k": k, "rows": m, "bf16_us": t16, "scaled_mm_us": tsm,
                   "ours_default_us": default_t, "ours_best_us": best_t, "best_config": vars(best_cfg),
                   "max_rel_diff_vs_scaled_mm": max(default_diff, best_diff),
                   "ours_default_weight_gb_s": n * k / default_t / 1e3}
            results.append(row)
            cfg_s = f"bn{best_cfg.block_n} bk{best_cfg.block_k} st{best_cfg.num_stages} w{best_cfg.num_warps} ({best_t:.1f})"
            print(f"{name:18} {m:>3} {t16:8.1f} {tsm:12.1f} {default_t:8.1f} {row['ours_default_weight_gb_s']:9.0f} "
                  f"{cfg_s:40} {row['max_rel_diff_vs_scaled_mm']:12.2e}", flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
