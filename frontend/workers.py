"""Several server processes on one port, each with its own socket (SO_REUSEPORT), so that the
kernel spreads connections over them; `python -m frontend --workers N` (N > 1, Linux)."""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
from multiprocessing.connection import wait as wait_for_exit
from typing import Any

from tritium.frontend.cli import config_from, parse_args
from tritium.frontend.app import create_app
from tritium.frontend.metrics import MULTIPROC_DIR


# Set in each worker process by _worker: how many workers have finished starting, of how many.
_STARTED: tuple[Any, int] | None = None


def app_factory():  # uvicorn's factory in a worker of serve_workers
    config = config_from(parse_args(json.loads(os.environ["TRITIUM_FRONTEND_ARGV"])))
    assert _STARTED is not None, "frontend.workers.app_factory runs in a worker process only"
    counter, workers = _STARTED

    def started() -> None:
        with counter.get_lock():
            counter.value += 1

    return create_app(config, on_started=started, all_started=lambda: counter.value >= workers)


def _uvicorn_config(args: argparse.Namespace, **kw: Any) -> Any:
    import uvicorn

    return uvicorn.Config("tritium.frontend.workers:app_factory", factory=True, loop=args.loop,
                          log_level=args.log_level, timeout_graceful_shutdown=5, **kw)


def _worker(argv_json: str, counter: Any, workers: int) -> None:
    """One server process of several. Each binds its own socket to the port with SO_REUSEPORT,
    so that the kernel spreads new connections over the workers evenly (by a hash of the
    connection's addresses). With one socket shared by all workers, whichever worker wakes first
    accepts every pending connection (asyncio accepts up to the backlog per wake-up), and a burst
    of requests lands mostly on one or two workers. The socket is bound but not listening until
    uvicorn has run the app's start-up (tokenizers loaded): until then the kernel sends this
    worker no connections."""
    import uvicorn

    global _STARTED
    os.environ["TRITIUM_FRONTEND_ARGV"] = argv_json
    _STARTED = (counter, workers)
    args = parse_args(json.loads(argv_json))
    family, kind, proto, _, addr = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(addr)
    uvicorn.Server(_uvicorn_config(args)).run(sockets=[sock])


def serve_workers(argv: list[str], workers: int) -> int:
    """Start `workers` processes (_worker) and keep them running: one that exits is replaced,
    until SIGTERM or SIGINT, which is passed on to every worker."""
    ctx = mp.get_context("spawn")
    counter = ctx.Value("i", 0)
    argv_json = json.dumps(argv)
    stopping = False

    def start() -> Any:
        p = ctx.Process(target=_worker, args=(argv_json, counter, workers), daemon=False)
        p.start()
        return p

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    procs = [start() for _ in range(workers)]
    rc = 0
    while not stopping:
        wait_for_exit([p.sentinel for p in procs], timeout=0.5)
        for i, p in enumerate(procs):
            if stopping or p.exitcode is None:
                continue
            if counter.value < workers:  # failed while starting (port taken, bad config): give up
                print(f"frontend worker {p.pid} exited ({p.exitcode}) while starting", flush=True)
                stopping, rc = True, 1
                break
            print(f"frontend worker {p.pid} exited ({p.exitcode}); starting another", flush=True)
            _forget_metrics_of(p.pid)
            with counter.get_lock():
                counter.value -= 1
            procs[i] = start()
    for p in procs:
        if p.exitcode is None:
            p.terminate()  # SIGTERM: uvicorn's graceful shutdown
    for p in procs:
        p.join(timeout=15)
        if p.exitcode is None:
            p.kill()
            p.join()
    return rc


def _forget_metrics_of(pid: int) -> None:
    """Drop a dead worker's requests in progress from the shared metrics (its counts stay)."""
    if os.environ.get(MULTIPROC_DIR):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
