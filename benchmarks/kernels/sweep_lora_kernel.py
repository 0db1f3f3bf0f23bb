"""Time kernels.add_lora (multi-LoRA shrink + expand) per launch config at one model's
projection shapes, against the projection's own GEMM, as CUDA-graph replays after an L2 flush
(kernel_table.Bench).

    python -m benchmarks.kernels.sweep_lora_kernel --model models/configs/llama-3-8b --rank 16 --adapters 4 \
        --tokens 256,8192 --json sweep_lora.json

Rows use one adapter (slot 0) or are spread over all of them ("mixed"). Prints, per token
count and config, the four projections' LoRA time summed over the layers, and the same for
their GEMMs.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

CONFIGS = [(32, 128, 4), (16, 128, 4), (64, 128, 4), (64, 64, 4), (128, 128, 8), (64, 256, 8)]


def main() -> None:
    from benchmarks.kernels import kernel_table
    from tests.engine.lora_adapters import module_shapes
    from tritium import kernels

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--tokens", default="256,8192")
    p.add_argument("--json")
    args = p.parse_args()
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    shapes = module_shapes(config)
    layers = config["num_hidden_layers"]
    # Our projections: (in, out, stacked parts)
    projections = {"qkv": (shapes["qkv_proj"][0], shapes["qkv_proj"][1], 3),
                   "o": (*shapes["o_proj"], 1), "gate_up": (shapes["gate_up_proj"][0], shapes["gate_up_proj"][1], 2),
                   "down": (*shapes["down_proj"], 1)}
    dev, dt = torch.device("cuda"), torch.bfloat16
    graph_ms = kernel_table.Bench(quick=True, graphs=True).time_ms
    results = []
    for t in [int(x) for x in args.tokens.split(",")]:
        gemm_ms = 0.0
        lora_ms: dict[str, float] = {}
        for name, (k, n, parts) in projections.items():
            r = parts * args.rank
            x = torch.randn(t, k, device=dev, dtype=dt)
            w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
            a = torch.randn(args.adapters, r, k, device=dev, dtype=dt) * 0.02
            b = torch.randn(args.adapters, n, r, device=dev, dtype=dt) * 0.02
            y = x @ w.t()
            gemm_ms += graph_ms(lambda: torch.matmul(x, w.t(), out=y))
            for mix in ("one", "mixed"):
                slots = (torch.zeros(t, dtype=torch.int64, device=dev) if mix == "one"
                         else torch.arange(t, device=dev) % args.adapters)
                for bm, bn, warps in CONFIGS:
                    key = f"{mix} {bm}x{bn} w{warps}"
                    ms = graph_ms(lambda: kernels.add_lora.triton(y, x, a, b, slots, block_m=bm, block_n=bn,
                                                           num_warps=warps))
                    lora_ms[key] = lora_ms.get(key, 0.0) + ms
        print(f"tokens {t}: GEMMs of one step (4 projections x {layers} layers) {gemm_ms * layers:.2f} ms")
        for key, ms in sorted(lora_ms.items(), key=lambda kv: kv[1]):
            print(f"  {key:<22} LoRA {ms * layers:7.2f} ms  ({ms / gemm_ms:6.1%} of the GEMMs)")
        results.append({"tokens": t, "gemm_ms_per_step": gemm_ms * layers,
                        "lora_ms_per_step": {k: v * layers for k, v in lora_ms.items()}})
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "rank": args.rank, "adapters": args.adapters,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
