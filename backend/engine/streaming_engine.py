"""StreamingEngine: the LLMEngine on its own thread, for servers.

Requests and aborts from any thread are queued and picked up between steps; outputs are
delivered, as deltas, through each request's callback on the engine thread (callbacks must be
quick: a server hands them to its own sender thread).
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from ..config import EngineArgs
from ..errors import EngineShutdownError, OutputCallback
from .llm_engine import LLMEngine
from ..lora_request import LoRARequest
from .metrics import EngineStats
from ..outputs import CompletionOutput, RequestOutput
from .request import Request
from ..sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class StreamingEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.engine = LLMEngine(args)
        self.engine_args = self.engine.args
        self.tokenizer = self.engine.tokenizer
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._ids_in_use: set[str] = set()
        self._lock = threading.Lock()  # engine state: held during a step and while applying the inbox
        self._ids_lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="tritium-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "StreamingEngine":
        return cls(EngineArgs.from_kwargs(**kwargs))

    # ---- called from any thread -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    on_output: OutputCallback, priority: int = 0,
                    lora_request: LoRARequest | str | None = None) -> None:
        """Validate now (ValueError with a clear message), then queue for the engine thread."""
        req = self.engine.make_request(request_id, prompt, params, priority=priority,
                                       lora_request=lora_request)
        with self._ids_lock:
            if self._stopped:
                raise EngineShutdownError("The engine is shut down.")
            if request_id in self._ids_in_use:
                raise ValueError(f"Request id {request_id!r} is already in use.")
            self._ids_in_use.add(request_id)
        self._inbox.put(("add", (req, on_output)))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def get_stats(self) -> EngineStats:
        with self._lock:
            return self.engine.get_stats()

    def shutdown(self) -> None:
        """Finish every request with an error, stop and join the engine thread."""
        with self._ids_lock:
            if self._stopped:
                return
            self._stopped = True
        self._inbox.put(("stop", None))
        self._thread.join()

    # ---- the engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while True:
            block = not engine.has_unfinished_requests()
            if not self._drain(block):
                break
            if not engine.has_unfinished_requests():
                continue
            with self._lock:
                outputs = engine.step(self._deliver_all)
            self._deliver_all(outputs)
        for rid in list(engine.requests):
            out = engine.abort_request(rid, error="The engine is shutting down.")
            if out is not None:
                self._deliver(out)
        while True:  # requests queued after the last step: they end with the same error
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                req, callback = payload
                self._fail_unstarted(req, callback)

    def _drain(self, block: bool) -> bool:
        """Apply queued adds and aborts; False when asked to stop."""
        while True:
            try:
                item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return True
            block = False
            if not self._apply(*item):
                return False
            del item  # an idle engine must not keep the last request (and its callback) alive

    def _apply(self, kind: str, payload: Any) -> bool:
        if kind == "stop":
            return False
        with self._lock:
            if kind == "add":
                req, callback = payload
                self._callbacks[req.request_id] = callback
                self.engine.add_request(req.request_id, req)
            elif kind == "abort":
                out = self.engine.abort_request(payload)
                if out is not None:
                    self._deliver(out)
        return True

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        callback = self._callbacks.get(out.request_id)
        if out.finished:
            self._callbacks.pop(out.request_id, None)
            with self._ids_lock:
                self._ids_in_use.discard(out.request_id)
        if callback is None:
            return
        try:
            callback(out)
        except Exception:  # a broken callback must not take the engine down
            logger.exception("output callback for request %s failed", out.request_id)

    def _fail_unstarted(self, req: Request, callback: OutputCallback) -> None:
        out = RequestOutput(req.request_id, req.prompt, req.prompt_token_ids,
                            [CompletionOutput(0, "", [], None, None, "abort")], finished=True,
                            error="The engine is shutting down.", metrics=req.metrics)
        with self._ids_lock:
            self._ids_in_use.discard(req.request_id)
        try:
            callback(out)
        except Exception:
            logger.exception("output callback for request %s failed", req.request_id)
