"""GET /metrics on the API port, as vLLM's server has it: the frontend's own request metrics and
the engines' `vllm:` families as Triton reports them, so that one scrape target serves both."""
from __future__ import annotations

import os
import re
import time
from urllib.parse import urlsplit
from typing import Any, Mapping

import aiohttp
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

# No *_created series (a timestamp per label set, which doubles the text for nothing), as in vLLM.
disable_created_metrics()

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # Triton's text format, which the vllm: families come in
# Several worker processes (--workers) share their metrics through files in this directory
# (prometheus_client's multiprocess mode); the parent process sets it before starting them.
MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)


def default_triton_metrics_url(triton_grpc: str) -> str:
    """Triton's metrics endpoint on the gRPC address's host, at tritonserver's default port."""
    host = urlsplit("//" + triton_grpc).hostname or "localhost"
    return f"http://{f'[{host}]' if ':' in host else host}:8002/metrics"


class FrontendMetrics:
    """The frontend's request counts by route, method and status, request latency (until the
    response's last byte, streams included) and requests in progress; vLLM's server exports the
    same families (prometheus-fastapi-instrumentator's names)."""

    def __init__(self, triton_metrics_url: str | None, model_names: Mapping[str, str] | None = None) -> None:
        """model_names: Triton model name -> the name this frontend serves it under (the first
        --served-model-name), for the vllm: families' model_name label."""
        self.triton_metrics_url = triton_metrics_url
        self.model_names = dict(model_names or {})
        self.registry = CollectorRegistry()
        self.requests = Counter("http_requests_total", "HTTP requests answered, by route, method "
                                "and status.", ["handler", "method", "status"], registry=self.registry)
        self.latency = Histogram("http_request_duration_seconds", "HTTP request latency until the "
                                 "response's last byte.", ["handler", "method"],
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.in_progress = Gauge("http_requests_in_progress", "HTTP requests being served.",
                                 ["method"], registry=self.registry, multiprocess_mode="livesum")
        self._session: aiohttp.ClientSession | None = None

    def middleware(self, app: Any) -> Any:
        """A plain ASGI middleware that records every HTTP request in these metrics."""

        async def measured(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            start, status = time.perf_counter(), 500
            method = scope["method"]
            in_progress = self.in_progress.labels(method)
            in_progress.inc()

            async def recorded_send(message: dict[str, Any]) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            try:
                await app(scope, receive, recorded_send)
            finally:
                in_progress.dec()
                route = scope.get("route")  # set by the router, also on a wrong method
                handler = getattr(route, "path", None) or "other"
                self.requests.labels(handler, method, str(status)).inc()
                self.latency.labels(handler, method).observe(time.perf_counter() - start)

        return measured

    async def exposition(self) -> bytes:
        """The text to answer GET /metrics with: these metrics, then Triton's vllm: families."""
        own = generate_latest(self._collected_registry())
        return own + await self._vllm_families()

    def _collected_registry(self) -> CollectorRegistry:
        if os.environ.get(MULTIPROC_DIR) is None:
            return self.registry
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry

    async def _vllm_families(self) -> bytes:
        if not self.triton_metrics_url:
            return b""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        try:
            async with self._session.get(self.triton_metrics_url) as r:
                if r.status != 200:
                    raise aiohttp.ClientError(f"HTTP {r.status}")
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            # A comment, which scrapers skip: the frontend's own metrics still count.
            why = " ".join(f"{type(e).__name__}: {e}".split())  # one line
            return f"# Triton's metrics at {self.triton_metrics_url} were not reachable ({why})\n".encode()
        return "".join(with_model_name(line, self.model_names) + "\n"
                       for line in text.splitlines() if _is_vllm(line)).encode()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _is_vllm(line: str) -> bool:
    """Whether a line of the text format belongs to a vllm: family (its sample or HELP/TYPE)."""
    if line.startswith("# "):
        parts = line.split(" ", 3)
        return len(parts) > 2 and parts[1] in ("HELP", "TYPE") and parts[2].startswith("vllm:")
    return line.startswith("vllm:")


_LABEL = re.compile(r'\s*([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"\s*,?')


def with_model_name(line: str, model_names: Mapping[str, str]) -> str:
    """A sample line with vLLM's `model_name` label, which its dashboards select on: the name
    this frontend serves the Triton model under (`model_names`), else Triton's model name.
    Triton's labels (`model`, `version`, ...) stay; a model_name already there (Tritium sets
    it to the Triton name) takes the served name. Other lines are returned as they are."""
    brace = line.find("{")
    if line.startswith("#") or brace < 0:
        return line
    labels, end = [], brace + 1
    while (m := _LABEL.match(line, end)) is not None:
        labels.append((m.group(1), m.group(2)))
        end = m.end()
    model = dict(labels).get("model")
    if line[end:end + 1] != "}" or model is None:  # not a label set read whole, or no model
        return line
    name = model_names.get(_unescape(model))
    value = model if name is None else _escape(name)
    if any(k == "model_name" for k, _ in labels):
        labels = [(k, value if k == "model_name" else v) for k, v in labels]
    else:
        labels.append(("model_name", value))
    return line[:brace + 1] + ",".join(f'{k}="{v}"' for k, v in labels) + line[end:]


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
