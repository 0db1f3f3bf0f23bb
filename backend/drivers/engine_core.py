"""EngineCore: the engine's busy loop, the same for both drivers.

Commands are queued from any thread and applied between steps; while requests are unfinished
the loop steps the engine and hands each step's outputs to the sink as soon as they are made.
`StreamingEngine` runs it on a thread of the server's process; the engine process
(`process_main`) runs it as its main loop, with the Outbox as its sink.
"""
from __future__ import annotations

import logging
import queue
import time

from ..errors import ENGINE_SHUTTING_DOWN, ErrorKind, RequestError
from ..outputs import RequestOutput
from ..engine.llm_engine import LLMEngine
from .messages import (AbortRequest, AddRequest, CheckGrammar, CoreSink, GetStats, GrammarChecked, Shutdown,
                       error_output)

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5


class EngineCore:
    def __init__(self, engine: LLMEngine, sink: CoreSink) -> None:
        self.engine = engine
        self._sink = sink
        self._inbox: queue.Queue = queue.Queue()
        self._next_idle_poll = 0.0  # (time.monotonic)
        # Where the loop's time goes (logged when it stops): steps, their wall and CPU time,
        # and the time with requests in the engine, first step to last.
        self.loop_stats = {"steps": 0, "step_s": 0.0, "step_cpu_s": 0.0, "busy_s": 0.0}

    def submit(self, command: AddRequest | AbortRequest | GetStats | Shutdown) -> None:
        """From any thread; applied before the next step."""
        self._inbox.put(command)

    def check_grammar(self, command: CheckGrammar) -> GrammarChecked:
        """Compile a structured-output spec (then cached for its request); from any thread,
        so that a compile never stalls the step loop."""
        try:
            self.engine.input_processor.structured.compile(command.spec)
            return GrammarChecked(command.token, None)
        except ValueError as e:
            return GrammarChecked(command.token, str(e))
        except Exception as e:  # the request is refused with it; the engine carries on
            logger.exception("structured outputs: compiling %r failed", command.spec)
            return GrammarChecked(command.token, f"structured_outputs: could not compile the spec: {e}")

    def run(self) -> None:
        """Until a Shutdown command; then every request still in the engine, and every one
        queued after the last step, ends with an error output."""
        engine, st = self.engine, self.loop_stats
        busy_since = None
        while self._apply_commands(block=not engine.has_unfinished_requests()):
            if not engine.has_unfinished_requests():
                continue
            start, start_cpu = time.perf_counter(), time.thread_time()
            busy_since = start if busy_since is None else busy_since
            self._emit(engine.step(self._emit))
            end = time.perf_counter()
            st["step_s"] += end - start
            st["step_cpu_s"] += time.thread_time() - start_cpu
            st["steps"] += 1
            if not engine.has_unfinished_requests():
                st["busy_s"] += end - busy_since
                busy_since = None
        if busy_since is not None:  # stopped with requests in flight
            st["busy_s"] += time.perf_counter() - busy_since
        self._emit([o for rid in list(engine.requests)
                    if (o := engine.abort_request(rid, error=ENGINE_SHUTTING_DOWN)) is not None])
        self._fail_queued()

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """Outputs to the sink; when some finish a request, the engine's statistics first, so
        that metrics published before a final response count it without asking the engine
        (which answers only between steps)."""
        if any(o.finished for o in outputs):
            self._sink.stats(self.engine.get_stats())
        if outputs:
            self._sink.outputs(outputs)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when `block`); False on Shutdown."""
        while True:
            # On a clock, not when the inbox stays empty: a served engine is asked for its
            # statistics more often than that, and an idle producer's read blocks never went back.
            if block and time.monotonic() >= self._next_idle_poll:
                self.engine.idle_poll()
                self._next_idle_poll = time.monotonic() + _IDLE_POLL_S
            try:
                command = (self._inbox.get(timeout=max(self._next_idle_poll - time.monotonic(), 0.0)) if block
                           else self._inbox.get_nowait())
            except queue.Empty:
                if block:
                    continue
                return True
            block = False
            if isinstance(command, Shutdown):
                return False
            self._apply(command)
            del command  # an idle engine must not keep the last request alive

    def _apply(self, command: AddRequest | AbortRequest | GetStats) -> None:
        engine = self.engine
        if isinstance(command, AddRequest):
            req = command.request
            try:
                engine.enqueue(req)
            except Exception as exc:  # validated by the driver: should not happen
                logger.exception("could not add request %s", req.request_id)
                self._emit([error_output(req, RequestError(f"internal error: {exc}", ErrorKind.INTERNAL))])
        elif isinstance(command, AbortRequest):
            out = engine.abort_request(command.request_id)
            if out is not None:
                self._emit([out])
        elif isinstance(command, GetStats):
            self._sink.stats(engine.get_stats())

    def _fail_queued(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AddRequest):
                self._sink.outputs([error_output(command.request, ENGINE_SHUTTING_DOWN)])
