"""Cost of the prefix cache's block hashes on the CPU, per prompt token: SHA-256 over the
canonical encoding (backend/core/block_manager.py) against the Python `hash()` of a tuple it
replaced. Prints a table and writes JSON.

    python benchmarks/kernels/prefix_hash.py [--out docs/results/cpu_bench_prefix_hash.json]

The prompt's hashes are made by the input processor on the caller's thread (a server's request
thread, in the engine process's parent), not by the engine's step loop: this is what that
thread pays per request; the step loop pays it only for generated tokens, one block at a time,
after the next step is launched.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

from tritium.core.block_manager import hash_prompt_blocks, root_block_hash


def _python_hash_blocks(token_ids: list[int], block_size: int) -> list[int]:
    """What the engine did before: hash((parent, tuple(block)))."""
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


def _ns_per_token(fn, token_ids: list[int], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn(token_ids)
        best = min(best, time.perf_counter_ns() - start)
    return best / len(token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/results/cpu_bench_prefix_hash.json")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = random.Random(0)
    root = root_block_hash("adapter", "tenant-salt")
    rows = []
    for block_size in (16, 32):
        for num_tokens in (512, 2048, 8192, 32768):
            tokens = [rng.randrange(150_000) for _ in range(num_tokens)]
            sha = _ns_per_token(lambda t: hash_prompt_blocks(root, t, block_size), tokens, args.repeats)
            old = _ns_per_token(lambda t: _python_hash_blocks(t, block_size), tokens, args.repeats)
            rows.append({"block_size": block_size, "prompt_tokens": num_tokens, "sha256_ns_per_token": round(sha, 1),
                         "python_hash_ns_per_token": round(old, 1),
                         "sha256_us_per_prompt": round(sha * num_tokens / 1000, 1)})
    print(f"{'block':>5} {'tokens':>7} {'sha256 ns/tok':>14} {'hash() ns/tok':>14} {'sha256 us/prompt':>17}")
    for r in rows:
        print(f"{r['block_size']:>5} {r['prompt_tokens']:>7} {r['sha256_ns_per_token']:>14} "
              f"{r['python_hash_ns_per_token']:>14} {r['sha256_us_per_prompt']:>17}")
    result = {"benchmark": "prefix_hash", "python": platform.python_version(), "machine": platform.machine(),
              "processor": platform.processor(), "cpus": os.cpu_count(), "repeats": args.repeats,
              "note": "best of repeats; hash_prompt_blocks (SHA-256) vs hash() of (parent, tuple)", "rows": rows}
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
