"""Handoff: items from several producer threads to one consumer thread, in order.

The Triton stub's engine-receiver thread hands the sender thread one output per token of every
stream. `queue.Queue.put` takes a lock and notifies a condition each time; here a put is a deque
append (atomic under the GIL) plus, only while the consumer sleeps, setting an event.
"""
from __future__ import annotations

import collections
import threading
from typing import Any


class Handoff:
    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._wake = threading.Event()

    def put(self, item: Any) -> None:
        self._items.append(item)
        if not self._wake.is_set():  # the consumer sleeps, or is about to: wake it
            self._wake.set()

    def take(self, timeout: float) -> Any:
        """The oldest item, waiting up to `timeout` seconds for one; None if there is none."""
        items = self._items
        if not items:
            self._wake.clear()
            # Look again after clearing: a put between the first look and the clear saw the
            # event still set and did not set it, but its item is there now.
            if not items:
                self._wake.wait(timeout)
        return items.popleft() if items else None

    def drain(self) -> list[Any]:
        """Every item already here, oldest first, without waiting (those put meanwhile stay)."""
        items = self._items
        popleft = items.popleft
        return [popleft() for _ in range(len(items))]
