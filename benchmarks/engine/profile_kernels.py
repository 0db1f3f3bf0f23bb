"""Where a step's GPU time goes, kernel by kernel, on the GPU: runs workload A (256 x 512 in)
in-process with dummy weights, records a few prefill-phase steps and a few full-batch decode
steps with torch.profiler, and prints per-kernel totals per step. With --gemm it also times
the model's GEMM shapes alone (the ceiling each kernel category can reach). --num-requests and
--output-len change the workload (with `speculative_config`, decode-phase steps verify).

    python3 -m benchmarks.engine.profile_kernels --model models/configs/llama-3-8b --tokenizer models/tiny-llama \
        [--gemm] [--json out.json] [--engine-arg key=value ...]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine.engine_cli import add_engine_arguments, engine_values
from tritium import EngineArgs, LLMEngine, SamplingParams


def category(name: str) -> str:
    n = name.lower()
    for key, cat in (("nvjet", "gemm"), ("gemm", "gemm"), ("cutlass", "gemm"), ("sm90", "gemm"),
                     ("decode", "attn_decode"), ("merge", "attn_decode"), ("prefill", "attn_prefill"),
                     ("store_kv", "kv_store"), ("rms", "rms_norm"), ("rotary", "rotary"),
                     ("silu", "silu_and_mul"), ("memcpy", "memcpy"), ("copy", "copy"),
                     ("index", "index"), ("embedding", "embedding"), ("sort", "sampler"),
                     ("softmax", "sampler"), ("argmax", "sampler"), ("reduce", "sampler")):
        if key in n:
            return cat
    return "other"


def kernel_table(prof, num_steps: int) -> dict:
    per_kernel: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.name][0] += evt.device_time
            per_kernel[evt.name][1] += 1
    cats: dict[str, float] = defaultdict(float)
    for name, (us, _) in per_kernel.items():
        cats[category(name)] += us
    total = sum(cats.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "gpu_ms_per_step": total / 1000 / num_steps,
        "by_category_ms_per_step": {k: round(v / 1000 / num_steps, 3)
                                    for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:110], "ms_per_step": round(us / 1000 / num_steps, 3),
                         "calls_per_step": c / num_steps, "category": category(n)}
                        for n, (us, c) in top],
    }


def profile_steps(engine: LLMEngine, more: Callable[[int], bool]) -> dict:
    """Per-kernel GPU time of the steps taken while more(steps taken so far) holds."""
    torch.cuda.synchronize()
    start, steps = time.perf_counter(), 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while more(steps):
            engine.step()
            steps += 1
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1000
    table = kernel_table(prof, steps)
    table.update(wall_ms_per_step=wall_ms / steps, steps=steps, wall_ms=wall_ms)
    return table


def gemm_ceiling(hidden: int, inter: int, q: int, kv: int, vocab: int) -> list[dict]:
    rows = []
    shapes = {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden),
              "down": (hidden, inter), "lm_head": (vocab, hidden)}
    for m in (256, 8192):
        for name, (n, k) in shapes.items():
            if name == "lm_head" and m > 256:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                torch.nn.functional.linear(x, w)
            torch.cuda.synchronize()
            reps = 20
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(reps):
                torch.nn.functional.linear(x, w)
            e.record()
            torch.cuda.synchronize()
            ms = s.elapsed_time(e) / reps
            rows.append({"m": m, "gemm": name, "n": n, "k": k, "ms": round(ms, 4),
                         "tflops": round(2 * m * n * k / ms / 1e9, 1)})
            print(f"gemm m={m:5d} {name:8s} n={n:6d} k={k:6d}: {ms:.3f} ms {rows[-1]['tflops']} TFLOP/s",
                  flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    add_engine_arguments(ap)
    ap.add_argument("--gemm", action="store_true")
    ap.add_argument("--num-requests", type=int, default=256, help="of --input-len tokens each (workload A: 256)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--whole-prefill", action="store_true",
                    help="profile every step from the first until the prompts are computed (a long prompt's TTFT)")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--skip-decode-steps", type=int, default=60,
                    help="steps after the prefill phase before the decode phase is recorded")
    ap.add_argument("--json")
    a = ap.parse_args()
    values = engine_values(a)
    engine = LLMEngine(EngineArgs.from_strings(values))
    result: dict = {"engine_args": values}
    cfg = engine.executor.worker.model.config
    if a.gemm:
        result["gemm"] = gemm_ceiling(cfg.hidden_size, cfg.intermediate_size,
                                      cfg.num_attention_heads * cfg.head_dim,
                                      cfg.num_key_value_heads * cfg.head_dim, cfg.vocab_size)
    rng = random.Random(0)

    def add(n: int, in_len: int, out_len: int, tag: str) -> None:
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        for i in range(n):
            engine.add_request(f"{tag}{i}", [rng.randrange(100, 5000) for _ in range(in_len)], params)

    def prefilling() -> bool:
        return bool(engine.scheduler.waiting) or any(s.num_computed_tokens < s.num_prompt_tokens
                                                     for s in engine.scheduler.running)

    add(64, 512, 4, "warm")  # compiles every kernel variant at full-size steps
    if a.input_len > 512:  # and the attention variants of a long history
        add(1, a.input_len, 2, "warm_long")
    while engine.has_unfinished_requests():
        engine.step()
    add(a.num_requests, a.input_len, a.output_len, "a")
    if a.whole_prefill:
        result["prefill_phase"] = profile_steps(engine, lambda _: prefilling())
        print(f"whole prefill: {result['prefill_phase']['steps']} steps in "
              f"{result['prefill_phase']['wall_ms']:.1f} ms (under the profiler)")
    else:
        engine.step()  # first prefill step (nothing to overlap with)
        result["prefill_phase"] = profile_steps(engine, lambda n: n < 4)
    while prefilling():
        engine.step()
    for _ in range(a.skip_decode_steps):
        engine.step()
    result["decode_phase"] = profile_steps(engine, lambda n: n < 10)
    while engine.has_unfinished_requests():
        engine.step()
    for phase in ("prefill_phase", "decode_phase"):
        t = result[phase]
        print(f"\n== {phase}: wall {t['wall_ms_per_step']:.2f} ms/step, GPU busy "
              f"{t['gpu_ms_per_step']:.2f} ms/step")
        for k, v in t["by_category_ms_per_step"].items():
            print(f"  {k:14s} {v:8.3f} ms")
        for row in t["top_kernels"][:15]:
            print(f"  {row['ms_per_step']:8.3f} ms x{row['calls_per_step']:5.1f}  {row['name']}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
