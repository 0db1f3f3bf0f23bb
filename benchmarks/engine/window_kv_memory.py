"""The KV memory one long request holds with and without the window-aware cache, in-process:
one request of --tokens tokens (prompt, then --output-len greedy tokens), run twice on one
engine, first with blocks behind every layer's window given back as the request grows, then
with the block manager keeping every block (its `sliding_window` cleared: what the cache did
before). Per run: the most blocks held at once and at the end (in GiB, the blocks' bytes over
every layer), TTFT, decode tok/s, and whether both runs gave the same tokens.

A model with a full-attention layer (Gemma 2/3) gives nothing back: both runs hold the same.

    python -m benchmarks.engine.window_kv_memory --model models/configs/mistral-7b-v0.1 \
        --tokenizer models/tiny-llama --tokens 32768 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from benchmarks.engine.engine_cli import add_engine_arguments, engine_values
from benchmarks.loadgen.workloads import make_prompts

GIB = 2 ** 30


def run_once(engine, prompt: list[int], output_len: int) -> dict[str, Any]:
    """The request alone on the engine: blocks held after every step, TTFT, decode rate."""
    from tritium import SamplingParams
    bm = engine.block_manager
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request("long", prompt, params)
    held, tokens, first = [], [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens.extend(o.outputs[0].token_ids)
            if first is None and tokens:
                first = time.perf_counter()
        if engine.scheduler.running:  # (its blocks are free once it finishes)
            held.append(bm.num_blocks - bm.num_free_blocks)
    end = time.perf_counter()
    return {"peak_blocks": max(held), "blocks_at_end": held[-1],
            "ttft_s": first - t0, "decode_tok_s": (len(tokens) - 1) / (end - first), "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(ap)
    ap.add_argument("--tokens", type=int, default=32768, help="prompt plus output tokens")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from tritium import EngineArgs, LLMEngine
    values = {"max_model_len": str(args.tokens), **engine_values(args)}
    engine = LLMEngine(EngineArgs.from_strings(values))
    bm, worker = engine.block_manager, engine.executor.worker
    block_gib = worker.block_bytes / GIB
    window = bm.sliding_window
    prompt = make_prompts(1, args.tokens - args.output_len, 21, "window-kv")[0]
    run_once(engine, make_prompts(1, 512, 22, "window-warm")[0], 8)  # compiles, graph pools
    runs: dict[str, dict[str, Any]] = {}
    for name in ("window-aware", "every block kept"):
        if name == "every block kept":
            bm.sliding_window = None
        bm.reset_prefix_cache()
        r = run_once(engine, prompt, args.output_len)
        r["peak_gib"] = r["peak_blocks"] * block_gib
        r["end_gib"] = r["blocks_at_end"] * block_gib
        runs[name] = r
    aware, kept = runs.values()
    same = aware.pop("tokens") == kept.pop("tokens")
    layers = engine.executor.worker.model.config.layer_windows
    print(f"\n{args.model}: one request of {args.tokens} tokens ({args.tokens - args.output_len} prompt + "
          f"{args.output_len} output); layer windows {sorted(set(layers))} over {len(layers)} layers; "
          f"blocks of {bm.block_size} tokens, {worker.block_bytes / 2**20:.2f} MiB each; "
          f"max_num_batched_tokens {engine.config.scheduler_config.max_num_batched_tokens}")
    print(f"{'run':<18} {'peak blocks':>11} {'peak GiB':>9} {'end blocks':>10} {'end GiB':>8} "
          f"{'TTFT s':>7} {'decode tok/s':>12}")
    for name, r in runs.items():
        print(f"{name:<18} {r['peak_blocks']:>11} {r['peak_gib']:>9.2f} {r['blocks_at_end']:>10} "
              f"{r['end_gib']:>8.2f} {r['ttft_s']:>7.2f} {r['decode_tok_s']:>12.1f}")
    print(f"window given back to: {window}; same tokens in both runs: {same}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "output_len": args.output_len,
                       "window": window, "layer_windows": list(layers), "block_size": bm.block_size,
                       "block_bytes": worker.block_bytes, "num_blocks": bm.num_blocks,
                       "engine_args": values, "runs": runs, "same_tokens": same}, f, indent=2)
    engine.shutdown()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
