"""The engine process's side (see engine_process.py): build the engine, run its EngineCore.

Commands arrive on a reader thread; a step's outputs go to the parent from a sender thread (the
Outbox) while the next step runs; when the parent reads slowly, several steps' outputs travel
in one message instead of the loop waiting. Run as `python -m tritium.drivers.process_main FD`.
"""
from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from ..config import EngineArgs
from ..outputs import RequestOutput
from ..engine.llm_engine import LLMEngine
from ..engine.metrics import EngineStats
from .engine_core import EngineCore
from .messages import (Bye, CheckGrammar, Outputs, Ready, Reply, Shutdown,
                       StartupFailed, StatsReply, fold_token_deltas, pack_output)

logger = logging.getLogger(__name__)


class Outbox:
    """The core's sink in the engine process: replies to the parent, sent in order by a thread
    of their own, so that the step loop never waits for a parent that reads slowly; outputs
    queued meanwhile travel in one message, each request's new tokens folded into one run."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.Queue[Reply | list[RequestOutput] | None] = queue.Queue()
        self._closed = False  # the parent went away: drop what is left
        self.stats = {"messages": 0, "outputs": 0, "bytes": 0, "send_s": 0.0}
        self._thread = threading.Thread(target=self._run, name="tritium-core-tx", daemon=True)
        self._thread.start()

    def outputs(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._queue.put(outputs)

    def stats_reply(self, stats: EngineStats) -> None:
        self._queue.put(StatsReply(stats))

    def put(self, reply: Reply) -> None:
        self._queue.put(reply)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            outputs: list[RequestOutput] = []
            steps = 0
            for item in batch:
                if isinstance(item, list):
                    outputs.extend(item)
                    steps += 1
                    continue
                self._send_outputs(outputs, steps)
                outputs, steps = [], 0
                if item is None:
                    return
                self._send(item)
            self._send_outputs(outputs, steps)

    def _send_outputs(self, outputs: list[RequestOutput], steps: int) -> None:
        if outputs:
            start = time.perf_counter()
            packed = [pack_output(o) for o in outputs]
            if steps > 1:  # the parent fell behind: each request's new tokens travel as one run
                packed = fold_token_deltas(packed)
            # Pickled here (as Connection.send would) to count the bytes that cross.
            data = ForkingPickler.dumps(Outputs(packed))
            self._send_bytes(data)
            self.stats["send_s"] += time.perf_counter() - start
            self.stats["bytes"] += len(data)
            self.stats["messages"] += 1
            self.stats["outputs"] += len(outputs)

    def _send(self, message: Reply) -> None:
        self._send_bytes(ForkingPickler.dumps(message))

    def _send_bytes(self, data: bytes | memoryview) -> None:
        if self._closed:
            return
        try:
            self._conn.send_bytes(data)
        except OSError:
            self._closed = True


class _Sink:
    """CoreSink over the Outbox."""

    def __init__(self, outbox: Outbox) -> None:
        self.outputs = outbox.outputs
        self.stats = outbox.stats_reply


def serve(conn: Connection, args: EngineArgs) -> int:
    try:
        engine = LLMEngine(args, detokenize=False)  # the parent detokenizes (OutputDetokenizer)
    except Exception as exc:  # the parent raises it to whoever built the engine
        conn.send(StartupFailed(str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"))
        return 1
    # The engine's objects live as long as the process: a full collection need not walk them.
    gc.collect()
    gc.freeze()
    # The step loop shares this process's GIL with the Outbox thread (packing and pickling a
    # step's outputs) and the command reader; when it wants the GIL back it should wait at most
    # 1 ms for them, not the default 5 ms, which is most of a small model's step.
    sys.setswitchinterval(0.001)
    conn.send(Ready(engine.config.model_config, engine.limits))
    outbox = Outbox(conn)
    core = EngineCore(engine, _Sink(outbox))

    def read_commands() -> None:
        # A blocking recv releases the GIL: commands wait here, not in the step loop.
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                core.submit(Shutdown())
                return
            if isinstance(command, CheckGrammar):  # compiled here, off the step loop (then cached)
                outbox.put(core.check_grammar(command))
                continue
            core.submit(command)
            if isinstance(command, Shutdown):
                return

    threading.Thread(target=read_commands, name="tritium-core-rx", daemon=True).start()
    core.run()
    engine.shutdown()  # the other tensor-parallel ranks, if any
    outbox.put(Bye())
    outbox.close()
    st, loop = outbox.stats, core.loop_stats
    # Where the time went: a step loop that waits for the device is device-bound; one whose
    # steps take much longer than its thread's CPU time (and the device wait) waits for the GIL
    # or for a core; busy time well beyond the steps' is spent between steps (taking commands);
    # time the sender thread spent blocked in send means the parent reads outputs slower than
    # they come.
    logger.info("engine process: %d steps in %.2f s (%.2f s of CPU on the step loop's thread) "
                "over %.2f s busy, of which %.2f s waiting for the device; %d outputs in %d "
                "messages (%d bytes), %.2f s packing and sending them; %d Triton compiles while serving (%.2f s)",
                loop["steps"], loop["step_s"], loop["step_cpu_s"], loop["busy_s"], engine.device_wait_s,
                st["outputs"], st["messages"], st["bytes"], st["send_s"], engine.executor.compile_watch.compiles,
                engine.executor.compile_watch.seconds)
    return 0


def main() -> None:
    # Ctrl-C reaches the whole process group: the parent (the server) decides when the engine
    # stops, and tells it (or closes the socket), so SIGINT must not raise in here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO)
    connection = Connection(int(sys.argv[1]))
    code = serve(connection, connection.recv())
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: extension modules' destructors (nanobind's leak report
    # from the Triton compiler's libraries) print lines an operator reads as failures.
    os._exit(code)


if __name__ == "__main__":
    main()
