"""EngineSupervisor: keeps a model's engine process serving; restarts it when it dies.

The engine's process can die under the model (killed, out of memory, a crash in a kernel). Its
receiver thread sees the socket close at once and ends every in-flight request with an error;
the supervisor then starts a new engine, with bounded retries and backoff, and the model serves
again with no operator action. While no engine serves, add_request raises EngineShutdownError
at once (the adapter answers UNAVAILABLE). A Python-based model cannot turn its own readiness
off in Triton 2.51 (only an unload can): ENABLE_VLLM_HEALTH_CHECK keeps the vLLM backend's
behaviour instead (max_restarts=0, and the adapter unloads the model).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ..errors import EngineShutdownError
from ..engine.metrics import EngineStats

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # before each attempt of one restart


class EngineSupervisor:
    """EngineClient's interface (backend/drivers/client.py) over a replaceable engine made by
    `start(on_exit)`.

    `start` returns an EngineProcess-like engine that calls `on_exit()` (from any thread) when its
    process dies. `log(level, message)` reports restarts. `restarts` counts engines started after
    the first (tritium:engine_restarts_total); `generation` changes with each new engine."""

    def __init__(self, start: Callable[[Callable[[], None]], Any], log: Callable[[str, str], None],
                 max_restarts: int = len(RESTART_BACKOFF_S)) -> None:
        self._start, self._log, self._max_restarts = start, log, max_restarts
        self._lock = threading.Lock()
        self._died = threading.Event()
        self._closing = threading.Event()
        self._engine = start(self._died.set)
        self.config = self._engine.config  # the same for every engine it starts
        self.restarts = 0
        self.generation = 0
        self._state = "serving"  # serving | restarting | failed | closed
        self._thread = threading.Thread(target=self._watch, name="tritium-supervisor", daemon=True)
        self._thread.start()

    # ---- EngineClient's interface ------------------------------------------------------------------
    def add_request(self, *args: Any, **kwargs: Any) -> None:
        self._serving().add_request(*args, **kwargs)

    def abort(self, request_id: str) -> None:
        engine = self._engine
        if engine is not None:
            engine.abort(request_id)

    def get_stats(self) -> EngineStats:
        """The current engine's statistics, with `engine_restarts` and `engine_generation`
        (read by the metrics' tracker)."""
        engine, generation = self._engine, self.generation
        stats = engine.get_stats() if engine is not None and self._state == "serving" else EngineStats()
        return self._stamped(stats, generation)

    def pushed_stats(self) -> EngineStats | None:
        """What the current engine sent ahead of its last finished requests, if anything new
        (see EngineProcess.pushed_stats), with the restart counts as get_stats gives them."""
        engine, generation = self._engine, self.generation
        stats = engine.pushed_stats() if engine is not None and self._state == "serving" else None
        return None if stats is None else self._stamped(stats, generation)

    def _stamped(self, stats: EngineStats, generation: int) -> EngineStats:
        stats.engine_restarts, stats.engine_generation = self.restarts, generation
        return stats

    def is_healthy(self) -> bool:
        engine = self._engine
        return self._state == "serving" and engine is not None and engine.is_healthy()

    @property
    def receiver_stats(self) -> dict | None:
        return getattr(self._engine, "receiver_stats", None)

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop supervising and shut the engine down (its in-flight requests end with an error)."""
        with self._lock:
            self._state = "closed"
            engine = self._engine
        self._closing.set()
        self._died.set()
        if engine is not None:
            engine.shutdown(timeout=timeout)
        self._thread.join(timeout)

    # ---- the supervisor thread ------------------------------------------------------------------
    def _serving(self) -> Any:
        state, engine = self._state, self._engine
        if state == "serving" and engine is not None:
            return engine
        if state == "restarting":
            raise EngineShutdownError("The engine is restarting after its process exited; retry shortly.")
        if state == "failed":
            raise EngineShutdownError("The engine process exited and could not be restarted.")
        raise EngineShutdownError("The engine is shut down.")

    def _watch(self) -> None:
        while True:
            self._died.wait()
            if self._closing.is_set():
                return
            with self._lock:
                if self._state != "serving":
                    return
                self._state, dead = "restarting", self._engine
            dead.shutdown(timeout=10.0)  # reaps the process
            self._log("error", f"tritium: the engine process exited (code {dead.exit_code()}); "
                               f"its requests failed" + ("; restarting it" if self._max_restarts else ""))
            if not self._max_restarts:
                with self._lock:
                    self._state = "failed" if self._state != "closed" else "closed"
                return
            if not self._restart():
                return

    def _restart(self) -> bool:
        for attempt, delay in enumerate(RESTART_BACKOFF_S[:self._max_restarts], 1):
            if self._closing.wait(delay):
                return False
            self._died.clear()
            start = time.monotonic()
            try:
                engine = self._start(self._died.set)
            except Exception as e:
                self._log("error", f"tritium: engine restart {attempt}/{self._max_restarts} failed: {e}")
                continue
            with self._lock:
                if self._state == "closed":
                    engine.shutdown()
                    return False
                self._engine, self._state = engine, "serving"
                self.restarts += 1
                self.generation += 1
            self._log("info", f"tritium: the engine serves again (restart {self.restarts}, attempt "
                              f"{attempt}, {time.monotonic() - start:.1f} s)")
            return True
        with self._lock:
            if self._state != "closed":
                self._state = "failed"
        self._log("error", f"tritium: the engine could not be restarted after {self._max_restarts} "
                           f"attempts; every request is refused until the model is reloaded")
        return False
