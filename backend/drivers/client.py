"""EngineClient: what a server drives an engine through, whichever driver runs its loop.

`StreamingEngine` runs the engine loop (an `EngineCore`) on a thread of the caller's process,
`EngineProcess` in a process of its own. Both validate and tokenize a request on the caller's
thread, admit it under their lock (`Admission`) and hand the loop the same typed commands
(messages.py); outputs come back, as deltas, through each request's callback, and statistics
through a `StatsMailbox`. What differs each driver says: how a request is made and what it keeps
of it, how a command reaches the loop, whether the engine still serves, how it stops.
"""
from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from typing import Any, Generic, TypeVar

from ..engine.metrics import EngineStats, StatsMailbox
from ..engine.request import Request
from ..engine_config import EngineConfig
from ..lora_request import LoRARequest
from ..outputs import OutputCallback, RequestOutput
from ..sampling_params import SamplingParams
from .admission import Admission
from .messages import AbortRequest, AddRequest, Command, GetStats

logger = logging.getLogger(__name__)

Entry = TypeVar("Entry")  # what a driver keeps of each request until its final output


class EngineClient(ABC, Generic[Entry]):
    """add_request, abort, get_stats and pushed_stats from any thread; is_healthy; shutdown,
    after which every request still in the engine has had a final output with an error."""

    config: EngineConfig
    tokenizer: Any  # the model's tokenizer (engine/tokenizer.load_tokenizer)
    # How long get_stats waits for the loop's answer (None: until it answers or stops).
    stats_timeout_s: float | None = None

    def __init__(self, max_waiting_requests: int | None) -> None:
        self._lock = threading.Lock()
        self._stopped = False
        self._requests: dict[str, Entry] = {}  # request id -> its entry, until its final output
        self._stats = StatsMailbox()
        self._admission = Admission(max_waiting_requests)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    on_output: OutputCallback, priority: int = 0,
                    lora_request: LoRARequest | str | None = None, deadline: float | None = None) -> None:
        """Validate now (ValueError with a clear message), then queue for the engine loop.
        deadline: wall-clock time (time.time()) after which the request ends with an error
        (finish_reason "abort"), waiting or running. Raises EngineOverloadedError when
        max_waiting_requests requests are still without their first output."""
        req = self._make_request(request_id, prompt, params, priority, lora_request, deadline)
        with self._lock:
            self._admission.admit(request_id, self._stopped, self._requests)
            self._requests[request_id] = self._entry(req, on_output)
        self._send(AddRequest(req))

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    def get_stats(self) -> EngineStats:
        """Asked of the engine loop, answered between two steps."""
        stats = self._stats.ask(lambda: self._send(GetStats()), lambda: self._stopped, self.stats_timeout_s)
        return self._with_rejected(stats or EngineStats())

    def pushed_stats(self) -> EngineStats | None:
        """The statistics the engine loop handed over since the last call, without asking it: it
        does so ahead of the outputs that finish requests (None when nothing new arrived)."""
        stats = self._stats.take()
        return None if stats is None else self._with_rejected(stats)

    def _with_rejected(self, stats: EngineStats) -> EngineStats:
        with self._lock:
            stats.num_requests_rejected += self._admission.num_rejected
        return stats

    @abstractmethod
    def is_healthy(self) -> bool:
        """Whether the engine still serves."""

    @abstractmethod
    def shutdown(self, timeout: float | None = None) -> None:
        """Finish every request with an error and stop the engine loop, waiting at most `timeout`."""

    @abstractmethod
    def _make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int,
                      lora_request: LoRARequest | str | None, deadline: float | None) -> Request:
        """Validated and tokenized, on the caller's thread (ValueError when it is not valid)."""

    @abstractmethod
    def _entry(self, req: Request, on_output: OutputCallback) -> Entry:
        """What the driver keeps of an admitted request (under the lock)."""

    @abstractmethod
    def _send(self, command: Command) -> None:
        """Hand a command to the engine loop, from any thread."""


def deliver_output(callback: OutputCallback, out: RequestOutput) -> None:
    """A broken callback must stop neither the engine nor the other requests' outputs."""
    try:
        callback(out)
    except Exception:
        logger.exception("output callback for request %s failed", out.request_id)
