"""Streaming load generator for the Tritium model over Triton gRPC.

One gRPC stream per request, as interactive clients do. Requests are spread over a few worker
processes (`--procs`), each with one channel and one asyncio loop, because a single Python
process's CPU time per streamed response would make the client itself the bottleneck. Prompts are token ids (`input_ids`): the tokenizer is not on the
measured path.

    tritium bench --workload A --url localhost:8001 --model llm --json a.json
    python -m benchmarks.loadgen.bench ...   (the same, from a checkout)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import sys
import time
from typing import Any, AsyncIterator

from .bench_stats import Progress, RequestTrace, format_summary, summarize, tokens_in_response
from .workloads import (DEFAULT_SEED, VOCAB_HIGH, VOCAB_LOW, WORKLOADS,
                        make_prompts, parse_vocab_range, resolve_workload)


def sampling_parameters(output_len: int, lora_name: str | None = None) -> str:
    # Exactly output_len tokens, greedy: the same work as the HF anchor and the offline bench.
    params: dict[str, Any] = {"max_tokens": output_len, "ignore_eos": True, "temperature": 0}
    if lora_name is not None:
        params["lora_name"] = lora_name
    return json.dumps(params)


def lora_names_for(num_requests: int, names: list[str]) -> list[str | None]:
    """The adapter of each request: the names in turn (none without names)."""
    return [names[i % len(names)] if names else None for i in range(num_requests)]


def build_inputs(prompt: list[int], output_len: int, send_text_input: bool,
                 lora_name: str | None = None) -> list[Any]:
    import numpy as np
    import tritonclient.grpc as grpcclient

    def tensor(name: str, dtype: str, value: Any) -> Any:
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    inputs = []
    if send_text_input:  # for servers whose interface requires text_input next to input_ids
        inputs.append(tensor("text_input", "BYTES", np.array([b""], dtype=np.object_)))
    inputs += [
        tensor("input_ids", "INT32", np.asarray(prompt, dtype=np.int32)),
        tensor("stream", "BOOL", np.array([True])),
        tensor("sampling_parameters", "BYTES",
               np.array([sampling_parameters(output_len, lora_name).encode()], dtype=np.object_)),
        tensor("exclude_input_in_output", "BOOL", np.array([True])),
        tensor("return_num_output_tokens", "BOOL", np.array([True])),
    ]
    return inputs


class _Counters:
    """Tokens and finished requests shared with the parent for the progress line."""

    def __init__(self, tokens: Any, done: Any) -> None:
        self.tokens, self.done = tokens, done

    def add(self, tokens: int = 0, done: int = 0) -> None:
        with self.tokens.get_lock():
            self.tokens.value += tokens
            self.done.value += done


async def _run_request(client: Any, model: str, inputs: list[Any], trace: RequestTrace,
                       counters: _Counters | None, sem: asyncio.Semaphore) -> None:
    async with sem:
        finished = asyncio.Event()

        async def requests() -> AsyncIterator[dict[str, Any]]:
            trace.send_time = time.perf_counter()
            yield {"model_name": model, "inputs": inputs, "request_id": trace.request_id,
                   "parameters": {"triton_enable_empty_final_response": True}}
            # Keep our half of the stream open until the final response: closing it early
            # is not something the benchmark should depend on.
            await finished.wait()

        try:
            async for result, error in client.stream_infer(requests()):
                now = time.perf_counter()
                if error is not None:
                    trace.error = str(error)
                    break
                resp = result.get_response()
                n = tokens_in_response([o.name for o in resp.outputs], resp.raw_output_contents)
                trace.add_response(now, n)
                if counters is not None and n:
                    counters.add(tokens=n)
                final = resp.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    trace.end_time = now
                    break
            else:
                trace.error = "stream ended without a final response"
        except Exception as exc:  # noqa: BLE001 - one failed request must not stop the run
            trace.error = f"{type(exc).__name__}: {exc}"
        finally:
            finished.set()
            if counters is not None:
                counters.add(done=1)


async def _run_shard(url: str, model: str, output_len: int, prompts: list[list[int]], first_index: int,
                     concurrency: int, send_text_input: bool, tag: str, loras: list[str | None],
                     counters: _Counters | None, barrier: Any) -> tuple[list[RequestTrace], float]:
    """One worker's requests; returns their traces and the CPU seconds spent while sending."""
    if url.startswith(("http://", "https://")):  # --openai: through the OpenAI frontend
        from .bench_openai import run_openai_shard
        return await run_openai_shard(url, model, output_len, prompts, first_index, concurrency,
                                      tag, counters, barrier)
    import tritonclient.grpc.aio as aioclient

    # Built before the clock starts: tensor packing is client work, not serving time.
    all_inputs = [build_inputs(p, output_len, send_text_input, lora) for p, lora in zip(prompts, loras)]
    traces = [RequestTrace(f"{tag}-{first_index + i}") for i in range(len(prompts))]
    client = aioclient.InferenceServerClient(url=url)
    try:
        await client.is_server_live()  # open the channel before the synchronized start
        if barrier is not None:
            await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
        cpu0 = time.process_time()
        sem = asyncio.Semaphore(max(1, concurrency))
        await asyncio.gather(*(_run_request(client, model, inp, tr, counters, sem)
                               for tr, inp in zip(traces, all_inputs)))
        cpu = time.process_time() - cpu0
    finally:
        await client.close()
    return traces, cpu


def _shard_main(shard_args: tuple, counters: _Counters, barrier: Any, results: Any) -> None:
    try:
        traces, cpu = asyncio.run(_run_shard(*shard_args, counters, barrier))
        results.put((shard_args[4], traces, cpu, None))
    except BaseException as exc:  # noqa: BLE001 - report instead of hanging the parent
        barrier.abort()
        results.put((shard_args[4], [], math.nan, f"{type(exc).__name__}: {exc}"))


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) slices of n items over `parts` near-equal shards (none empty)."""
    parts = max(1, min(parts, n))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def run_workload(url: str, model: str, output_len: int, prompts: list[list[int]], concurrency: int,
                 send_text_input: bool, tag: str, procs: int, show_progress: bool,
                 loras: list[str | None] | None = None) -> tuple[list[RequestTrace], list[float]]:
    """All requests, spread over `procs` processes started together; returns traces in prompt
    order and each process's CPU seconds. `loras`: each request's LoRA adapter (or None)."""
    loras = loras if loras is not None else [None] * len(prompts)
    ctx = mp.get_context("spawn")  # grpc does not survive fork
    shards = _split(len(prompts), procs)
    counters = _Counters(ctx.Value("q", 0), ctx.Value("q", 0))
    barrier = ctx.Barrier(len(shards))
    results = ctx.Queue()
    workers = []
    for start, end in shards:
        share = max(1, round(concurrency * (end - start) / len(prompts)))
        args = (url, model, output_len, prompts[start:end], start, share, send_text_input, tag,
                loras[start:end])
        workers.append(ctx.Process(target=_shard_main, args=(args, counters, barrier, results), daemon=True))
    for w in workers:
        w.start()
    progress = Progress(tag, len(prompts), len(prompts) * output_len) if show_progress else None
    collected: dict[int, tuple[list[RequestTrace], float, str | None]] = {}
    while len(collected) < len(workers):
        try:
            first, traces, cpu, err = results.get(timeout=0.2)
            collected[first] = (traces, cpu, err)
        except Exception:  # noqa: BLE001 - queue.Empty: just refresh the progress line
            if not any(w.is_alive() for w in workers) and results.empty():
                break
        if progress is not None:
            progress.done, progress.tokens = counters.done.value, counters.tokens.value
            progress.update()
    for w in workers:
        w.join(timeout=10)
    if progress is not None:
        progress.done, progress.tokens = counters.done.value, counters.tokens.value
        progress.close()
    traces: list[RequestTrace] = []
    cpus: list[float] = []
    for start, end in shards:
        shard_traces, cpu, err = collected.get(start, ([], math.nan, "worker died"))
        if err is not None or len(shard_traces) != end - start:
            shard_traces = [RequestTrace(f"{tag}-{i}", error=err or "lost") for i in range(start, end)]
        traces += shard_traces
        cpus.append(cpu)
    return traces, cpus


async def wait_ready(url: str, model: str, timeout_s: float) -> None:
    import tritonclient.grpc.aio as aioclient

    client = aioclient.InferenceServerClient(url=url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                if await client.is_model_ready(model):
                    return
            except Exception:  # noqa: BLE001 - server not up yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"model {model!r} at {url} not ready after {timeout_s:.0f} s")
            await asyncio.sleep(1.0)
    finally:
        await client.close()


def clean_json(obj: Any) -> Any:
    """JSON has no NaN: write null instead."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: clean_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clean_json(v) for v in obj]
    return obj


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    ap.add_argument("--openai", metavar="URL",
                    help="instead of gRPC: the OpenAI frontend's base URL (http://host:9000/v1), "
                         "driven with streaming completions of the same token-id prompts")
    ap.add_argument("--model", default="llm")
    ap.add_argument("--workload", choices=list(WORKLOADS),
                    help="named workload, benchmarks/loadgen/workloads.py (sizes below override it)")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--input-len", type=int)
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--concurrency", type=int, default=0, help="requests in flight; 0 = all at once")
    # Half the cores, up to 8: enough processes that none is the bottleneck at the small models'
    # streaming rates, and the server keeps its share of the machine.
    ap.add_argument("--procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                    help="client worker processes (default: half the cores, at most 8)")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--vocab-range", default=f"{VOCAB_LOW}:{VOCAB_HIGH}", help="prompt ids drawn from LOW:HIGH")
    ap.add_argument("--warmup", type=int, default=4, help="warm-up requests (other prompts) before timing")
    ap.add_argument("--warmup-output-len", type=int, default=16)
    ap.add_argument("--send-text-input", action="store_true",
                    help="also send an empty text_input (Tritium rejects text_input with input_ids)")
    ap.add_argument("--wait-ready", type=float, default=0.0, help="seconds to wait for the model first")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--lora-names", default="",
                    help="comma-separated LoRA adapters of the model, given to the requests in turn")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    workload = resolve_workload(args.workload, args.num_requests, args.input_len, args.output_len)
    low, high = parse_vocab_range(args.vocab_range)
    concurrency = args.concurrency or workload.num_requests
    if args.openai:
        if args.lora_names or args.send_text_input:
            ap.error("--openai takes neither --lora-names nor --send-text-input")
        args.url = args.openai.rstrip("/")
    if args.wait_ready > 0:
        if args.openai:
            from .bench_openai import wait_ready_openai
            asyncio.run(wait_ready_openai(args.url, args.wait_ready))
        else:
            asyncio.run(wait_ready(args.url, args.model, args.wait_ready))

    if args.warmup > 0:
        warm_prompts = make_prompts(args.warmup, workload.input_len, args.seed, "warmup", low, high)
        wt, _ = run_workload(args.url, args.model, args.warmup_output_len, warm_prompts, args.warmup,
                             args.send_text_input, "warmup", 1, False)
        errors = [t.error for t in wt if t.error]
        if errors:
            print(f"warm-up failed: {errors[0]}", file=sys.stderr)
            return 1

    names = [n for n in args.lora_names.split(",") if n]
    prompts = make_prompts(workload.num_requests, workload.input_len, args.seed, workload.name, low, high)
    traces, cpus = run_workload(args.url, args.model, workload.output_len, prompts, concurrency,
                                args.send_text_input, workload.name, args.procs, not args.no_progress,
                                lora_names_for(len(prompts), names))
    summary = summarize(traces, workload.output_len)
    # A saturated client understates the server: report the busiest worker's CPU share.
    if summary["completed"]:
        summary["client_cpu_fraction_max"] = max(cpus) / summary["wall_s"]
    # Responses (gRPC) or server-sent events (--openai) received: a server's cost is per event.
    summary["responses"] = sum(len(t.events) for t in traces)
    errors = sorted({t.error for t in traces if t.error})
    runner = "openai-completions-stream" if args.openai else "triton-grpc-stream"
    print(format_summary(f"{'openai-frontend' if args.openai else 'triton-grpc'} workload {workload.name}", summary))
    for e in errors[:5]:
        print(f"  error: {e}")
    if summary.get("client_cpu_fraction_max", 0) > 0.8:
        print("  WARNING: a client process was over 80% busy; raise --procs")

    if args.json:
        result = {
            "runner": runner,
            "workload": vars(workload) | {"vocab_range": [low, high], "seed": args.seed,
                                          "concurrency": concurrency, "procs": len(cpus)},
            "url": args.url, "model": args.model, "lora_names": names,
            "summary": summary,
            "errors": errors[:20],
            "per_request": {"ttft_ms": [t.ttft * 1000 for t in traces],
                            "e2e_ms": [t.e2e * 1000 for t in traces],
                            "output_tokens": [t.output_tokens for t in traces]},
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(clean_json(result), f, indent=1)
    ok = summary["completed"] == workload.num_requests and not summary.get("wrong_length_requests")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
