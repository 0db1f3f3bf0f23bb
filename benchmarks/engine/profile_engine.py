"""Where an engine step's time goes, on the GPU: scheduling, booking and launching (host side),
text work (overlapped), waiting for the device, taking the tokens, and with speculative decoding
the proposals and their verification. Runs a throughput workload in-process
with dummy weights and prints a table; writes JSON with --json.

    python3 -m benchmarks.engine.profile_engine --model models/configs/llama-3-8b --tokenizer models/tiny-llama \
        --num-requests 256 --input-len 512 --output-len 64 [--engine-arg enforce_eager=true]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
import warnings
from collections import defaultdict

from benchmarks.engine.engine_cli import add_engine_arguments, engine_values
from tritium import EngineArgs, LLMEngine, SamplingParams


def _lone_ttft(engine, rng, input_len: int, tag: str) -> list[float]:
    ttft_ms = []
    for i in range(3):
        engine.add_request(f"ttft-{tag}{i}", [rng.randrange(100, 500) for _ in range(input_len)],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        s = time.perf_counter()
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = (time.perf_counter() - s) * 1000
        ttft_ms.append(round(first, 2))
    return ttft_ms


def _watch_triton_compiles() -> dict:
    """Record (step, kernel name) whenever Triton compiles a kernel (or loads it from its disk
    cache): a compile inside the timed run is a stall that serving would see too."""
    state = {"step": -1, "seen": []}
    try:
        import triton
        from triton.runtime.jit import JITFunction
    except ImportError:
        return state

    def hook(*args, **kwargs):
        # repr names the kernel, its launch options and each argument's specialization
        state["seen"].append([state["step"], str(kwargs.get("repr", args[1] if len(args) > 1 else ""))[:600]])
        return False  # go on and compile

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
        knobs.runtime.jit_cache_hook = hook
    else:
        JITFunction.cache_hook = hook
    return state


def _alloc_retries(torch) -> int:
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


@contextlib.contextmanager
def _recording_syncs(torch, caught: list):
    """torch's sync debug mode warns on every operation that synchronises with the device
    (a blocking copy, .item(), nonzero, ...); the warnings go into `caught`, not to stderr."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(0)
            caught.extend(seen)


def _sync_report(caught: list) -> list:
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            counts[(str(w.message)[:200], f"{w.filename}:{w.lineno}")] += 1
    return [[m, where, n] for (m, where), n in sorted(counts.items(), key=lambda kv: -kv[1])]


class TimedEngine(LLMEngine):
    """LLMEngine that records the host time of each part of its step and brackets each launch
    with CUDA events. A subclass, so the engine's classes and the runner stay as they are."""

    def __init__(self, args: EngineArgs) -> None:
        super().__init__(args)
        import torch
        self._torch = torch
        self.times: dict[str, list[float]] = defaultdict(list)
        self.events: list = []  # (before, after, prefill tokens in the step) per launch, CUDA only
        self.last: dict[str, int] = {}  # the latest launched step's batched tokens and decodes
        process = self.output_processor.process
        self.output_processor.process = lambda requests: self._timed("text", process, requests)

    def _timed(self, name: str, fn, *args, **kw):
        s = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            self.times[name].append(time.perf_counter() - s)

    def step(self, deliver=None):
        parts = ("propose", "book_and_launch", "tokens", "sample_deferred", "text")
        before = sum(sum(self.times[k]) for k in parts)
        s = time.perf_counter()
        out = super().step(deliver)
        # What the parts below do not cover: the scheduler, mostly.
        inner = sum(sum(self.times[k]) for k in parts) - before
        self.times["schedule_and_rest"].append(time.perf_counter() - s - inner)
        return out

    def _propose(self):
        return self._timed("propose", super()._propose)

    def _launch(self, sched, outputs):
        torch = self._torch
        self.last = {"tokens": sched.num_batched_tokens,
                     "decodes": sum(1 for it in sched.scheduled if it.num_new_tokens == 1)}
        if not torch.cuda.is_available():
            return self._timed("book_and_launch", super()._launch, sched, outputs)
        before = torch.cuda.Event(enable_timing=True)
        before.record()
        out = self._timed("book_and_launch", super()._launch, sched, outputs)
        after = torch.cuda.Event(enable_timing=True)
        after.record()
        self.events.append((before, after, sum(it.num_new_tokens for it in sched.scheduled
                                               if it.num_new_tokens > 1)))
        return out

    def _take_results(self, inflight, outputs):
        waited = self.device_wait_s
        out = self._timed("tokens", super()._take_results, inflight, outputs)
        self.times["wait"].append(self.device_wait_s - waited)  # inside "tokens"
        return out

    def _verify(self, inflight, results):
        return self._timed("tokens.verify", super()._verify, inflight, results)

    def _sample_deferred(self, inflight, outputs):
        return self._timed("sample_deferred", super()._sample_deferred, inflight, outputs)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_engine_arguments(ap)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json")
    a = ap.parse_args()
    values = engine_values(a)
    t0 = time.perf_counter()
    engine = TimedEngine(EngineArgs.from_strings(values))
    startup = time.perf_counter() - t0
    import torch
    times, events = engine.times, engine.events
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    # warm-up (compiles kernels outside the timed region)
    engine.add_request("warm", [rng.randrange(100, 500) for _ in range(a.input_len)], params)
    while engine.has_unfinished_requests():
        engine.step()
    # time to first token of a lone request, a few times (a first-use cost shows as an outlier)
    ttft_ms = _lone_ttft(engine, rng, a.input_len, "before")
    times.clear()
    events.clear()
    compiles = _watch_triton_compiles()
    retries_before = _alloc_retries(torch)
    for i in range(a.num_requests):
        engine.add_request(str(i), [rng.randrange(100, 500) for _ in range(a.input_len)], params)
    steps = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start, start_cpu = time.perf_counter(), time.thread_time()
    syncs: list = []
    with _recording_syncs(torch, syncs):
        while engine.has_unfinished_requests():
            s = time.perf_counter()
            compiles["step"] = len(steps)
            engine.step()
            steps.append((engine.last.get("tokens", 0), engine.last.get("decodes", 0), time.perf_counter() - s))
    wall = time.perf_counter() - start
    loop_cpu = time.thread_time() - start_cpu
    ttft_after = _lone_ttft(engine, rng, a.input_len, "after")  # the same, with a full cache
    tokens = a.num_requests * a.output_len
    dec = [t for n, d, t in steps if n == d and d >= a.num_requests * 0.9]
    big = [(n, t) for n, d, t in steps if n - d >= 1024]
    gpu = {}
    if events:
        torch.cuda.synchronize()
        busy = {"prefill": 0.0, "decode": 0.0}
        idle = {"prefill": 0.0, "decode": 0.0}
        for i, (before, after, prefill) in enumerate(events):
            phase = "prefill" if prefill else "decode"
            busy[phase] += before.elapsed_time(after)
            if i + 1 < len(events):  # > 0 only when the device waited for the host's next launch
                idle[phase] += max(0.0, after.elapsed_time(events[i + 1][0]))
        step_gpu_ms = [round(b.elapsed_time(e), 2) for b, e, _ in events]
        gpu = {"gpu_span_ms": events[0][0].elapsed_time(events[-1][1]),
               "gpu_busy_ms": busy, "gpu_idle_after_step_ms": idle,
               "steps_by_phase": {"prefill": sum(1 for e in events if e[2]),
                                  "decode": sum(1 for e in events if not e[2])}}
    summary = {
        "startup_s": startup, "wall_s": wall, "loop_thread_cpu_s": loop_cpu, "output_tok_s": tokens / wall, "steps": len(steps),
        "num_kv_blocks": engine.executor.worker.num_blocks,
        "decode_steps_full_batch": len(dec),
        "decode_step_ms_median": sorted(dec)[len(dec) // 2] * 1000 if dec else None,
        "mixed_prefill_steps": len(big),
        "mixed_step_tokens_per_s": sum(n for n, _ in big) / sum(t for _, t in big) if big else None,
        "mixed_step_ms_median": sorted(t for _, t in big)[len(big) // 2] * 1000 if big else None,
        "phase_ms_mean": {k: sum(v) / len(v) * 1000 for k, v in times.items() if v},
        "phase_ms_total": {k: sum(v) * 1000 for k, v in times.items()},
        "engine_args": values,
        **gpu,
        "lone_request_ttft_ms": ttft_ms,
        "lone_request_ttft_after_run_ms": ttft_after,
        # Triton compiles (or loads from its disk cache) during the timed run: (step, kernel)
        "triton_compiles_in_run": compiles["seen"],
        "allocator_retries_in_run": _alloc_retries(torch) - retries_before,
        # operations that synchronised with the device during the run (torch's sync debug mode;
        # event waits are by design and not reported): message and where, with counts
        "synchronizing_calls": _sync_report(syncs),
        # the slowest steps: (index, batched tokens, decodes, host ms, GPU ms between the
        # launch's first and last event; the eager launch of a prefill step is GPU-bound)
        "slowest_steps": sorted(([i, n, d, round(t * 1000, 2)] for i, (n, d, t) in enumerate(steps)),
                                key=lambda r: -r[3])[:12],
    }
    if gpu:
        # steps that launch a forward have events; map them by order (decode-only steps too)
        for row in summary["slowest_steps"]:
            row.append(step_gpu_ms[row[0]] if row[0] < len(step_gpu_ms) else None)
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
