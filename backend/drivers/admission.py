"""Admission: the rules both engine drivers (StreamingEngine, EngineProcess) apply to a request
before it reaches the engine loop, under the driver's lock.

A stopped engine refuses with EngineShutdownError; an id in use with ValueError; with
`max_waiting_requests`, a request beyond that many without a first output yet (waiting to be
scheduled, as the driver sees it) with EngineOverloadedError, counted for the metrics.
"""
from __future__ import annotations

from typing import Container, Iterable

from ..errors import EngineOverloadedError, EngineShutdownError, overloaded_message


class Admission:
    def __init__(self, max_waiting_requests: int | None) -> None:
        self.max_waiting = max_waiting_requests
        self.not_started: set[str] = set()
        self.num_rejected = 0

    def admit(self, request_id: str, stopped: bool, in_use: Container[str]) -> None:
        """Raises when the request may not be queued; else counts it as not started."""
        if stopped:
            raise EngineShutdownError("The engine is shut down.")
        if request_id in in_use:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if self.max_waiting is not None:
            if len(self.not_started) >= self.max_waiting:
                self.num_rejected += 1
                raise EngineOverloadedError(overloaded_message(self.max_waiting))
            self.not_started.add(request_id)

    def started(self, request_ids: Iterable[str]) -> None:
        """These requests have an output: they no longer wait."""
        if self.not_started:
            self.not_started.difference_update(request_ids)
