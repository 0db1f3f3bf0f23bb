"""Time to first token of a lone request as a function of how long the GPU sat idle before it,
in-process (GPU only). Workload B's TTFT through the server is measured after a few idle seconds
(the benchmark client starts new processes), the in-process figure right after workload A; this
separates the GPU's clock state from serving overhead.

    python3 scripts/ttft_after_idle.py --model models/configs/llama-3-8b --tokenizer models/tiny-llama
"""
from __future__ import annotations

import argparse
import gc
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


_GC = {"start": 0.0, "ms": [0.0, 0.0, 0.0], "count": [0, 0, 0]}


def _gc_callback(phase: str, info: dict) -> None:
    if phase == "start":
        _GC["start"] = time.perf_counter()
    else:
        g = info["generation"]
        _GC["ms"][g] += (time.perf_counter() - _GC["start"]) * 1000
        _GC["count"][g] += 1


def _device_allocs() -> int:
    import torch
    return int(torch.cuda.memory_stats().get("num_device_alloc", -1)) if torch.cuda.is_available() else -1


def lone_ttft_ms(engine: LLMEngine, rng: random.Random, input_len: int, tag: str) -> dict:
    """TTFT of one request, with what happened meanwhile: garbage collections (ms and count per
    generation), cudaMalloc calls, host ms of each engine step up to the first token."""
    engine.add_request(tag, [rng.randrange(100, 500) for _ in range(input_len)],
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    _GC["ms"], _GC["count"] = [0.0, 0.0, 0.0], [0, 0, 0]
    allocs = _device_allocs()
    start = time.perf_counter()
    first, steps = None, []
    while engine.has_unfinished_requests():
        s = time.perf_counter()
        outs = engine.step()
        if first is None:
            steps.append(round((time.perf_counter() - s) * 1000, 2))
        for out in outs:
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = (time.perf_counter() - start) * 1000
    return {"ttft_ms": round(first, 2), "gc_ms": [round(x, 2) for x in _GC["ms"]],
            "gc_count": list(_GC["count"]), "cuda_mallocs": _device_allocs() - allocs,
            "step_ms": steps}


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
    ap.add_argument("--frozen", action="store_true", help="repeat with gc.freeze() after warm-up")
    ap.add_argument("--json")
    a = ap.parse_args()
    engine = LLMEngine(EngineArgs.from_strings(engine_values(a)))
    rng = random.Random(0)
    lone_ttft_ms(engine, rng, a.input_len, "warm")
    gc.callbacks.append(_gc_callback)
    rows = []
    for frozen in (False, True) if a.frozen else (False,):
        if frozen:  # what the engine process does after start-up
            gc.collect()
            gc.freeze()
        for gap in (float(g) for g in a.gaps.split(",")):
            for r in range(a.repeats):
                busy(engine, rng, 2.0, a.input_len)  # start every trial from a loaded GPU
                time.sleep(gap)
                clock = sm_clock_mhz()
                row = {"gc_frozen": frozen, "idle_s": gap, "sm_clock_mhz_before": clock,
                       **lone_ttft_ms(engine, rng, a.input_len, f"g{gap}-{r}-{frozen}")}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"engine_args": engine_values(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
