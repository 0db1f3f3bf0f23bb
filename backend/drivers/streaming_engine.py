"""StreamingEngine: the thread driver, an EngineCore on a thread of the caller's process.

Requests and aborts from any thread are queued and picked up between steps; outputs are
delivered, as deltas, through each request's callback on the engine thread (callbacks must be
quick: a server hands them to its own sender thread). `EngineProcess` is the same interface
(`EngineClient`) with the core in a process of its own.
"""
from __future__ import annotations

import threading
from typing import Any

from ..config import EngineArgs
from ..engine.llm_engine import LLMEngine
from ..engine.metrics import EngineStats
from ..engine.request import Request
from ..lora_request import LoRARequest
from ..outputs import OutputCallback, RequestOutput
from ..sampling_params import SamplingParams
from .client import EngineClient, deliver_output
from .engine_core import EngineCore
from .messages import Command, Shutdown


class StreamingEngine(EngineClient[OutputCallback]):
    def __init__(self, args: EngineArgs) -> None:
        self.engine = LLMEngine(args)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        super().__init__(self.config.scheduler_config.max_waiting_requests)  # requests: id -> callback
        self._core = EngineCore(self.engine, self)
        self._thread = threading.Thread(target=self._core.run, name="tritium-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "StreamingEngine":
        return cls(EngineArgs.from_kwargs(**kwargs))

    # ---- EngineClient: this driver's requests, commands and life ------------------------------------
    def _make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int,
                      lora_request: LoRARequest | str | None, deadline: float | None) -> Request:
        return self.engine.make_request(request_id, prompt, params, priority=priority,
                                        lora_request=lora_request, deadline=deadline)

    def _entry(self, req: Request, on_output: OutputCallback) -> OutputCallback:
        return on_output

    def _send(self, command: Command) -> None:
        self._core.submit(command)

    def get_stats(self) -> EngineStats:
        """Asked of the engine thread, answered between two steps."""
        if self._stopped:  # no thread answers any more
            return EngineStats()
        return super().get_stats()

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
                    callback = self._requests.pop(out.request_id, None)
            else:
                callback = self._requests.get(out.request_id)
            if callback is not None:
                deliver_output(callback, out)

    def stats(self, stats: EngineStats) -> None:
        self._stats.put(stats)
