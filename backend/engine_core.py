"""The engine process's loop (see engine_process.py): commands in, outputs out, one message of
outputs per step, sent while the step's successor runs on the device."""
from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from multiprocessing.connection import Connection

from .config import EngineArgs
from .llm_engine import LLMEngine
from .outputs import RequestOutput

logger = logging.getLogger(__name__)


def run_engine_core(conn: Connection, args: EngineArgs) -> int:
    from .engine_process import pack_output

    try:
        engine = LLMEngine(args, detokenize=False)  # the parent detokenizes (OutputDetokenizer)
    except Exception as exc:  # the parent raises it to whoever built the engine
        conn.send(("error", str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"))
        return 1
    # The engine's objects live as long as the process: a full collection need not walk them.
    gc.collect()
    gc.freeze()
    conn.send(("ready", {"engine_args": engine.args, "vocab_size": engine.vocab_size,
                         "kv_capacity_tokens": engine.input_processor.kv_capacity_tokens,
                         "eos_token_ids": engine.eos_token_ids}))
    inbox: queue.Queue = queue.Queue()

    def read_commands() -> None:
        # A blocking recv releases the GIL: commands wait here, not in the step loop.
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                inbox.put(("stop", None))
                return
            inbox.put(message)
            if message[0] == "stop":
                return

    threading.Thread(target=read_commands, name="tritium-core-rx", daemon=True).start()

    # Where the loop's time goes, logged at exit: time blocked in conn.send means the parent
    # reads outputs slower than the engine makes them (the socket buffer is full).
    timing = {"steps": 0, "step_s": 0.0, "send_s": 0.0, "sends": 0, "outputs": 0}

    def send_outputs(outputs: list[RequestOutput]) -> None:
        if outputs:
            start = time.perf_counter()
            conn.send(("out", [pack_output(o) for o in outputs]))
            timing["send_s"] += time.perf_counter() - start
            timing["sends"] += 1
            timing["outputs"] += len(outputs)

    while True:
        if not _apply_commands(engine, inbox, conn, send_outputs, block=not engine.has_unfinished_requests()):
            break
        if engine.has_unfinished_requests():
            start = time.perf_counter()
            send_outputs(engine.step(send_outputs))
            timing["step_s"] += time.perf_counter() - start
            timing["steps"] += 1
    logger.info("engine process: %d steps in %.2f s, of which %.2f s packing and sending %d outputs "
                "in %d messages and %.2f s waiting for the device", timing["steps"], timing["step_s"],
                timing["send_s"], timing["outputs"], timing["sends"], engine.device_wait_s)
    send_outputs([o for rid in list(engine.requests)
                  if (o := engine.abort_request(rid, error="The engine is shutting down.")) is not None])
    try:
        conn.send(("bye", None))
    except OSError:
        pass
    return 0


def _apply_commands(engine: LLMEngine, inbox: queue.Queue, conn: Connection, send_outputs,
                    block: bool) -> bool:
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
                conn.send(("out", [(payload.request_id, True, f"internal error: {exc}", 0,
                                    [(0, "", [], None, None, "abort", None)])]))
        elif kind == "abort":
            out = engine.abort_request(payload)
            send_outputs([out] if out is not None else [])
        elif kind == "stats":
            conn.send(("stats", engine.get_stats()))
