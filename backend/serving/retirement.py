"""InstanceToken: tells a model instance that a reload replaced it.

Triton finalizes an instance only once every request object that reached it is gone, and its
gRPC frontend (2.51) keeps the first request of each stream until the client closes that stream.
So after an unload or a reload an instance can outlive its model for as long as any client keeps
a stream open, holding its engine (on a GPU, weights and KV cache) and the metrics lock. The
response sender therefore notices by itself that Triton no longer routes requests here (after an
unload the version is not ready; after a reload a newer instance of the same name took the
token) and releases what it can once its last request has ended.
"""
from __future__ import annotations

import os
import tempfile
import uuid


class InstanceToken:
    """The newest instance of a name in one server writes its token to a file of that server
    (its pid) and instance name; an older instance that reads another token was replaced."""

    def __init__(self, server_pid: int, instance_name: str, directory: str | None = None) -> None:
        self.path = os.path.join(directory or tempfile.gettempdir(),
                                 f"tritium-instance-{server_pid}-{instance_name}")
        self.token = uuid.uuid4().hex
        self.claimed = False

    def claim(self) -> None:
        """Take the name (once this instance can serve: the one it replaces then drains)."""
        partial = f"{self.path}.{self.token}"
        with open(partial, "w", encoding="ascii") as f:
            f.write(self.token)
        os.replace(partial, self.path)  # atomic: a reader sees the old token or the new one
        self.claimed = True

    def _current(self) -> str | None:
        try:
            with open(self.path, encoding="ascii") as f:
                return f.read()
        except OSError:
            return None

    def replaced(self) -> bool:
        """A newer instance took the name (a missing file, e.g. a cleaned /tmp, is not that)."""
        current = self._current()
        return self.claimed and current is not None and current != self.token

    def release(self) -> None:
        """At finalize: remove the file unless a newer instance owns it."""
        if self.claimed and self._current() == self.token:
            try:
                os.unlink(self.path)
            except OSError:
                pass
