"""Workload A through the engine process alone (backend/engine/engine_process.py, as the Triton stub
drives it, text included) without tritonserver: separates the engine process's own cost from
the server's. Prints output tok/s; the engine process logs its step loop's wall and CPU time at
shutdown (stderr).

    python3 -m scripts.probes.bench_engine_process --model models/configs/qwen2.5-1.5b --tokenizer DIR
"""
from __future__ import annotations

import argparse
import json
import random
import threading
import time

from scripts.engine_cli import add_engine_arguments, engine_values
from backend import EngineArgs, SamplingParams  # noqa: E402
from backend.engine.engine_process import EngineProcess  # noqa: E402


class Counter:
    """Counts output tokens of every request; sets `done` when all have finished."""

    def __init__(self, expected: int) -> None:
        self.tokens = 0
        self.finished = 0
        self.expected = expected
        self.lock = threading.Lock()
        self.done = threading.Event()

    def __call__(self, out) -> None:
        with self.lock:
            self.tokens += sum(len(c.token_ids) for c in out.outputs)
            if out.finished:
                self.finished += 1
                if self.finished == self.expected:
                    self.done.set()


def run(engine: EngineProcess, n: int, input_len: int, output_len: int, rng: random.Random, tag: str) -> dict:
    counter = Counter(n)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    prompts = [[rng.randrange(100, 500) for _ in range(input_len)] for _ in range(n)]
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params, counter)
    if not counter.done.wait(600):
        raise RuntimeError(f"{counter.finished} of {n} requests finished")
    wall = time.perf_counter() - start
    return {"requests": n, "output_tokens": counter.tokens, "wall_s": wall, "output_tok_s": counter.tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_engine_arguments(ap)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--json")
    a = ap.parse_args()
    values = engine_values(a)
    engine = EngineProcess(EngineArgs.from_strings(values))
    rng = random.Random(0)
    run(engine, 4, 16, 16, rng, "warm")
    result = run(engine, a.num_requests, a.input_len, a.output_len, rng, "a")
    result["receiver"] = dict(engine.receiver_stats)
    engine.shutdown()
    print(json.dumps(result), flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"engine_args": values, **result}, f, indent=1)


if __name__ == "__main__":
    main()
