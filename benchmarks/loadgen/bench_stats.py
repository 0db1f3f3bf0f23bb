"""Per-request timing records and the figures computed from them (no I/O, no Triton imports).

Definitions (the same for the Triton client and the in-process streaming bench):
- TTFT: first response carrying at least one token, minus the send time.
- ITL: gap between consecutive token-carrying responses divided by the tokens in the later one,
  counted once per token, so a response of k tokens contributes k samples.
- TPOT: (e2e - TTFT) / (output tokens - 1), per request.
- output tok/s: all output tokens / (last final response - first send).
"""
from __future__ import annotations

import math
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence, TextIO


@dataclass
class RequestTrace:
    """Timestamps (time.perf_counter seconds) of one streamed request."""

    request_id: str
    send_time: float = math.nan
    events: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in response)
    end_time: float = math.nan
    error: str | None = None

    def add_response(self, t: float, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"a response cannot carry {num_tokens} tokens.")
        self.events.append((t, num_tokens))

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.events)

    @property
    def ttft(self) -> float:
        for t, n in self.events:
            if n > 0:
                return t - self.send_time
        return math.nan

    @property
    def e2e(self) -> float:
        return self.end_time - self.send_time

    def itls(self) -> list[float]:
        out: list[float] = []
        prev: float | None = None
        for t, n in self.events:
            if n == 0:
                continue
            if prev is not None:
                out.extend([(t - prev) / n] * n)
            prev = t
        return out

    @property
    def tpot(self) -> float:
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else math.nan


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method); NaN when empty."""
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {p}.")
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return math.nan
    rank = p / 100.0 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def _mean(values: Iterable[float]) -> float:
    xs = [v for v in values if not math.isnan(v)]
    return sum(xs) / len(xs) if xs else math.nan


def _dist(values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    """mean / p50 / p99 in milliseconds (scale 1000)."""
    return {"mean": _mean(values) * scale, "p50": percentile(values, 50) * scale,
            "p99": percentile(values, 99) * scale}


def summarize(traces: Sequence[RequestTrace], expected_output_len: int | None = None) -> dict[str, Any]:
    """Throughput and latency figures of one run; latencies in ms."""
    ok = [t for t in traces if t.error is None and not math.isnan(t.end_time)]
    failed = len(traces) - len(ok)
    if not ok:
        return {"completed": 0, "failed": failed, "output_tokens": 0, "wall_s": math.nan,
                "output_tok_s": math.nan, "requests_s": math.nan}
    start = min(t.send_time for t in ok)
    end = max(t.end_time for t in ok)
    wall = end - start
    tokens = sum(t.output_tokens for t in ok)
    itls = [x for t in ok for x in t.itls()]
    decode_rates = [(t.output_tokens - 1) / (t.e2e - t.ttft) for t in ok
                    if t.output_tokens > 1 and t.e2e > t.ttft]
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": failed,
        "output_tokens": tokens,
        "wall_s": wall,
        # time.perf_counter() of the first send and the last response: one clock for every
        # process of the machine, to line the run up with a server's own timeline.
        "start_time": start,
        "end_time": end,
        "output_tok_s": tokens / wall if wall > 0 else math.nan,
        "requests_s": len(ok) / wall if wall > 0 else math.nan,
        "ttft_ms": _dist([t.ttft for t in ok]),
        "itl_ms": _dist(itls),
        "tpot_ms": _dist([t.tpot for t in ok]),
        "e2e_ms": _dist([t.e2e for t in ok]),
        # Per-request decode speed after the first token; the figure of merit for workload B.
        "decode_tok_s": _mean(decode_rates),
    }
    if expected_output_len is not None:
        # A run where requests stopped early measures a different workload: say so loudly.
        summary["wrong_length_requests"] = sum(1 for t in ok if t.output_tokens != expected_output_len)
    return summary


def format_summary(title: str, s: dict[str, Any]) -> str:
    if not s.get("completed"):
        return f"{title}: no request completed ({s.get('failed', 0)} failed)"
    lines = [
        f"{title}: {s['completed']} requests ({s['failed']} failed), {s['output_tokens']} output tokens "
        f"in {s['wall_s']:.2f} s",
        f"  output tok/s {s['output_tok_s']:,.1f}   requests/s {s['requests_s']:.2f}   "
        f"decode tok/s per request {s['decode_tok_s']:.1f}",
    ]
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        d = s[key]
        lines.append(f"  {label:<5} ms  mean {d['mean']:9.2f}  p50 {d['p50']:9.2f}  p99 {d['p99']:9.2f}")
    if s.get("wrong_length_requests"):
        lines.append(f"  WARNING: {s['wrong_length_requests']} requests did not return the expected length")
    return "\n".join(lines)


def tokens_in_response(output_names: Sequence[str], raw_outputs: Sequence[bytes]) -> int:
    """Tokens carried by one streamed response, from its raw gRPC outputs.

    Triton's gRPC responses carry every output in `raw_output_contents`, in the order of
    `outputs`. Prefer the server's own count (`num_output_tokens`: INT32, the delta of this
    response when streaming; UINT32 here, INT32 in some servers: the same bytes for counts);
    without it, a response with non-empty text counts as one token
    (what a streaming engine sends unless it coalesces). Parsing the bytes directly keeps the
    client's cost per response small."""
    text_raw: bytes | None = None
    for name, raw in zip(output_names, raw_outputs):
        if name == "num_output_tokens":
            if len(raw) % 4:
                raise ValueError(f"num_output_tokens: {len(raw)} bytes is not a whole number of INT32.")
            return sum(struct.unpack(f"<{len(raw) // 4}I", raw))
        if name == "text_output":
            text_raw = raw
    if text_raw is None:
        return 0
    # BYTES tensors are serialized as (uint32 little-endian length, bytes) per element.
    pos = 0
    while pos + 4 <= len(text_raw):
        (length,) = struct.unpack_from("<I", text_raw, pos)
        if length > 0:
            return 1
        pos += 4 + length
    return 0


class Progress:
    """One updating line on a terminal; a plain line every few seconds in a log file."""

    def __init__(self, title: str, total_requests: int, total_tokens: int,
                 stream: TextIO = sys.stderr) -> None:
        self.title, self.total_requests, self.total_tokens = title, total_requests, total_tokens
        self.stream = stream
        self.tty = stream.isatty()
        self.start = time.perf_counter()
        self._last = 0.0
        self.done = self.tokens = 0

    def update(self, done_delta: int = 0, token_delta: int = 0, force: bool = False) -> None:
        self.done += done_delta
        self.tokens += token_delta
        now = time.perf_counter()
        if not force and now - self._last < (0.2 if self.tty else 5.0):
            return
        self._last = now
        elapsed = now - self.start
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        line = (f"[{self.title}] {self.done}/{self.total_requests} req  "
                f"{self.tokens:,}/{self.total_tokens:,} tok  {rate:,.0f} tok/s  {elapsed:6.1f} s")
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        self.update(force=True)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
