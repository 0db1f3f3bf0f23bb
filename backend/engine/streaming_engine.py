"""StreamingEngine: the thread driver, an EngineCore on a thread of the caller's process.

Requests and aborts from any thread are queued and picked up between steps; outputs are
delivered, as deltas, through each request's callback on the engine thread (callbacks must be
quick: a server hands them to its own sender thread). `EngineProcess` is the same interface
with the core in a process of its own.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from ..config import EngineArgs
from ..lora_request import LoRARequest
from ..outputs import OutputCallback, RequestOutput
from ..sampling_params import SamplingParams
from .admission import Admission
from .core import EngineCore
from .llm_engine import LLMEngine
from .messages import AbortRequest, AddRequest, GetStats, Shutdown
from .metrics import EngineStats, StatsMailbox

logger = logging.getLogger(__name__)


class StreamingEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.engine = LLMEngine(args)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self._callbacks: dict[str, OutputCallback] = {}
        self._admission = Admission(self.config.scheduler_config.max_waiting_requests)
        self._lock = threading.Lock()
        self._stopped = False
        self._stats = StatsMailbox()
        self._core = EngineCore(self.engine, self)
        self._thread = threading.Thread(target=self._core.run, name="tritium-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "StreamingEngine":
        return cls(EngineArgs.from_kwargs(**kwargs))

    # ---- called from any thread -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    on_output: OutputCallback, priority: int = 0,
                    lora_request: LoRARequest | str | None = None, deadline: float | None = None) -> None:
        """Validate now (ValueError with a clear message), then queue for the engine thread.
        deadline: wall-clock time (time.time()) after which the request ends with an error
        (finish_reason "abort"), waiting or running. Raises EngineOverloadedError when
        max_waiting_requests requests are still without their first output."""
        req = self.engine.make_request(request_id, prompt, params, priority=priority,
                                       lora_request=lora_request, deadline=deadline)
        with self._lock:
            self._admission.admit(request_id, self._stopped, self._callbacks)
            self._callbacks[request_id] = on_output
        self._core.submit(AddRequest(req))

    def abort(self, request_id: str) -> None:
        self._core.submit(AbortRequest(request_id))

    def get_stats(self) -> EngineStats:
        """Asked of the engine thread, answered between two steps."""
        if self._stopped:
            return EngineStats()
        stats = self._stats.ask(lambda: self._core.submit(GetStats()), lambda: self._stopped, None)
        return self._with_rejected(stats or EngineStats())

    def pushed_stats(self) -> EngineStats | None:
        """The statistics the engine thread handed over since the last call, without asking: it
        does so ahead of the outputs that finish requests (None when nothing new arrived)."""
        stats = self._stats.take()
        return None if stats is None else self._with_rejected(stats)

    def _with_rejected(self, stats: EngineStats) -> EngineStats:
        with self._lock:
            stats.num_requests_rejected += self._admission.num_rejected
        return stats

    def is_healthy(self) -> bool:
        """Whether the engine still serves: its loop runs and it was not shut down."""
        return not self._stopped and self._thread.is_alive()

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish every request with an error, stop and join the engine thread (waiting at most
        `timeout`, as EngineProcess.shutdown: a step stuck in the device is not waited for)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._stats.wake()
        self._core.submit(Shutdown())
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.shutdown()

    # ---- CoreSink: called on the engine thread ------------------------------------------------------
    def outputs(self, outputs: list[RequestOutput]) -> None:
        if self._admission.not_started:
            with self._lock:
                self._admission.started(out.request_id for out in outputs)
        for out in outputs:
            if out.finished:
                with self._lock:
                    callback = self._callbacks.pop(out.request_id, None)
            else:
                callback = self._callbacks.get(out.request_id)
            if callback is None:
                continue
            try:
                callback(out)
            except Exception:  # a broken callback must not take the engine down
                logger.exception("output callback for request %s failed", out.request_id)

    def stats(self, stats: EngineStats) -> None:
        self._stats.put(stats)
