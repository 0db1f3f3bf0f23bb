"""One worker's requests through an OpenAI-compatible server (the frontend): streaming
completions whose prompts are the workload's token ids, read with aiohttp (not the openai
package, so that the client stays cheap per event). Used by benchmarks/loadgen/bench.py --openai URL.

Tokens per event come from vLLM's `stream_options.continuous_usage_stats` (cumulative usage in
every chunk): an event may carry several tokens when the server folded responses."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from .bench_stats import RequestTrace


def request_body(model: str, prompt: list[int], output_len: int) -> dict[str, Any]:
    # Exactly output_len tokens, greedy: the same work as the gRPC runner.
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def _run_request(session: Any, url: str, body: dict[str, Any], trace: RequestTrace,
                       counters: Any, sem: asyncio.Semaphore) -> None:
    async with sem:
        seen = 0
        trace.send_time = time.perf_counter()
        try:
            async with session.post(url + "/completions", json=body) as resp:
                if resp.status != 200:
                    trace.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    now = time.perf_counter()
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        trace.end_time = now
                        break
                    event = json.loads(data)
                    if "error" in event:
                        trace.error = event["error"].get("message", str(event["error"]))
                        break
                    if not event.get("choices"):
                        continue  # the closing usage chunk
                    n = (event.get("usage") or {}).get("completion_tokens", seen) - seen
                    seen += n
                    trace.add_response(now, n)
                    if counters is not None and n:
                        counters.add(tokens=n)
                else:
                    trace.error = "stream ended without [DONE]"
        except Exception as exc:  # noqa: BLE001 - one failed request must not stop the run
            trace.error = f"{type(exc).__name__}: {exc}"
        finally:
            if counters is not None:
                counters.add(done=1)


async def run_openai_shard(url: str, model: str, output_len: int, prompts: list[list[int]],
                           first_index: int, concurrency: int, tag: str, counters: Any,
                           barrier: Any) -> tuple[list[RequestTrace], float]:
    """Like bench._run_shard, through `url` (an OpenAI base URL, e.g. http://host:9000/v1)."""
    import aiohttp

    bodies = [request_body(model, p, output_len) for p in prompts]
    traces = [RequestTrace(f"{tag}-{first_index + i}") for i in range(len(prompts))]
    connector = aiohttp.TCPConnector(limit=0)  # one connection per stream, none queued
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.get(url + "/models") as r:  # the server answers before the start
            r.raise_for_status()
        if barrier is not None:
            await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
        cpu0 = time.process_time()
        sem = asyncio.Semaphore(max(1, concurrency))
        await asyncio.gather(*(_run_request(session, url, b, tr, counters, sem)
                               for b, tr in zip(bodies, traces)))
        cpu = time.process_time() - cpu0
    return traces, cpu


async def wait_ready_openai(url: str, timeout_s: float) -> None:
    """Until the server's /health (beside /v1) answers 200."""
    import aiohttp

    health = url.rstrip("/").removesuffix("/v1") + "/health"
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(health) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{health} not healthy after {timeout_s:.0f} s")
            await asyncio.sleep(1.0)
