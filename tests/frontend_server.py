"""Start the OpenAI frontend (python -m frontend) beside a test tritonserver, on a free port."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from triton_server import ROOT, TEST_ENGINE_ARGS, TritonServer, _free_ports, http_request, start_server, write_model_repository

from scripts.build_default_model import add_chat_template


@dataclass
class Frontend:
    proc: subprocess.Popen
    port: int
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 100) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_frontend(grpc_url: str, log_path: str, *args: str, timeout: float = 60.0) -> Frontend:
    """python -m frontend on a free port; waits until /health answers 200."""
    (port,) = _free_ports(1)
    log = open(log_path, "w", encoding="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "tritium.frontend", "--triton-grpc", grpc_url,
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "info", *args],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    fe = Frontend(proc, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if http_request(fe.url + "/health", timeout=5)[0] == 200:
                return fe
        except OSError:
            pass
        time.sleep(0.3)
    fe.stop()
    raise RuntimeError(f"the frontend did not become healthy; its log:\n{fe.log_tail()}")


def chat_model(tiny_model: str, dest: str) -> str:
    """A copy of the tiny model with its chat template (the shared build may predate it)."""
    model = os.path.join(dest, "tiny-llama-chat")
    shutil.copytree(tiny_model, model)
    add_chat_template(model)
    return model


def start_stack(tiny_model: str, tmp: str) -> tuple[TritonServer, Frontend, str]:
    """tritonserver serving the tiny chat model as 'llm', and the frontend in front of it."""
    model = chat_model(tiny_model, tmp)
    repo = write_model_repository(os.path.join(tmp, "repo"), {"model": model, **TEST_ENGINE_ARGS})
    server = start_server(repo, os.path.join(tmp, "tritonserver.log"))
    try:
        frontend = start_frontend(server.grpc_url, os.path.join(tmp, "frontend.log"), "--triton-metrics",
                                  f"http://127.0.0.1:{server.metrics_port}/metrics")
    except BaseException:
        server.stop()
        raise
    return server, frontend, model
