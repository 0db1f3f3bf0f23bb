"""The Hugging Face anchor: transformers `generate` on the same workloads, so that every engine
figure is a ratio measured side by side on the same machine.

Random weights of the config's shapes (no checkpoint needed), SDPA attention, greedy, exactly
output_len new tokens (min_new_tokens = max_new_tokens), static batches.

    python -m benchmarks.hf --config models/configs/llama-3-8b --json hf.json
    python -m benchmarks.hf --config DIR --device cpu --dtype float32 --num-requests 4 \
        --input-len 16 --output-len 8 --batch-size 2     # a smoke test without a GPU
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

from benchmarks.loadgen.bench import clean_json
from benchmarks.loadgen.bench_stats import percentile
from benchmarks.loadgen.workloads import (DEFAULT_SEED, VOCAB_HIGH, VOCAB_LOW, WORKLOADS, Workload,
                                          make_prompts, parse_vocab_range, parse_workload_names, with_overrides)


def load_model(config_dir: str, dtype_name: str, device: str, attn: str, seed: int) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    config = AutoConfig.from_pretrained(config_dir)
    # Built directly on the device: initialising 8B parameters on the CPU would take minutes.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval()


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def generate(model: Any, prompts: list[list[int]], new_tokens: int, device: str) -> tuple[float, int]:
    """One static batch; returns (seconds, new tokens produced)."""
    import torch

    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=0, use_cache=True)
    _sync(device)
    seconds = time.perf_counter() - t0
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return seconds, produced


def run_throughput(model: Any, w: Workload, batch_size: int, device: str, seed: int, low: int,
                   high: int) -> dict[str, Any]:
    prompts = make_prompts(w.num_requests, w.input_len, seed, w.name, low, high)
    total_s, tokens, batch_s = 0.0, 0, []
    for i in range(0, len(prompts), batch_size):
        s, n = generate(model, prompts[i:i + batch_size], w.output_len, device)
        total_s += s
        tokens += n
        batch_s.append(s)
        print(f"  batch {i // batch_size + 1}: {s:.2f} s, {n / s:,.0f} tok/s", flush=True)
    return {"completed": w.num_requests, "failed": 0, "output_tokens": tokens, "wall_s": total_s,
            "output_tok_s": tokens / total_s, "requests_s": w.num_requests / total_s,
            "batch_size": batch_size, "batch_s": batch_s,
            "wrong_length_requests": 0 if tokens == w.total_output_tokens else w.num_requests}


def run_latency(model: Any, w: Workload, device: str, seed: int, low: int, high: int,
                ttft_repeats: int = 3) -> dict[str, Any]:
    """Batch 1. TTFT = median of one-token generates on other prompts of the same length; the
    batch-1 path is warmed first (the throughput warm-up ran at another batch size)."""
    ttft_prompts = make_prompts(ttft_repeats, w.input_len, seed, w.name + "-ttft", low, high)
    generate(model, ttft_prompts[:1], 2, device)
    ttfts = [generate(model, [p], 1, device)[0] for p in ttft_prompts]
    ttft = percentile(ttfts, 50)
    summary = run_throughput(model, w, 1, device, seed, low, high)
    e2e = summary["wall_s"] / w.num_requests
    summary["ttft_ms"] = {"mean": sum(ttfts) / len(ttfts) * 1000, "p50": ttft * 1000,
                          "p99": percentile(ttfts, 99) * 1000}
    summary["e2e_ms"] = {"mean": e2e * 1000, "p50": e2e * 1000, "p99": e2e * 1000}
    summary["decode_tok_s"] = (w.output_len - 1) / (e2e - ttft) if e2e > ttft else float("nan")
    return summary


def capped(w: Workload, max_requests: int | None) -> Workload:
    """w with at most max_requests requests (the anchor is slow: a call may run fewer of A's)."""
    if max_requests is None or w.num_requests <= max_requests:
        return w
    return dataclasses.replace(w, num_requests=max_requests)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="directory with config.json")
    ap.add_argument("--workloads", default="A,B", help="names from benchmarks/loadgen/workloads.py (A, B, C, L)")
    ap.add_argument("--batch-size", type=int, default=64, help="static batch size for throughput runs")
    ap.add_argument("--num-requests", type=int, help="override the throughput workloads' request count")
    ap.add_argument("--max-requests", type=int,
                    help="at most this many requests of each workload (gpu_run.sh's --hf-requests)")
    ap.add_argument("--input-len", type=int)
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--vocab-range", default=f"{VOCAB_LOW}:{VOCAB_HIGH}")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    low, high = parse_vocab_range(args.vocab_range)
    try:
        names = parse_workload_names(args.workloads)
    except ValueError as e:
        ap.error(str(e))
    if args.max_requests is not None and args.max_requests < 1:
        ap.error("--max-requests must be at least 1")

    import torch
    import transformers

    t0 = time.perf_counter()
    model = load_model(args.config, args.dtype, args.device, args.attn, args.seed)
    load_s = time.perf_counter() - t0
    print(f"HF model ready in {load_s:.1f} s (transformers {transformers.__version__}, torch {torch.__version__})")
    result: dict[str, Any] = {
        "runner": "hf-generate", "config": os.path.abspath(args.config), "dtype": args.dtype,
        "device": args.device, "attn": args.attn, "load_s": load_s, "seed": args.seed,
        "vocab_range": [low, high], "transformers": transformers.__version__, "torch": torch.__version__,
        "workloads": {}}
    # Warm-up: kernels, cuBLAS handles and allocator pools, at the batch size used below (after a
    # smaller warm-up the first timed batch ran several times slower than the next ones).
    input_len = args.input_len or WORKLOADS["A"].input_len
    generate(model, make_prompts(args.batch_size, input_len, args.seed, "warmup", low, high), 32,
             args.device)

    for name in names:
        w = capped(with_overrides(name, args.num_requests, args.input_len, args.output_len), args.max_requests)
        batch = min(args.batch_size, w.num_requests)
        if batch > 1 and (batch, w.input_len) != (args.batch_size, input_len):
            # A batch of another shape (C's long prompts) would pay the allocator's growth in
            # its first, measured, batch: warm that shape too.
            generate(model, make_prompts(batch, w.input_len, args.seed, "warmup", low, high), 2, args.device)
        print(f"HF workload {name}: {w.num_requests} x ({w.input_len} in, {w.output_len} out)", flush=True)
        s = run_latency(model, w, args.device, args.seed, low, high) if w.num_requests == 1 else \
            run_throughput(model, w, args.batch_size, args.device, args.seed, low, high)
        result["workloads"][name] = {"workload": dataclasses.asdict(w), "summary": s}
        line = f"HF workload {name}: {s['output_tok_s']:,.1f} out tok/s"
        if "decode_tok_s" in s:
            line += f", decode {s['decode_tok_s']:.1f} tok/s, TTFT {s['ttft_ms']['p50']:.1f} ms"
        print(line, flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(clean_json(result), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
