"""What LoRA adapters cost: one workload in-process (backend.LLM, dummy weights of a real
shape), run by an engine without LoRA, then by one with adapters loaded, with requests that
name none of them, all one, or spread over all of them; and with half as many device slots
as adapters (`max_loras`), so that adapters take turns.

    python -m benchmarks.engine.lora --model models/configs/llama-3-8b --tokenizer models/tiny-llama \
        --adapters 4 --rank 16 --num-requests 256 --input-len 512 --output-len 128 --json lora.json

Adapters are random PEFT directories (rank --rank, every projection of every layer) written
under --work. Each variant runs in a process of its own, so each engine has the whole GPU.
Prints a table and writes JSON (output tok/s of each variant, and against the engine without
LoRA, which runs first and again last).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = ("no LoRA engine", "LoRA engine, base requests", "LoRA engine, one adapter",
            "LoRA engine, adapters mixed", "adapters mixed, half the slots")


def run_variant(args: argparse.Namespace, variant: int) -> dict:
    import torch

    from tritium import LLM, SamplingParams
    from benchmarks.loadgen.workloads import make_prompts

    adapters = {f"a{i}": os.path.join(args.work, f"a{i}") for i in range(args.adapters)}
    kwargs = dict(load_format="dummy", dtype=args.dtype, tokenizer=args.tokenizer,
                  max_model_len=args.input_len + args.output_len + 16)
    if variant > 0:
        kwargs.update(enable_lora=True, lora_modules=adapters, max_lora_rank=args.rank)
    if variant == 4:  # adapters take turns in the device slots
        kwargs.update(max_loras=max(1, args.adapters // 2))
    llm = LLM(args.model, **kwargs)
    names = list(adapters)
    prompts = make_prompts(args.num_requests, args.input_len, seed=args.seed)
    loras = [None if variant < 2 else names[0] if variant == 2 else names[i % len(names)]
             for i in range(len(prompts))]
    if variant == 4:  # in runs of requests per adapter, so that slots change hands a few times
        loras = [names[i * len(names) // len(prompts)] for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # Warm-up at the workload's shapes (its prompt chunks, a few decode steps), so that no
    # kernel first runs inside the timed run.
    warm = make_prompts(len(prompts), args.input_len, seed=args.seed, tag="warm-up")
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), lora_request=loras)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    sync()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"variant": VARIANTS[variant], "output_tokens": tokens, "seconds": elapsed,
            "output_tok_s": tokens / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer", default=os.path.join(ROOT, "models", "tiny-llama"))
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--work", default="/tmp/tritium-lora-bench")
    p.add_argument("--json")
    p.add_argument("--variant", type=int, help=argparse.SUPPRESS)  # one variant, in a child process
    args = p.parse_args()
    if args.variant is not None:
        print("RESULT " + json.dumps(run_variant(args, args.variant)), flush=True)
        return
    from tests.engine.lora_adapters import write_adapter
    for i in range(args.adapters):
        write_adapter(os.path.join(args.work, f"a{i}"), args.model, TARGETS, args.rank, 2 * args.rank,
                      seed=i, scale=0.01)
    results = []
    # The engine without LoRA first and again last: a run's place in the sequence of processes
    # moves its figure (the first is the slowest) by more than some variants differ.
    for variant in (*range(len(VARIANTS)), 0):
        child = subprocess.run([sys.executable, "-m", __spec__.name, *sys.argv[1:], "--variant", str(variant)],
                               capture_output=True, text=True)
        line = next((l for l in child.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(child.stdout[-3000:], child.stderr[-3000:], sep="\n")
            raise SystemExit(f"variant {VARIANTS[variant]!r} failed")
        results.append(json.loads(line[len("RESULT "):]))
        print(f"{results[-1]['variant']}: {results[-1]['output_tok_s']:,.0f} tok/s", flush=True)
    base = (results[0]["output_tok_s"] + results[-1]["output_tok_s"]) / 2
    print(f"{'variant':<30} {'output tok/s':>13} {'vs no LoRA (mean of both runs)':>31}")
    for r in results:
        r["vs_no_lora"] = r["output_tok_s"] / base
        print(f"{r['variant']:<30} {r['output_tok_s']:>13,.0f} {r['vs_no_lora']:>30.3f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "adapters": args.adapters, "rank": args.rank,
                       "num_requests": args.num_requests, "input_len": args.input_len,
                       "output_len": args.output_len, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
