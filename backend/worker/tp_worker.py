"""A tensor-parallel rank other than 0: `python -m tritium.worker.tp_worker FD RANK SIZE PORT`.

It builds its shard of the model and of the KV cache, and its CUDA graphs, with the same Worker
code as rank 0 (the start-up runs in lockstep), then follows rank 0: each message from the pipe
(see worker_group.py) is a piece of device work whose collectives it joins. A step is the
scheduler's output itself, which its runner applies to its own states and runs by the path rank
0 takes too (`ModelRunner.follow_step`, the code rank 0 runs, with rank 0's input ids). It
samples nothing. It exits when told to, when rank 0's pipe closes, or when its parent process goes away."""
from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)


class Peer:
    """A worker rank's end of rank 0's start-up handshakes (WorkerGroup.exchange)."""

    def __init__(self, conn: Connection, rank: int) -> None:
        self.conn, self.rank = conn, rank

    def exchange(self, tag: str, value):
        from .worker_group import Exchange
        self.conn.send(Exchange(tag, value))
        reply = self.conn.recv()
        if not isinstance(reply, Exchange) or reply.tag != tag:
            raise SystemExit(0)  # rank 0 gave up (its own start-up failed): Stop
        return reply.value


def _exit_with_parent(parent: int) -> None:
    """A rank never outlives the engine process that started it."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def follow(worker, conn: Connection) -> None:
    """Run rank 0's device work until Stop (or its pipe closes)."""
    import torch
    with torch.inference_mode():
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return
            if not handle(worker, message):
                return


def handle(worker, message) -> bool:
    """Run one message of rank 0's; False for Stop."""
    import torch

    from ..layers.parallel_state import tp_broadcast
    from .worker_group import LogitsCall, StepCall, Stop
    runner = worker.runner
    if isinstance(message, StepCall):
        for name, path in message.adapter_dirs.items():
            worker.lora_manager.add_adapter(name, path)
        runner.follow_step(message.step)
    elif isinstance(message, LogitsCall):
        hidden = tp_broadcast(torch.empty(message.rows, worker.model.config.hidden_size, dtype=runner.dtype,
                                          device=runner.device))
        runner.model.compute_logits(hidden)
    elif isinstance(message, Stop):
        return False
    else:
        raise RuntimeError(f"unexpected message {message!r}")
    return True


def main(fd: int, rank: int, size: int, port: int) -> int:
    conn = Connection(fd)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    try:
        config = conn.recv()
        import torch

        from ..layers.parallel_state import destroy_tp_group, init_tp_group
        from .device import resolve_device
        from .worker import Worker
        if resolve_device(config.device_config).type == "cuda":
            torch.cuda.set_device(rank)  # rank r on the r-th visible GPU
        device = resolve_device(config.device_config)
        peer = Peer(conn, rank)
        peer.exchange("hello", os.getpid())
        init_tp_group(rank, size, port, device)
        worker = Worker(config, rank=rank, link=peer)
        follow(worker, conn)
        del worker  # its CUDA graphs hold NCCL work: gone before the communicator is destroyed
        destroy_tp_group()
        return 0
    except SystemExit as exc:
        return int(exc.code or 0)
    except BaseException as exc:
        from .worker_group import Failed
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        try:
            conn.send(Failed(rank, f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main(*(int(a) for a in sys.argv[1:5])))
