"""The processes `tritium serve` runs: tritonserver and the OpenAI frontend, each the leader of a
process group of its own (the stubs and engine processes follow the server), started, watched,
and stopped together."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

# How long a stop waits for both before it kills what is left: longer than tritonserver's own
# exit timeout (its default), within which it unloads the model and the engine drains.
STOP_TIMEOUT_S = 45.0
_POLL_S = 0.2
_PR_SET_PDEATHSIG = 1


@dataclass
class Child:
    """One process of the pair, and the URL that answers 200 once it is ready."""

    name: str
    proc: subprocess.Popen
    ready_url: str

    def exited(self) -> int | None:
        """Its exit status once it has exited, without reaping it: while it is not reaped its pid
        (its process group's id) cannot be reused, so its group can still be killed safely."""
        try:
            info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # already reaped
            return self.proc.returncode
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.ready_url, timeout=2) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def start(name: str, argv: list[str], ready_url: str, env: dict[str, str] | None = None,
          executable: str | None = None) -> Child:
    """Start `argv` as the leader of a new session (so that a terminal's Ctrl-C reaches only
    `tritium serve`, which stops the pair in order), told to end should `tritium serve` die."""
    proc = subprocess.Popen(argv, executable=executable, env=env, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=_end_with_parent)
    return Child(name, proc, ready_url)


def _end_with_parent() -> None:
    # Linux only: SIGTERM when the parent dies, so that a killed `tritium serve` leaves no server.
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass


class Supervisor:
    """Watches the children; stops them all when asked (a signal) or when one exits unasked."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.children: list[Child] = []
        self.stop_signal: int | None = None  # the signal that asked for a stop
        self._force = False  # a second signal: kill now
        self._log = log

    def install_signal_handlers(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
        else:
            self._force = True

    def dead_child(self) -> Child | None:
        """A child that has exited (none should before a stop)."""
        return next((c for c in self.children if c.exited() is not None), None)

    def wait_until_ready(self) -> bool:
        """Whether every child answers ready; False when a stop was asked for or one exited."""
        pending = list(self.children)
        while pending:
            if self.stop_signal is not None or self.dead_child() is not None:
                return False
            pending = [c for c in pending if not c.is_ready()]
            if pending:
                time.sleep(_POLL_S)
        return True

    def watch(self) -> Child | None:
        """Until a stop is asked for (None) or a child exits (that child)."""
        while self.stop_signal is None:
            dead = self.dead_child()
            if dead is not None:
                return dead
            time.sleep(_POLL_S)
        return None

    def stop(self, signum: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> None:
        """`signum` to each child's leader, the last started first, each once the one after it
        has exited (the frontend, then tritonserver, which unloads its model and so stops its
        engine): a client's open stream holds a model's unload, as Triton finalizes a model only
        once the streams that used it have closed. After `timeout`, or a second signal, SIGKILL.
        Then every process left in their groups (a stub, an engine process) is killed, and the
        children are reaped."""
        deadline = time.monotonic() + timeout
        for child in reversed(self.children):
            if child.exited() is None:
                try:
                    child.proc.send_signal(signum)
                except ProcessLookupError:
                    pass
            while child.exited() is None and not self._force and time.monotonic() <= deadline:
                time.sleep(0.1)
        alive = ", ".join(c.name for c in self.children if c.exited() is None)
        if alive:
            self._log(f"{alive} did not stop in time: killing it")
        for child in self.children:
            # A leader still running, and what is left of each group (its leader is not reaped yet).
            child.signal_group(signal.SIGKILL)
            child.proc.wait()
