"""How long a full-batch decode step's CUDA graph takes against the sum of its kernels: the
time between kernels (launch latency inside the graph, each kernel's fill and drain) is what
fusing kernels or programmatic dependent launch could win. Runs workload A in-process until
the decode phase, then replays the graph of the last decode step: a few replays after an idle
pause (full clocks), a sustained run (the power cap), and a profiled burst (kernel durations).

    python3 -m scripts.probes.probe_decode_graph --model models/configs/llama-3-8b --tokenizer models/tiny-llama \
        [--json out.json] [--engine-arg key=value ...]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import threading
import time

import torch
from torch.profiler import ProfilerActivity, profile

from scripts.engine_cli import add_engine_arguments, engine_values
from backend import EngineArgs, LLMEngine, SamplingParams  # noqa: E402


def timed_replays(graph: torch.cuda.CUDAGraph, n: int) -> list[float]:
    """Milliseconds of each of n back-to-back replays (events between them)."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    events[0].record()
    for i in range(n):
        graph.replay()
        events[i + 1].record()
    torch.cuda.synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(n)]


def sample_gpu(stop: threading.Event, rows: list) -> None:
    while not stop.is_set():
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                 timeout=5).stdout.split(",")
            rows.append((float(out[0]), float(out[1])))
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            pass
        stop.wait(0.2)


def kernel_sum(graph: torch.cuda.CUDAGraph, n: int) -> dict:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"kernels_per_replay": len(kernels) / n,
            "kernel_ms_per_replay": sum(e.device_time for e in kernels) / 1000 / n}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_engine_arguments(ap)
    ap.add_argument("--json")
    ap.add_argument("--sustained", type=int, default=400)
    a = ap.parse_args()
    values = engine_values(a)
    engine = LLMEngine(EngineArgs.from_strings(values))
    runner = engine.runner
    used: list = []
    run = runner.graphs.run

    def run_and_record(batch, fill=None):
        used.append((next(b for b in runner.graphs.buckets if b >= int(batch.decode_context_lens.max())),
                     next(s for s in runner.graphs.sizes if s >= batch.num_tokens)))
        return run(batch, fill)

    runner.graphs.run = run_and_record
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    for i in range(256):
        engine.add_request(str(i), [rng.randrange(100, 5000) for _ in range(512)], params)
    steps = 0
    while steps < 120 or not used:  # well into the full-batch decode phase
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    key = used[-1]
    graph = runner.graphs.graphs[key][0]
    result: dict = {"engine_args": values, "graph": {"context_bucket": key[0], "batch": key[1]}}
    time.sleep(3)
    result["burst_ms"] = timed_replays(graph, 5)
    time.sleep(3)
    result["profiled_after_idle"] = kernel_sum(graph, 5)
    rows: list = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_gpu, args=(stop, rows), daemon=True)
    sampler.start()
    sustained = timed_replays(graph, a.sustained)
    stop.set()
    sampler.join()
    result["profiled_sustained"] = kernel_sum(graph, 10)
    tail = sustained[len(sustained) // 2:]
    result["sustained_ms_median_second_half"] = statistics.median(tail)
    result["sustained_ms_first5"] = sustained[:5]
    if rows:
        result["sustained_sm_mhz_median"] = statistics.median(r[0] for r in rows[len(rows) // 2:])
        result["sustained_power_w_median"] = statistics.median(r[1] for r in rows[len(rows) // 2:])
    burst = statistics.median(result["burst_ms"])
    k = result["profiled_after_idle"]
    result["gap_ms_after_idle"] = burst - k["kernel_ms_per_replay"]
    result["gap_us_per_kernel_after_idle"] = result["gap_ms_after_idle"] * 1000 / k["kernels_per_replay"]
    while engine.has_unfinished_requests():
        engine.step()
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
