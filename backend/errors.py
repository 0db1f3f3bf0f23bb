"""Errors and callback types shared by the engine front ends (imports nothing heavy: the
Triton stub imports these without loading torch, which only the engine's process needs)."""
from __future__ import annotations

from typing import Callable

from .outputs import RequestOutput

OutputCallback = Callable[[RequestOutput], None]


class EngineShutdownError(RuntimeError):
    """A request arrived after `shutdown()` (a server maps it to "unavailable")."""
