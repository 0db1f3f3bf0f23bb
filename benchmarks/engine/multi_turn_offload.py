"""What the prefix cache's host tier (swap_space) gains on a multi-turn chat whose reused
prefixes exceed the device's KV cache, in-process: the same workload without and with
swap_space, TTFT p50/p99, throughput and prefix-cache hit rates (device, host), then the
host<->device copy bandwidth the swap path achieves against the link's, in the same process.

The workload: N conversations of T turns. A conversation starts with a system prompt of its own
(--system-len tokens); each turn appends a user message (--user-len tokens) to the conversation
so far and asks for a reply (--output-len tokens, greedy, ignore_eos); the reply joins the
conversation. Conversations take turns round-robin, at most --concurrency requests in flight, so
between two turns of one conversation every other conversation runs a turn: when the
conversations together hold more tokens than the device cache (--engine-arg num_kv_blocks=...),
a conversation's prefix is evicted before its next turn and is either computed again (without
swap_space) or copied back from host memory (with it).

The copy bandwidth, two ways. While serving: the bytes the with-swap run copied each way over
the time its copies took (CUDA events around each batch on the copy stream, `HostKVCache.
copy_log`), so contention with the forward passes shows. The probe, after the workload on the
with-swap engine: the worker's own batched copies (`HostKVCache.swap_out` / `swap_in`: one
gather or scatter on the device and runs of page-locked host blocks, in batches of at most its
staging size) of --probe-blocks blocks, against one plain copy of a page-locked buffer of the
same size each way (the link's figure).

    python -m benchmarks.engine.multi_turn_offload --model models/configs/llama-3-8b \
        --tokenizer models/tiny-llama --engine-arg num_kv_blocks=2048 --swap-space 24 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from typing import Any

from benchmarks.engine.engine_cli import add_engine_arguments, engine_values
from benchmarks.loadgen.bench_stats import percentile
from benchmarks.loadgen.workloads import make_prompts


def conversations(args) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each conversation's system prompt and its T user messages (the same on every run)."""
    systems = make_prompts(args.conversations, args.system_len, 11, "mt-system")
    users = [make_prompts(args.turns, args.user_len, 12, f"mt-user-{c}") for c in range(args.conversations)]
    return systems, users


def warm_up(engine, args, params) -> None:
    """A few requests of the workload's shapes, so that neither run pays first-time costs
    (compiles, graph pools) in its timings."""
    for i, prompt in enumerate(make_prompts(min(args.concurrency, 4), args.system_len + args.user_len, 13, "mt-warm")):
        engine.add_request(f"warm{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


def run_workload(engine, args, params) -> dict[str, Any]:
    """The conversations, round-robin, on one engine: per-turn TTFT, the replies, and the
    engine's counters over the run."""
    systems, users = conversations(args)
    history = [list(s) for s in systems]
    turn = [0] * args.conversations
    ready = deque(range(args.conversations))
    inflight: dict[str, tuple[int, float]] = {}  # request id -> (conversation, time added)
    first_token: dict[str, float] = {}
    replies: dict[str, list[int]] = {}
    ttft: list[float] = []
    replies_by_turn: list[list[int]] = []
    before = engine.get_stats()
    t0 = time.perf_counter()
    prompt_tokens = 0
    while ready or inflight:
        while ready and len(inflight) < args.concurrency:
            c = ready.popleft()
            history[c] += users[c][turn[c]]
            rid = f"c{c}t{turn[c]}"
            engine.add_request(rid, list(history[c]), params)
            inflight[rid] = (c, time.perf_counter())
            replies[rid] = []
            prompt_tokens += len(history[c])
        for out in engine.step():
            rid = out.request_id
            if out.error is not None:
                raise RuntimeError(f"request {rid} failed: {out.error}")
            if out.outputs and out.outputs[0].token_ids:
                replies[rid] += out.outputs[0].token_ids  # (the engine's outputs are deltas)
                if rid not in first_token:
                    first_token[rid] = time.perf_counter()
                    ttft.append(first_token[rid] - inflight[rid][1])
            if out.finished:
                c, _ = inflight.pop(rid)
                history[c] += replies[rid]
                replies_by_turn.append(replies[rid])
                turn[c] += 1
                if turn[c] < args.turns:
                    ready.append(c)
    seconds = time.perf_counter() - t0
    after = engine.get_stats()

    def delta(name: str) -> int:
        return getattr(after, name) - getattr(before, name)
    queries, hits, host = delta("prefix_cache_queries"), delta("prefix_cache_hits"), delta("external_prefix_cache_hits")
    output_tokens = sum(len(r) for r in replies_by_turn)
    return {"requests": len(replies_by_turn), "seconds": seconds, "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "output_tok_s": output_tokens / seconds,
            "total_tok_s": (prompt_tokens + output_tokens) / seconds,
            "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
            "ttft_mean_ms": sum(ttft) / len(ttft) * 1e3,
            "prefix_queries": queries, "device_hit_rate": (hits - host) / queries if queries else 0.0,
            "host_hit_rate": host / queries if queries else 0.0, "computed_prompt_tokens": queries - hits,
            "blocks_offloaded": delta("num_blocks_offloaded"), "blocks_reloaded": delta("num_blocks_reloaded"),
            "preemptions": delta("num_preemptions"), "replies": {k: v for k, v in sorted(replies.items())}}


def log_copies(engine) -> list[tuple[str, int, Any, Any]]:
    """Start logging the worker's swap copies: on a GPU, CUDA events around each batch's copies
    on the copy stream (HostKVCache.copy_log); on the CPU (synchronous), wall-clock times."""
    host = engine.executor.worker.runner.host_cache
    log: list[tuple[str, int, Any, Any]] = []
    if host.copy_stream is not None:
        host.copy_log = log
        return log
    block_bytes = host.host[0].numel()
    for direction, name in (("out", "_swap_out"), ("in", "_swap_in")):
        def timed(pairs, real=getattr(host, name), direction=direction):
            t = time.perf_counter()
            real(pairs)
            log.append((direction, len(pairs) * block_bytes, t, time.perf_counter()))
        setattr(host, name, timed)
    return log


def copy_bandwidth(log: list[tuple[str, int, Any, Any]]) -> dict[str, float]:
    """Bytes each way over the time the copies took (the copy stream's busy time on a GPU)."""
    import torch
    if log and not isinstance(log[0][2], float):
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for direction in ("out", "in"):
        rows = [r for r in log if r[0] == direction]
        seconds = sum((end - start) if isinstance(start, float) else start.elapsed_time(end) / 1e3
                      for _, _, start, end in rows)
        nbytes = sum(r[1] for r in rows)
        out[f"swap_{direction}_bytes"] = nbytes
        out[f"swap_{direction}_gb_s"] = nbytes / seconds / 1e9 if seconds else 0.0
    return out


def probe_bandwidth(engine, num_blocks: int, rounds: int) -> dict[str, Any]:
    """GB/s of the worker's batched swap copies of `num_blocks` blocks each way, and of one plain
    page-locked copy of the same bytes each way (the link)."""
    import torch
    worker = engine.executor.worker
    host = worker.runner.host_cache
    block_bytes = host.host[0].numel()
    cuda = host.device.type == "cuda"
    n = min(num_blocks, host.num_blocks, worker.num_blocks)
    if cuda:  # the link's copy needs a device buffer of the same size
        n = max(1, min(n, int(torch.cuda.mem_get_info(host.device)[0] * 0.5) // block_bytes))
    nbytes = n * block_bytes
    sync = (lambda: torch.cuda.synchronize(host.device)) if cuda else (lambda: None)

    def timed(fn) -> float:
        fn()  # warm: staging memory, index tensors
        sync()
        best = float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t)
        return nbytes / best / 1e9
    # The device blocks' contents are overwritten: the engine is not used after the probe.
    pairs = list(zip(range(n), range(n)))
    swap_out = timed(lambda: host.swap_out(pairs))
    swap_in = timed(lambda: host.swap_in(pairs))
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    device = torch.empty(nbytes, dtype=torch.uint8, device=host.device)
    d2h = timed(lambda: pinned.copy_(device, non_blocking=True))
    h2d = timed(lambda: device.copy_(pinned, non_blocking=True))
    return {"blocks": n, "block_bytes": block_bytes, "bytes": nbytes, "staging_batch_blocks": host.max_batch,
            "swap_out_gb_s": swap_out, "swap_in_gb_s": swap_in, "link_d2h_gb_s": d2h, "link_h2d_gb_s": h2d,
            "device": str(host.device)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(ap)  # --engine-arg KEY=VALUE for both runs, e.g. num_kv_blocks=2048
    ap.add_argument("--swap-space", type=float, default=16.0, help="GiB of host memory for the with-swap run")
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--user-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--probe-blocks", type=int, default=1024)
    ap.add_argument("--probe-rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from tritium import EngineArgs, LLMEngine, SamplingParams
    values = engine_values(args)
    if "swap_space" in values:
        ap.error("give the host memory with --swap-space (the first run has none)")
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    runs: dict[str, dict[str, Any]] = {}
    probe: dict[str, Any] = {}
    for name, extra in (("device only", {}), (f"swap_space={args.swap_space:g}", {"swap_space": str(args.swap_space)})):
        engine = LLMEngine(EngineArgs.from_strings({**values, **extra}))
        cache = {"device_blocks": engine.block_manager.num_blocks, "host_blocks": engine.executor.num_host_blocks,
                 "block_size": engine.block_manager.block_size}
        warm_up(engine, args, params)
        log = log_copies(engine) if extra else []
        runs[name] = {**cache, **run_workload(engine, args, params)}
        if extra:
            runs[name]["copies_while_serving"] = copy_bandwidth(log)
            probe = probe_bandwidth(engine, args.probe_blocks, args.probe_rounds)
        engine.shutdown()
        del engine
    base, swap = runs.values()
    same = base["replies"] == swap["replies"]
    longest = args.system_len + args.turns * (args.user_len + args.output_len)
    print(f"\nmulti-turn chat, {args.model}: {args.conversations} conversations x {args.turns} turns "
          f"(system {args.system_len}, user {args.user_len}, reply {args.output_len} tokens; up to {longest} "
          f"a prompt), {args.concurrency} in flight; device cache {base['device_blocks']} blocks of "
          f"{base['block_size']} ({base['device_blocks'] * base['block_size']} tokens) for "
          f"{args.conversations * longest} tokens of conversations")
    print(f"{'run':<22} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'out tok/s':>10} {'total tok/s':>11} "
          f"{'device hit':>10} {'host hit':>9} {'computed':>9} {'offloaded':>9} {'reloaded':>9} {'preempt':>7}")
    for name, r in runs.items():
        print(f"{name:<22} {r['ttft_p50_ms']:>11.1f} {r['ttft_p99_ms']:>11.1f} {r['output_tok_s']:>10,.1f} "
              f"{r['total_tok_s']:>11,.1f} {r['device_hit_rate']:>10.1%} {r['host_hit_rate']:>9.1%} "
              f"{r['computed_prompt_tokens']:>9} {r['blocks_offloaded']:>9} {r['blocks_reloaded']:>9} "
              f"{r['preemptions']:>7}")
    print(f"replies equal in both runs: {same}")
    served = swap["copies_while_serving"]
    print(f"copies while serving: to host {served['swap_out_bytes'] / 2**30:.2f} GiB at "
          f"{served['swap_out_gb_s']:.2f} GB/s, to device {served['swap_in_bytes'] / 2**30:.2f} GiB at "
          f"{served['swap_in_gb_s']:.2f} GB/s (bytes over the copies' own time)")
    print(f"copies of {probe['blocks']} blocks of {probe['block_bytes']} bytes ({probe['bytes'] / 2**20:.1f} MiB, "
          f"batches of {probe['staging_batch_blocks']} blocks) on {probe['device']}: swap out "
          f"{probe['swap_out_gb_s']:.2f} GB/s, swap in {probe['swap_in_gb_s']:.2f} GB/s; one page-locked copy "
          f"(the link): to host {probe['link_d2h_gb_s']:.2f} GB/s, to device {probe['link_h2d_gb_s']:.2f} GB/s")
    if args.json:
        for r in runs.values():
            r.pop("replies")
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "args": vars(args), "engine_args": values, "runs": runs,
                       "replies_equal": same, "bandwidth": probe}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
