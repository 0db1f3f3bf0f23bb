"""Time to first token of a lone request as a function of how long the GPU sat idle before it,
in-process (GPU only). Workload B's TTFT through the server is measured after a few idle seconds
(the benchmark client starts new processes), the in-process figure right after workload A; this
separates the GPU's clock state from serving overhead.

    python3 scripts/ttft_after_idle.py --model models/configs/llama-3-8b --tokenizer models/tiny-llama
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_cli import add_engine_arguments, engine_values  # noqa: E402
from backend import EngineArgs, LLMEngine, SamplingParams  # noqa: E402


def sm_clock_mhz() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        return f"unavailable ({exc})"


def lone_ttft_ms(engine: LLMEngine, rng: random.Random, input_len: int, tag: str) -> float:
    engine.add_request(tag, [rng.randrange(100, 500) for _ in range(input_len)],
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    start = time.perf_counter()
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = (time.perf_counter() - start) * 1000
    return round(first, 2)


def busy(engine: LLMEngine, rng: random.Random, seconds: float, input_len: int) -> None:
    """Keep the GPU loaded (prefills of 16 prompts at a time) for about `seconds`."""
    end, i = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        for _ in range(16):
            engine.add_request(f"busy{i}", [rng.randrange(100, 500) for _ in range(input_len)],
                               SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            i += 1
        while engine.has_unfinished_requests():
            engine.step()


def main() -> None:
    ap = argparse.ArgumentParser()
    add_engine_arguments(ap)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--gaps", default="0,0.5,1,2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    engine = LLMEngine(EngineArgs.from_strings(engine_values(a)))
    rng = random.Random(0)
    lone_ttft_ms(engine, rng, a.input_len, "warm")
    rows = []
    for gap in (float(g) for g in a.gaps.split(",")):
        for r in range(a.repeats):
            busy(engine, rng, 2.0, a.input_len)  # start every trial from a loaded GPU
            time.sleep(gap)
            clock = sm_clock_mhz()
            ttft = lone_ttft_ms(engine, rng, a.input_len, f"g{gap}-{r}")
            rows.append({"idle_s": gap, "sm_clock_mhz_before": clock, "ttft_ms": ttft})
            print(f"idle {gap:4.1f} s  SM clock before {clock:>5} MHz  TTFT {ttft:7.2f} ms", flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"engine_args": engine_values(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
