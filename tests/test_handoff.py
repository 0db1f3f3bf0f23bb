"""tritium.serving.handoff.Handoff: what the Triton stub's sender thread is fed through."""
from __future__ import annotations

import threading
import time

from tritium.serving.handoff import Handoff


def test_every_item_arrives_once_in_each_producers_order():
    box, n, producers = Handoff(), 20000, 4
    received: list[tuple[int, int]] = []

    def produce(p: int) -> None:
        for i in range(n):
            box.put((p, i))

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(received) < n * producers and time.monotonic() < deadline:
        item = box.take(0.01)
        if item is not None:
            received.append(item)
            received += box.drain()
    for t in threads:
        t.join()
    assert len(received) == n * producers
    for p in range(producers):
        assert [i for q, i in received if q == p] == list(range(n))
    assert box.take(0) is None and box.drain() == []


def test_a_sleeping_consumer_wakes_when_an_item_arrives():
    """A lost wake-up would show as take() returning only at its timeout (5 s here)."""
    box = Handoff()
    for trial in range(20):
        timer = threading.Timer(0.01, box.put, args=(trial,))
        start = time.monotonic()
        timer.start()
        item = box.take(5.0)
        assert item == trial and time.monotonic() - start < 2.0, (trial, time.monotonic() - start)


def test_take_times_out_with_nothing_queued():
    box = Handoff()
    start = time.monotonic()
    assert box.take(0.05) is None
    assert time.monotonic() - start >= 0.04
    box.put("x")
    box.put("y")
    assert box.take(0) == "x" and box.drain() == ["y"] and box.take(0) is None


def test_drain_takes_everything_queued_however_much():
    """The sender folds all that is queued into one round: a backlog must not outlast a round."""
    box = Handoff()
    for i in range(50000):
        box.put(i)
    assert box.take(0) == 0 and box.drain() == list(range(1, 50000)) and box.drain() == []
