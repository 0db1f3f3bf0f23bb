"""The engine process's loop (see engine_process.py): commands in, outputs out. A step's outputs
go to the parent from a sender thread (the Outbox) while the next step runs; when the parent
reads slowly, several steps' outputs travel in one message instead of the loop waiting."""
from __future__ import annotations

import gc
import logging
import queue
import sys
import threading
import time
from multiprocessing.connection import Connection

from ..config import EngineArgs
from .engine_process import pack_output
from .llm_engine import LLMEngine
from ..outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)


def run_engine_core(conn: Connection, args: EngineArgs) -> int:
    try:
        engine = LLMEngine(args, detokenize=False)  # the parent detokenizes (OutputDetokenizer)
    except Exception as exc:  # the parent raises it to whoever built the engine
        conn.send(("error", str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"))
        return 1
    # The engine's objects live as long as the process: a full collection need not walk them.
    gc.collect()
    gc.freeze()
    # The step loop shares this process's GIL with the Outbox thread (packing and pickling a
    # step's outputs) and the command reader; when it wants the GIL back it should wait at most
    # 1 ms for them, not the default 5 ms, which is most of a small model's step.
    sys.setswitchinterval(0.001)
    conn.send(("ready", {"engine_args": engine.args, "vocab_size": engine.vocab_size,
                         "kv_capacity_tokens": engine.input_processor.kv_capacity_tokens,
                         "eos_token_ids": engine.eos_token_ids}))
    inbox: queue.Queue = queue.Queue()
    outbox = Outbox(conn)

    def read_commands() -> None:
        # A blocking recv releases the GIL: commands wait here, not in the step loop.
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                inbox.put(("stop", None))
                return
            if message[0] == "check_grammar":  # compiled here, off the step loop (then cached)
                outbox.put(("grammar_checked", _check_grammar(engine, *message[1])))
                continue
            inbox.put(message)
            if message[0] == "stop":
                return

    threading.Thread(target=read_commands, name="tritium-core-rx", daemon=True).start()
    steps, step_s, step_cpu_s = 0, 0.0, 0.0
    busy_s, busy_since = 0.0, None  # time with requests in the engine, first step to last
    while True:
        if not _apply_commands(engine, inbox, outbox, block=not engine.has_unfinished_requests()):
            break
        if engine.has_unfinished_requests():
            start, start_cpu = time.perf_counter(), time.thread_time()
            busy_since = start if busy_since is None else busy_since
            outbox.put_outputs(engine.step(outbox.put_outputs))
            end = time.perf_counter()
            step_s += end - start
            step_cpu_s += time.thread_time() - start_cpu
            steps += 1
            if not engine.has_unfinished_requests():
                busy_s += end - busy_since
                busy_since = None
    if busy_since is not None:  # stopped with requests in flight
        busy_s += time.perf_counter() - busy_since
    outbox.put_outputs([o for rid in list(engine.requests)
                        if (o := engine.abort_request(rid, error="The engine is shutting down.")) is not None])
    outbox.put(("bye", None))
    outbox.close()
    st = outbox.stats
    # Where the time went: a step loop that waits for the device is device-bound; one whose
    # steps take much longer than its thread's CPU time (and the device wait) waits for the GIL
    # or for a core; busy time well beyond the steps' is spent between steps (taking commands);
    # time the sender thread spent blocked in send means the parent reads outputs slower than
    # they come.
    logger.info("engine process: %d steps in %.2f s (%.2f s of CPU on the step loop's thread) "
                "over %.2f s busy, of which %.2f s waiting for the device; %d outputs in %d "
                "messages, %.2f s packing and sending them; %d Triton compiles while serving (%.2f s)",
                steps, step_s, step_cpu_s, busy_s, engine.device_wait_s, st["outputs"], st["messages"],
                st["send_s"], engine.runner.compile_watch.compiles, engine.runner.compile_watch.seconds)
    return 0


class Outbox:
    """Messages to the parent, sent in order by a thread of their own, so that the step loop
    never waits for a parent that reads slowly; outputs queued meanwhile travel in one message."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.Queue = queue.Queue()
        self._closed = False  # the parent went away: drop what is left
        self.stats = {"messages": 0, "outputs": 0, "send_s": 0.0}
        self._thread = threading.Thread(target=self._run, name="tritium-core-tx", daemon=True)
        self._thread.start()

    def put(self, message: tuple) -> None:
        self._queue.put(message)

    def put_outputs(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._queue.put(("out", outputs))

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
            for message in batch:
                if message is not None and message[0] == "out":
                    outputs.extend(message[1])
                    continue
                self._send_outputs(outputs)
                outputs = []
                if message is None:
                    return
                self._send(message)
            self._send_outputs(outputs)

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            start = time.perf_counter()
            self._send(("out", [pack_output(o) for o in outputs]))
            self.stats["send_s"] += time.perf_counter() - start
            self.stats["messages"] += 1
            self.stats["outputs"] += len(outputs)

    def _send(self, message: tuple) -> None:
        if self._closed:
            return
        try:
            self._conn.send(message)
        except OSError:
            self._closed = True


def _check_grammar(engine: LLMEngine, token: int, spec: dict) -> tuple[int, str | None]:
    try:
        engine.input_processor.structured.compile(spec)
        return token, None
    except ValueError as e:
        return token, str(e)
    except Exception as e:  # the request is refused with it; the engine carries on
        logger.exception("structured outputs: compiling %r failed", spec)
        return token, f"structured_outputs: could not compile the spec: {e}"


def _apply_commands(engine: LLMEngine, inbox: queue.Queue, outbox: Outbox, block: bool) -> bool:
    """Apply queued commands; False when told to stop."""
    while True:
        try:
            kind, payload = inbox.get(timeout=0.5) if block else inbox.get_nowait()
        except queue.Empty:
            if block:
                continue
            return True
        block = False
        if kind == "stop":
            return False
        if kind == "add":
            try:
                engine.add_request(payload.request_id, payload)
            except Exception as exc:  # validated by the parent: should not happen
                logger.exception("could not add request %s", payload.request_id)
                outbox.put_outputs([RequestOutput(payload.request_id, None, [],
                                                  [CompletionOutput(0, "", [], None, None, "abort")],
                                                  True, error=f"internal error: {exc}")])
        elif kind == "abort":
            out = engine.abort_request(payload)
            outbox.put_outputs([out] if out is not None else [])
        elif kind == "stats":
            outbox.put(("stats", engine.get_stats()))
