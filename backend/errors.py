"""Errors and callback types shared by the engine front ends (imports nothing heavy: the
Triton stub imports these without loading torch, which only the engine's process needs)."""
from __future__ import annotations

from typing import Callable

from .outputs import RequestOutput

OutputCallback = Callable[[RequestOutput], None]


class EngineShutdownError(RuntimeError):
    """A request arrived after `shutdown()` (a server maps it to "unavailable")."""


class EngineOverloadedError(RuntimeError):
    """A request was refused because `max_waiting_requests` requests already wait to be
    scheduled (a server maps it to "unavailable": Triton UNAVAILABLE, HTTP 503); retry later."""


def overloaded_message(max_waiting_requests: int) -> str:
    return (f"The server is busy: {max_waiting_requests} requests are already waiting to be "
            f"scheduled (max_waiting_requests={max_waiting_requests}). Retry later.")
