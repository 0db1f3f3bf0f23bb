"""A mixed load on one device, colocated against disaggregated prefill, in one invocation.

The load: --streams requests with short prompts and long outputs decode all the time (each slot
starts its next request when one ends; the first requests' lengths are staggered so that the
slots do not end together), and --long-prompts long prompts arrive among them (Poisson at
--long-rate a second from a seeded generator, or at fixed intervals), from the moment every
stream has its first token. The window closes when the last long prompt ends.

Two configurations, one after the other on the same device, each engine in a process of its
own (`EngineProcess`):
  colocated       one engine serves everything (gpu_memory_utilization: both shares together);
  disaggregated   a prefill engine (kv_producer) and a decode engine (kv_consumer) share the
                  device; the router here sends each request to the prefill engine (max_tokens 1,
                  kv_transfer_params {"do_remote_decode": true}), then to the decode engine with
                  the kv_transfer_params it returned, as vLLM's proxy does; the decode engine
                  reads the prompt's blocks through NIXL.
Per request: TTFT (arrival at the router to the first token; disaggregated, the prefill hop and
the transfer included) and inter-token latency (the gaps between streamed tokens), apart for the
streams and the long prompts; output tokens/s over the window; the decode engine's transfer
counters.

Then the check: --probes prompts sent one at a time, alone on the engines. Each is one token
past a whole number of blocks, and the colocated engine gets it twice: its second run finds the
prompt's blocks in its prefix cache and computes the last token alone, as the decode engine does
after its read; so the two compute the same numbers and their greedy tokens must be equal on any
device, unless the blocks that arrived are not the ones the prefill engine wrote. Under load the
configurations batch differently, and 16-bit sums of other shapes may round a near tie the other
way: those tokens must be equal with --check exact (the CPU's float32 default), and are reported
(the tokens in common) with --check quiet (CUDA's default).

    python -m benchmarks.engine.disagg_mixed_load --json out.json          # Llama-3-8B shapes, CUDA
    python -m benchmarks.engine.disagg_mixed_load --device cpu --json out.json   # tiny sizes

On the CPU the run checks the code end to end, not speed: each engine's NIXL agent keeps a
progress thread polling on a core of its own, which a machine of few cores misses.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from benchmarks.engine.disagg_report import commit, compare, print_table
from benchmarks.engine.engine_cli import engine_values
from benchmarks.loadgen.bench_stats import percentile
from benchmarks.loadgen.workloads import make_prompts
from tritium import EngineArgs, EngineProcess, SamplingParams

# Sizes per device where no flag gives them: the CPU's run a check that the code works end to end.
DEFAULTS = {
    "cuda": {"model": "models/configs/llama-3-8b", "tokenizer": "models/tiny-llama", "dtype": "bfloat16",
             "streams": 64, "stream_prompt_len": 128, "stream_output_len": 512, "long_prompts": 32,
             "long_prompt_len": 4096, "long_output_len": 128, "long_rate": 1.5, "warmup": 2},
    "cpu": {"model": "models/tiny-llama", "tokenizer": None, "dtype": "float32",
            "streams": 4, "stream_prompt_len": 16, "stream_output_len": 24, "long_prompts": 2,
            "long_prompt_len": 64, "long_output_len": 8, "long_rate": 4.0, "warmup": 1},
}
NIXL = {"kv_connector": "NixlConnector"}


@dataclass
class Req:
    rid: str
    kind: str  # "stream" or "long"
    prompt: list[int]
    max_tokens: int
    slot: int = -1  # a stream's slot
    arrival: float = 0.0
    times: list[float] = field(default_factory=list)  # when each token reached the router
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    error: str | None = None


def greedy(max_tokens: int, kv_transfer_params: dict | None = None) -> SamplingParams:
    extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


class Colocated:
    """One engine: a request goes to it as it is."""

    def __init__(self, engine, events: queue.Queue) -> None:
        self.engine, self.events = engine, events

    def submit(self, req: Req) -> None:
        self.engine.add_request(req.rid, req.prompt, greedy(req.max_tokens), self._callback(req.rid))

    def _callback(self, rid: str) -> Callable:
        return lambda out: self.events.put((rid, "tokens", out, time.perf_counter()))

    def engines(self) -> dict[str, Any]:
        return {"engine": self.engine}


class Disaggregated(Colocated):
    """vLLM's proxy: the prefill engine computes the prompt and one token, which is dropped;
    the decode engine gets the request again with the parameters the prefill engine returned."""

    def __init__(self, prefill, decode, events: queue.Queue) -> None:
        super().__init__(decode, events)
        self.prefill = prefill
        self.missing_params = 0  # prefills that returned no kv_transfer_params (decode recomputes)

    def submit(self, req: Req) -> None:
        params = greedy(1, {"do_remote_decode": True})
        self.prefill.add_request(req.rid, req.prompt, params,
                                 lambda out, rid=req.rid: self.events.put((rid, "prefilled", out, time.perf_counter())))

    def forward(self, req: Req, out) -> None:
        self.missing_params += out.kv_transfer_params is None
        self.engine.add_request(req.rid, req.prompt, greedy(req.max_tokens, out.kv_transfer_params),
                                self._callback(req.rid))

    def engines(self) -> dict[str, Any]:
        return {"prefill": self.prefill, "decode": self.engine}


class LoadRun:
    """The main thread's loop: arrivals on time, the engines' outputs as events (the receiver
    threads only stamp and queue them), a stream slot refilled when its request ends."""

    def __init__(self, router: Colocated | Disaggregated, events: queue.Queue, args: argparse.Namespace) -> None:
        self.router, self.events, self.args = router, events, args
        self.reqs: dict[str, Req] = {}
        self.generation = [0] * args.streams
        self.refill = False

    def start(self, req: Req) -> None:
        req.arrival = time.perf_counter()
        self.reqs[req.rid] = req
        self.router.submit(req)

    def stream(self, slot: int) -> Req:
        a, g = self.args, self.generation[slot]
        self.generation[slot] += 1
        # First requests end at staggered times, so that the slots refill one by one.
        length = a.stream_output_len if g else max(1, a.stream_output_len * (slot + 1) // a.streams)
        prompt = make_prompts(1, a.stream_prompt_len, a.seed, f"stream-{slot}-{g}")[0]
        return Req(f"s{slot}g{g}", "stream", prompt, length, slot)

    def pump(self, timeout: float) -> None:
        """Handle the events that arrive within `timeout` seconds (at least the first one)."""
        try:
            item = self.events.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.events.get_nowait()
            except queue.Empty:
                return

    def _handle(self, rid: str, stage: str, out, now: float) -> None:
        req = self.reqs[rid]
        if req.finished:
            return
        if out.error is not None:
            req.error, req.finished = str(out.error), True
            return
        if stage == "prefilled":
            if out.finished:
                self.router.forward(req, out)
            return
        new = out.outputs[0].token_ids if out.outputs else []
        # Tokens that travelled together (the engine process folds steps when the parent lags)
        # share the gap since the previous token evenly.
        last = req.times[-1] if req.times else now
        for i in range(len(new)):
            req.times.append(now if not req.times else last + (now - last) * (i + 1) / len(new))
        req.tokens += new
        if out.finished:
            req.finished = True
            if req.kind == "stream" and self.refill:
                self.start(self.stream(req.slot))

    def wait(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.perf_counter() + self.args.timeout_s
        while not done():
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{what} did not end within {self.args.timeout_s:.0f} s")
            self.pump(0.5)

    def warm_up(self) -> None:
        """Requests of both shapes through the whole path first, so that neither configuration
        pays first-time costs (kernel compiles, the NIXL connection) in its timings."""
        a = self.args
        if not a.warmup:
            return
        warm = [Req(f"wl{i}", "long", p, a.long_output_len)
                for i, p in enumerate(make_prompts(a.warmup, a.long_prompt_len, a.seed, "warm-long"))]
        warm += [Req(f"ws{i}", "stream", p, 8)
                 for i, p in enumerate(make_prompts(a.warmup, a.stream_prompt_len, a.seed, "warm-stream"))]
        for req in warm:
            self.start(req)
        self.wait(lambda: all(r.finished for r in warm), "the warm-up")

    def measure(self) -> tuple[float, float]:
        a = self.args
        self.refill = True
        streams = [self.stream(s) for s in range(a.streams)]
        for req in streams:
            self.start(req)
        self.wait(lambda: all(r.times or r.finished for r in streams), "the streams' first tokens")
        t0 = time.perf_counter()
        rng, offset, arrivals = random.Random(f"{a.seed}:arrivals"), 0.0, []
        for _ in range(a.long_prompts):
            offset += 1.0 / a.long_rate if a.fixed_interval else rng.expovariate(a.long_rate)
            arrivals.append(t0 + offset)
        longs = [Req(f"l{i}", "long", p, a.long_output_len)
                 for i, p in enumerate(make_prompts(a.long_prompts, a.long_prompt_len, a.seed, "long"))]
        pending = list(zip(arrivals, longs))
        deadline = time.perf_counter() + a.timeout_s
        while pending or not all(r.finished for r in longs):
            now = time.perf_counter()
            if now > deadline:
                raise TimeoutError(f"the long prompts did not end within {a.timeout_s:.0f} s")
            while pending and pending[0][0] <= now:
                self.start(pending.pop(0)[1])
            self.pump(min(pending[0][0] - now, 0.5) if pending else 0.5)
        self.refill = False
        return t0, time.perf_counter()

    def probe(self, repeat: bool) -> dict[str, list[int]]:
        """The check's prompts one at a time; with `repeat` each runs three times and the
        second run's tokens count as q<i> (its blocks are then prefix-cache hits but for the
        last token); the third's, as r<i>, say whether the engine repeats itself exactly."""
        a, block = self.args, self.args.block_size
        tokens = {}
        for i in range(a.probes):
            long = i % 2 == 0
            length = (a.long_prompt_len if long else a.stream_prompt_len) // block * block + 1
            prompt = make_prompts(1, length, a.seed, f"probe-{i}")[0]
            for rid in [f"w-q{i}", f"q{i}", f"r{i}"] if repeat else [f"q{i}"]:
                req = Req(rid, "probe", prompt, a.probe_output_len)
                self.start(req)
                self.wait(lambda: req.finished, f"probe {rid}")
                if req.error:
                    raise RuntimeError(f"probe {rid} failed: {req.error}")
                tokens[rid] = req.tokens
        return tokens


def _ms(values: list[float], p: float) -> float:
    return percentile(values, p) * 1e3


def summarize(run: LoadRun, t0: float, t1: float) -> dict[str, Any]:
    """The window's figures: the long prompts whole; streams that arrived in the window for
    TTFT, and the streams' token gaps that end in it for ITL."""
    reqs = [r for r in run.reqs.values() if not r.rid.startswith("w")]
    errors = {r.rid: r.error for r in reqs if r.error}
    longs = [r for r in reqs if r.kind == "long"]
    streams = [r for r in reqs if r.kind == "stream"]
    long_ttft = [r.times[0] - r.arrival for r in longs if r.times]
    long_itl = [b - a for r in longs for a, b in zip(r.times, r.times[1:])]
    stream_ttft = [r.times[0] - r.arrival for r in streams if r.times and t0 <= r.arrival <= t1]
    stream_itl = [b - a for r in streams for a, b in zip(r.times, r.times[1:]) if t0 <= b <= t1]
    out_tokens = sum(1 for r in reqs for t in r.times if t0 <= t <= t1)
    return {"window_s": t1 - t0, "long_requests": len(longs), "stream_requests_in_window": len(stream_ttft),
            "output_tokens_in_window": out_tokens, "output_tok_s": out_tokens / (t1 - t0),
            "long_ttft_p50_ms": _ms(long_ttft, 50), "long_ttft_p99_ms": _ms(long_ttft, 99),
            "long_itl_p50_ms": _ms(long_itl, 50), "long_itl_p99_ms": _ms(long_itl, 99),
            "stream_ttft_p50_ms": _ms(stream_ttft, 50), "stream_ttft_p99_ms": _ms(stream_ttft, 99),
            "stream_itl_p50_ms": _ms(stream_itl, 50), "stream_itl_p99_ms": _ms(stream_itl, 99),
            "stream_itl_samples": len(stream_itl), "errors": errors}


def engine_args(values: dict[str, str], memory: float, role: str | None) -> EngineArgs:
    extra = {"gpu_memory_utilization": str(memory)}
    if role is not None:
        extra["kv_transfer_config"] = json.dumps({**NIXL, "kv_role": role})
    return EngineArgs.from_strings({**values, **extra})


@contextlib.contextmanager
def visible_gpu(index: int):
    """The engine process started inside sees one card (it inherits the environment), as a
    Triton model instance with its own GPU does."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = str(index)
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def run_configuration(name: str, args: argparse.Namespace, values: dict[str, str]) -> tuple[dict, dict]:
    """Start the configuration's engines, warm up, measure, read the counters, stop them.
    Returns (figures, each finished request's tokens)."""
    events: queue.Queue = queue.Queue()
    started, startup = time.perf_counter(), {}
    p, d = args.prefill_memory, args.decode_memory
    if name == "colocated" and args.decode_gpu is not None:  # the card the decode engine gets
        with visible_gpu(args.decode_gpu):
            router: Colocated | Disaggregated = Colocated(EngineProcess(engine_args(values, d, None)), events)
        startup["engine"] = time.perf_counter() - started
    elif name == "colocated":
        router = Colocated(EngineProcess(engine_args(values, p + d, None)), events)
        startup["engine"] = time.perf_counter() - started
    elif args.device == "cpu":  # no memory shares to respect: both start at once
        with ThreadPoolExecutor(2) as pool:
            starts = [pool.submit(EngineProcess, engine_args(values, p, role))
                      for role in ("kv_producer", "kv_consumer")]
            prefill, decode = (s.result() for s in starts)
        startup["prefill and decode"] = time.perf_counter() - started
        router = Disaggregated(prefill, decode, events)
    elif args.prefill_gpu is not None:  # a card each: the read crosses NVLink or PCIe
        with visible_gpu(args.prefill_gpu):
            prefill = EngineProcess(engine_args(values, p, "kv_producer"))
        startup["prefill"] = time.perf_counter() - started
        with visible_gpu(args.decode_gpu):
            decode = EngineProcess(engine_args(values, d, "kv_consumer"))
        startup["decode"] = time.perf_counter() - started - startup["prefill"]
        router = Disaggregated(prefill, decode, events)
    else:
        prefill = EngineProcess(engine_args(values, p, "kv_producer"))
        startup["prefill"] = time.perf_counter() - started
        # gpu_memory_utilization caps all the memory in use on the device, other processes'
        # included (worker/warmup.py sizes the cache as total * share - others - own peak): the
        # decode engine, started second, sees the prefill engine's memory and is given both shares.
        decode = EngineProcess(engine_args(values, p + d, "kv_consumer"))
        startup["decode"] = time.perf_counter() - started - startup["prefill"]
        router = Disaggregated(prefill, decode, events)
    run = LoadRun(router, events, args)
    try:
        run.warm_up()
        before = {k: e.get_stats() for k, e in router.engines().items()}
        t0, t1 = run.measure()
        after = {k: e.get_stats() for k, e in router.engines().items()}
        probes = run.probe(repeat=name == "colocated")
    finally:
        for engine in reversed(list(router.engines().values())):  # the decode engine first: it reads the other
            engine.shutdown()
    figures = {"startup_s": startup, **summarize(run, t0, t1),
               "preemptions": {k: after[k].num_preemptions - before[k].num_preemptions for k in after}}
    if isinstance(router, Disaggregated):
        a, b = after["decode"], before["decode"]
        seconds = a.kv_transfer_seconds - b.kv_transfer_seconds
        nbytes = a.kv_transfer_bytes - b.kv_transfer_bytes
        figures["transfer"] = {"transfers": a.kv_transfers - b.kv_transfers,
                               "blocks": a.kv_transfer_blocks - b.kv_transfer_blocks, "bytes": nbytes,
                               "seconds": seconds, "gb_s": nbytes / seconds / 1e9 if seconds else 0.0,
                               "prefills_without_params": router.missing_params}
    tokens = {r.rid: r.tokens for r in run.reqs.values()
              if r.finished and not r.error and r.kind in ("stream", "long")}
    return figures, {**tokens, **probes}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--model", help="a config directory for dummy weights (default: per device)")
    ap.add_argument("--tokenizer")
    ap.add_argument("--dtype")
    ap.add_argument("--engine-arg", action="append", default=[], help="KEY=VALUE for every engine")
    for name in ("streams", "stream_prompt_len", "stream_output_len", "long_prompts", "long_prompt_len",
                 "long_output_len", "warmup"):
        ap.add_argument("--" + name.replace("_", "-"), type=int)
    ap.add_argument("--long-rate", type=float, help="long prompts a second")
    ap.add_argument("--fixed-interval", action="store_true", help="arrivals 1/rate apart (default: Poisson)")
    ap.add_argument("--prefill-memory", type=float, default=0.45, help="the prefill engine's share of the device")
    ap.add_argument("--decode-memory", type=float, default=0.45, help="the decode engine's share")
    ap.add_argument("--prefill-gpu", type=int, help="with --decode-gpu: each engine on a card of its own "
                    "(the colocated engine on the decode card), each share of its own card")
    ap.add_argument("--decode-gpu", type=int)
    ap.add_argument("--check", choices=("exact", "quiet", "off"),
                    help="greedy tokens that must agree: all (exact; the CPU's default) or the probes' (quiet)")
    ap.add_argument("--probes", type=int, default=4, help="prompts sent alone after the window, long and short")
    ap.add_argument("--probe-output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=53)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="for each phase of a configuration")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if (args.prefill_gpu is None) != (args.decode_gpu is None) or (args.prefill_gpu is not None and args.device != "cuda"):
        ap.error("--prefill-gpu and --decode-gpu go together, on CUDA")
    if args.check is None:
        args.check = "exact" if args.device == "cpu" else "quiet"
    if args.long_rate <= 0 or args.streams < 1 or args.long_prompts < 1 or args.probes < 1:
        ap.error("--long-rate, --streams, --long-prompts and --probes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    values = {**engine_values(args), "device": args.device, "dtype": args.dtype}
    values.update(kv.split("=", 1) for kv in args.engine_arg)  # (over the device's dtype too)
    config = engine_args(values, args.prefill_memory, None)
    if not config.enable_prefix_caching:
        print("the probes need prefix caching (the colocated engine's second run)", file=sys.stderr)
        return 2
    args.block_size = config.block_size
    results, tokens, failed = {}, {}, {}
    for name in ("colocated", "disaggregated"):
        try:
            results[name], tokens[name] = run_configuration(name, args, values)
        except Exception as exc:  # (the other configuration's figures are still worth keeping)
            failed[name] = f"{type(exc).__name__}: {exc}"
            print(f"{name} FAILED: {failed[name]}", file=sys.stderr)
    check = compare(tokens.get("colocated", {}), tokens.get("disaggregated", {}), args.check)
    if args.device == "cuda":  # asked only now: a CUDA context here earlier would take engine memory
        import torch
        device = torch.cuda.get_device_name()
    else:
        device = args.device
    print_table(args, device, results, check)
    errors = {k: r["errors"] for k, r in results.items() if r["errors"]}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": device, "commit": commit(), "args": vars(args), "engine_args": values,
                       "configurations": results, "failed": failed, "tokens_check": check,
                       # The probes' tokens, every run of each: what a difference, or an engine
                       # that answers one prompt two ways, is made of.
                       "probe_tokens": {name: {rid: t for rid, t in runs.items() if rid[0] in "qrw"}
                                        for name, runs in tokens.items()}}, f, indent=1)
    if errors:
        print(f"REQUESTS FAILED: {json.dumps(errors)[:2000]}", file=sys.stderr)
    if args.check != "off" and not check["ok"]:
        print(f"GREEDY TOKENS DIFFER between colocated and disaggregated: {check['differ']} "
              f"(request: tokens in common)", file=sys.stderr)
    return 1 if failed or errors or (args.check != "off" and not check["ok"]) else 0


if __name__ == "__main__":
    sys.exit(main())
