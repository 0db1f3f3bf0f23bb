"""Workload A in-process (scripts/profile_engine.py) under several weight layouts and BLAS back
ends for the decoder's linear layers, each variant in a fresh process (GPU only).

bench_gemm.py times GEMMs alone; inside the decode CUDA graph, between attention kernels that
flush L2, the ranking can differ. A variant names the projections whose weights are stored
[K, N] (F.linear then runs `x @ W_kn`, an NN GEMM instead of TN) and the BLAS library used while
the decode graphs are captured (prefill steps stay on cuBLAS):

    python3 scripts/bench_linear_layouts.py --model models/configs/llama-3-8b \
        --tokenizer models/tiny-llama --variants base,lt,kn3,kn3_lt,kn4_lt --out $OUT/layouts.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

KN3 = ("qkv_proj", "o_proj", "gate_up_proj")
VARIANTS = {  # name -> (projections stored [K, N], BLAS library while capturing decode graphs)
    "base": ((), None),
    "lt": ((), "cublaslt"),
    "kn3": (KN3, None),
    "kn3_lt": (KN3, "cublaslt"),
    "kn4": (KN3 + ("down_proj",), None),
    "kn4_lt": (KN3 + ("down_proj",), "cublaslt"),
    "kn_down_lt": (("down_proj",), "cublaslt"),
}


def apply_variant(name: str) -> None:
    """Patch the engine before it is built: a post-load step that re-stores chosen weights
    [K, N] (same values; the parameter becomes a transposed view), and graph capture under the
    chosen BLAS library."""
    import torch

    from backend import cuda_graph, model_runner
    kn, blas = VARIANTS[name]
    original_process = model_runner.process_weights_after_loading

    def process(model):
        original_process(model)
        for mod_name, module in model.named_modules():
            if mod_name.split(".")[-1] in kn:
                module.weight.data = module.weight.data.t().contiguous().t()

    model_runner.process_weights_after_loading = process
    if blas:
        original_capture = cuda_graph.DecodeGraphs.capture

        def capture(self):
            before = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library(blas)
            try:
                original_capture(self)
            finally:
                torch.backends.cuda.preferred_blas_library(before)

        cuda_graph.DecodeGraphs.capture = capture


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="base,lt,kn3,kn3_lt,kn4_lt")
    ap.add_argument("--out")
    ap.add_argument("--run-one", help=argparse.SUPPRESS)
    a, rest = ap.parse_known_args()
    if a.run_one:  # child: patch, then hand the remaining arguments to profile_engine
        apply_variant(a.run_one)
        import profile_engine
        sys.argv = ["profile_engine.py"] + rest
        profile_engine.main()
        return
    results = {}
    for name in a.variants.split(","):
        tmp = f"/tmp/layout_{name}.json"
        cmd = [sys.executable, __file__, "--run-one", name, *rest, "--json", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: failed\n{proc.stderr[-3000:]}", flush=True)
            results[name] = {"error": proc.stderr[-3000:]}
            continue
        with open(tmp, encoding="utf-8") as f:
            r = json.load(f)
        results[name] = r
        busy = r.get("gpu_busy_ms", {})
        print(f"{name:>11}: {r['output_tok_s']:8.0f} tok/s  decode step {_ms(r['decode_step_ms_median'])} ms"
              f"  GPU busy prefill {busy.get('prefill', 0):.0f} ms decode {busy.get('decode', 0):.0f} ms"
              f"  mixed step {_ms(r['mixed_step_ms_median'])} ms", flush=True)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
