"""FP8 matmul for decode batches on the GPU: our kernel (kernels/fp8_matmul.py) against
torch._scaled_mm (row-wise scales) and a bf16 F.linear, at the linear layers of the models under
models/configs for 1, 4 and 16 rows; each timed as a CUDA graph replay (no launch cost), with the
weight bandwidth and the largest difference from _scaled_mm. Every config of the sweep is timed;
with --write-configs the fastest per weight shape (least time summed over the row counts) goes
into the table that the kernel reads for this GPU model. Prints a table, writes JSON.

    python3 benchmarks/kernels/fp8_matmul.py --json out.json [--write-configs kernels/configs/fp8_matmul.json]
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os

import torch
import triton.testing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tritium import kernels
from tritium.kernels.fp8_matmul import Fp8MatmulConfig, shape_key

MODELS = ("llama-3-8b", "qwen2.5-7b", "qwen2.5-1.5b")
CONFIGS = [Fp8MatmulConfig()] + [
    Fp8MatmulConfig(block_n=bn, block_k=bk, num_stages=st, num_warps=4)
    for bn, bk, st in itertools.product((32, 64, 128), (128, 256), (3, 4, 5))
    if (bn, bk, st) != (64, 128, 4)]  # the default, already first
# The weight as the MMA's first operand (an FP8 wgmma on sm_90, 64 columns a warpgroup).
CONFIGS += [Fp8MatmulConfig(block_n=bn, block_k=bk, num_stages=st, num_warps=4 * (bn // 64), swap_ab=True)
            for bn, bk, st in itertools.product((64, 128), (128, 256), (3, 4, 5))]


def linear_shapes(model: str) -> dict[str, tuple[int, int]]:
    """{layer: (N, K)} of a decoder layer's FP8 linears, from the model's config.json."""
    with open(os.path.join(ROOT, "models", "configs", model, "config.json"), encoding="utf-8") as f:
        c = json.load(f)
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or h // heads
    inter = c["intermediate_size"]
    return {"qkv": ((heads + 2 * kv) * d, h), "o": (h, heads * d), "gate_up": (2 * inter, h),
            "down": (h, inter)}


def time_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1000


def write_configs(path: str, gpu: str, best: dict[str, Fp8MatmulConfig]) -> None:
    table = {"configs": {}}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    table.setdefault("configs", {})[gpu] = {k: vars(c) for k, c in sorted(best.items())}
    table.setdefault("provenance", {})[gpu] = (
        f"{datetime.date.today().isoformat()} sweep by benchmarks/kernels/fp8_matmul.py --write-configs: "
        "the config with the least time summed over 1, 4 and 16 rows for each shape")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")


def cfg_name(cfg: Fp8MatmulConfig) -> str:
    return f"bn{cfg.block_n} bk{cfg.block_k} st{cfg.num_stages} w{cfg.num_warps}" + (" swap" if cfg.swap_ab else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--json")
    ap.add_argument("--write-configs", metavar="PATH", help="merge the fastest configs into this table")
    ap.add_argument("--swapped-only", action="store_true",
                    help="time the default and the swapped configs alone (a short call)")
    a = ap.parse_args()
    configs = [c for c in CONFIGS if c == CONFIGS[0] or c.swap_ab] if a.swapped_only else CONFIGS
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    rows_list = [int(r) for r in a.rows.split(",")]
    shapes: dict[tuple[int, int], list[str]] = {}
    for model in a.models.split(","):
        for layer, nk in linear_shapes(model).items():
            shapes.setdefault(nk, []).append(f"{model} {layer}")
    results, best_per_shape = [], {}
    print(f"{gpu}; {len(configs)} configs per shape")
    print(f"{'shape':28} {'N x K':>12} {'M':>3} {'bf16 us':>8} {'scaled_mm':>9} {'default':>8} "
          f"{'GB/s':>6} {'best us':>8} {'best config':22} {'rel diff':>9}")
    for (n, k), names in shapes.items():
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        w_scale = (w16.float().abs().amax(dim=1) / 448.0).view(1, -1)
        w_q = (w16.float() / w_scale.t()).clamp(-448, 448).to(torch.float8_e4m3fn)
        totals = [0.0] * len(configs)
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x_q, x_scale = kernels.quantize_fp8_per_token.triton(x)
            t16 = time_us(lambda: torch.nn.functional.linear(x, w16))
            ref = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)
            tsm = time_us(lambda: torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale,
                                                   out_dtype=torch.bfloat16))
            per_config, worst_diff = [], 0.0
            for i, cfg in enumerate(configs):
                out = kernels.fp8_matmul_few_rows.triton(x_q, x_scale, w_q, w_scale, torch.bfloat16, config=cfg)
                diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                worst_diff = max(worst_diff, diff)
                t = time_us(lambda: kernels.fp8_matmul_few_rows.triton(x_q, x_scale, w_q, w_scale,
                                                                torch.bfloat16, config=cfg))
                totals[i] += t
                per_config.append({"config": vars(cfg), "us": t})
            default_t = per_config[0]["us"]
            best = min(per_config, key=lambda r: r["us"])
            results.append({"shape": " / ".join(names), "n": n, "k": k, "rows": m, "bf16_us": t16,
                            "scaled_mm_us": tsm, "ours_default_us": default_t, "ours_best_us": best["us"],
                            "best_config": best["config"], "max_rel_diff_vs_scaled_mm": worst_diff,
                            "ours_default_weight_gb_s": n * k / default_t / 1e3, "per_config": per_config})
            print(f"{names[0]:28} {n:>5} x {k:<5} {m:>3} {t16:8.1f} {tsm:9.1f} {default_t:8.1f} "
                  f"{n * k / default_t / 1e3:6.0f} {best['us']:8.1f} {cfg_name(Fp8MatmulConfig(**best['config'])):22} "
                  f"{worst_diff:9.2e}", flush=True)
        i_best = min(range(len(configs)), key=lambda i: totals[i])
        best_per_shape[shape_key(n, k)] = configs[i_best]
        print(f"{'':28} {'':12} sum {totals[0]:.1f} us default -> {totals[i_best]:.1f} us with "
              f"{cfg_name(configs[i_best])} (chosen for {shape_key(n, k)})")
    if a.write_configs:
        write_configs(a.write_configs, gpu, best_per_shape)
        print(f"wrote {len(best_per_shape)} configs for {gpu} to {a.write_configs}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"gpu": gpu, "results": results,
                       "chosen": {s: vars(c) for s, c in best_per_shape.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
