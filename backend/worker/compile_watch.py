"""Reports Triton kernel compiles that happen while serving.

Triton compiles a kernel the first time it sees a new variant: new constexprs, or an integer
argument that changes its specialisation (equal to 1, divisible by 16). A compile takes from
tens of milliseconds (from the disk cache) to seconds (a first compile on a machine), and the
step loop waits for it, so every variant a step can need is compiled at start-up
(`warmup.compile_step_variants`, graph capture). A compile after that is a stall that
clients see; this watch logs each one, with the kernel's specialisation, so the warm-up can be
made to cover it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)


class CompileWatch:
    """Counts and logs Triton compiles from `install()` on (process-wide: Triton's JIT hooks
    are global). `compiles` and `seconds` are totals; each compile is logged as a warning."""

    def __init__(self) -> None:
        self.compiles = 0
        self.seconds = 0.0
        self._started: dict[str, float] = {}  # by the variant's repr (names it whole)
        self._lock = threading.Lock()
        self.installed = False

    def install(self) -> bool:
        """Hook Triton's JIT (before and after each compile); False where this Triton has no
        hooks (the interpreter never compiles, so the CPU machine needs none)."""
        try:
            import triton
        except ImportError:
            return False
        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook"):
            return False
        runtime.jit_cache_hook = self._before
        if hasattr(runtime, "jit_post_compile_hook"):
            runtime.jit_post_compile_hook = self._after
        self.installed = True
        return True

    @staticmethod
    def remove_hooks() -> None:
        """Unhook any watch (an engine starting in a process where another one runs: its
        start-up compiles are not another engine's serving stalls)."""
        try:
            import triton
        except ImportError:
            return
        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        for name in ("jit_cache_hook", "jit_post_compile_hook"):
            if runtime is not None and hasattr(runtime, name):
                setattr(runtime, name, None)

    def _before(self, *args: Any, repr: str = "", compile: dict | None = None, **kwargs: Any) -> bool:
        with self._lock:
            self.compiles += 1
            self._started[repr] = time.perf_counter()
        logger.warning("Triton is compiling a kernel variant while serving (the step waits for "
                       "it; start-up did not cover it): %s", _describe(repr, compile))
        return False  # compile it

    def _after(self, *args: Any, repr: str = "", **kwargs: Any) -> bool:
        with self._lock:
            start = self._started.pop(repr, None)
            if start is None:
                return False
            seconds = time.perf_counter() - start
            self.seconds += seconds
        logger.warning("Triton compiled %s in %.0f ms", repr.split("[", 1)[0], seconds * 1000)
        return False


def _describe(repr: str, compile: dict | None) -> str:
    """The variant: Triton's repr, or where `compile` has them (Triton 3.6's repr names the
    first argument only) the kernel's constexprs, scalar argument types and specialisations."""
    if not compile or "signature" not in compile:
        return repr[:1200]
    scalars = {k: v for k, v in compile["signature"].items() if not str(v).startswith("*")}
    return (f"{repr.split('(', 1)[0]} constexprs={compile.get('constants')} scalars={scalars} "
            f"specialisation={compile.get('configs')}")[:1200]
