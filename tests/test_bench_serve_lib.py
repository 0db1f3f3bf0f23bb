"""benchmarks/lib/serve.sh, which benchmarks/triton.sh and benchmarks/frontend.sh source: its
wait for a server's URL answers once the server does, reports a server that exited with the end
of its log, and stop_tritonserver ends the process it started."""

import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bash(script: str, tmp_path) -> subprocess.CompletedProcess:
    prelude = f'ROOT="{ROOT}" PY="{sys.executable}"; cd "{tmp_path}"; source "{ROOT}/benchmarks/lib/serve.sh"\n'
    return subprocess.run(["bash", "-c", prelude + script], capture_output=True, text=True, timeout=60)


def test_wait_until_ok_waits_for_the_url(tmp_path):
    port = _free_port()
    done = _bash(f'(sleep 1; exec "$PY" -m http.server {port} --bind 127.0.0.1) > web.log 2>&1 &\n'
                 f'pid=$!\nwait_until_ok web "http://127.0.0.1:{port}/" "$pid" 30 web.log; rc=$?\n'
                 'kill "$pid"; exit $rc', tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("web ready after "), done.stdout


def test_wait_until_ok_reports_a_server_that_exited(tmp_path):
    port = _free_port()
    done = _bash(f'(echo "model failed to load"; exit 3) > web.log 2>&1 &\n'
                 f'wait_until_ok web "http://127.0.0.1:{port}/" $! 30 web.log', tmp_path)
    assert done.returncode == 1
    assert done.stdout == (f"web exited before http://127.0.0.1:{port}/ answered; its log ends:\n"
                           "model failed to load\n"), done.stdout


def test_stop_tritonserver_ends_the_server(tmp_path):
    done = _bash('sleep 300 & SERVER_PID=$!\nstop_tritonserver\n'
                 'kill -0 "$SERVER_PID" 2>/dev/null && echo "still running" || echo stopped', tmp_path)
    assert done.stdout.strip().splitlines()[-1] == "stopped", done.stdout + done.stderr
