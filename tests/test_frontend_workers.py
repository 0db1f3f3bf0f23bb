"""The frontend with several worker processes (python -m frontend --workers N): each listens on
the port with a socket of its own (SO_REUSEPORT), so connections spread over the workers; /health
answers 200 once every worker has started; SIGTERM stops them all."""
import os
import socket
import sys
import time

import httpx
import pytest

from frontend_server import start_frontend

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT spreading is Linux's")


@pytest.fixture(scope="module")
def stack(chat_stack, tmp_path_factory):
    """The shared server; this module runs frontends of its own, with workers."""
    return chat_stack[0], tmp_path_factory.mktemp("frontend_workers")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
        return [int(p) for p in f.read().split()]


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def _established(pid: int, port: int) -> int:
    """Connections to `port` that process `pid` has accepted (its sockets in /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    with open("/proc/net/tcp", encoding="ascii") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            local_port = int(cols[1].split(":")[1], 16)
            if local_port == port and cols[3] == "01" and cols[9] in inodes:  # 01: ESTABLISHED
                count += 1
    return count


def test_connections_spread_over_workers(stack):
    server, tmp = stack
    fe = start_frontend(server.grpc_url, str(tmp / "workers.log"), "--workers", "3", timeout=300)
    try:
        workers = [p for p in _children(fe.proc.pid) if b"resource_tracker" not in _cmdline(p)]
        # (ignore_eos: a sampled token may be the end of text, and the count is the point here)
        r = httpx.post(fe.url + "/v1/completions", json={"model": "llm", "prompt": [5, 6, 7], "max_tokens": 3,
                                                          "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        conns = [socket.create_connection(("127.0.0.1", fe.port)) for _ in range(48)]
        try:
            time.sleep(1.0)
            per_worker = sorted(_established(p, fe.port) for p in workers)
            assert sum(per_worker) == 48, per_worker
            # A hash of the connections' ports picks the worker: all three get some (a shared
            # socket gives a burst of connections to whichever worker wakes first).
            assert len(per_worker) == 3 and min(per_worker) >= 4, per_worker
        finally:
            for c in conns:
                c.close()
        # Each request on a connection of its own, so they land on several workers; whichever
        # worker answers /metrics counts them all (the workers share their metrics' files).
        for _ in range(6):
            r = httpx.post(fe.url + "/v1/completions", json={"model": "llm", "prompt": [5, 6], "max_tokens": 1},
                           timeout=60)
            assert r.status_code == 200
        for _ in range(3):
            text = httpx.get(fe.url + "/metrics", timeout=30).text
            assert 'http_requests_total{handler="/v1/completions",method="POST",status="200"} 7.0' in text, text
        with open(f"/proc/{workers[0]}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        metrics_dir = env[b"PROMETHEUS_MULTIPROC_DIR"].decode()
        assert os.path.isdir(metrics_dir)
    finally:
        fe.stop()
    assert not os.path.exists(metrics_dir)  # removed with the frontend
    assert fe.proc.returncode == 0
    assert not any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"
                   for p in workers)
