"""Overload control (max_waiting_requests -> EngineOverloadedError) and per-request deadlines,
through LLMEngine, StreamingEngine and EngineProcess."""
from __future__ import annotations

import threading
import time

import pytest

from tritium import (EngineArgs, EngineOverloadedError, EngineProcess, LLMEngine, SamplingParams,
                     StreamingEngine)
from tritium.engine.request import accumulate

BUSY = ("The server is busy: 2 requests are already waiting to be scheduled "
        "(max_waiting_requests=2). Retry later.")
LONG = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)


def test_bad_bound_and_deadline_values(llama_dir):
    with pytest.raises(ValueError, match=r"^max_waiting_requests must be a positive integer, got 0\.$"):
        EngineArgs(model=llama_dir, max_waiting_requests=0)
    assert EngineArgs.from_strings({"model": llama_dir, "max_waiting_requests": "5"}).max_waiting_requests == 5
    engine = LLMEngine(EngineArgs(model=llama_dir))
    with pytest.raises(ValueError, match=r"^deadline must be a finite time in seconds \(time.time\(\)\), got nan\.$"):
        engine.add_request("x", [1, 2], SamplingParams(), deadline=float("nan"))


def _drain(engine: LLMEngine, until=None, limit_s: float = 60.0) -> dict:
    totals: dict = {}
    start = time.time()
    while engine.has_unfinished_requests() and time.time() - start < limit_s:
        for out in engine.step():
            totals[out.request_id] = accumulate(totals.get(out.request_id), out)
        if until is not None and until(totals):
            break
    return totals


def test_queue_bound_in_the_llm_engine(llama_dir):
    engine = LLMEngine(EngineArgs(model=llama_dir, max_waiting_requests=2))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [4, 5, 6], params)
    with pytest.raises(EngineOverloadedError) as info:
        engine.add_request("c", [7, 8, 9], params)
    assert str(info.value) == BUSY
    assert isinstance(info.value, RuntimeError)
    totals = _drain(engine)
    assert sorted(totals) == ["a", "b"]
    assert all(len(t.outputs[0].token_ids) == 3 and t.error is None for t in totals.values())
    stats = engine.get_stats()
    assert stats.num_requests_rejected == 1 and stats.num_waiting == 0
    engine.add_request("c", [7, 8, 9], params)  # room again
    assert _drain(engine)["c"].outputs[0].finish_reason == "length"


def test_deadline_ends_a_waiting_and_a_running_request(llama_dir):
    """One sequence at a time: `hold` runs, `queued` waits behind it until its deadline; then
    `hold` itself runs past its own deadline. Both end with "abort" and an error; every block
    is free again."""
    engine = LLMEngine(EngineArgs(model=llama_dir, max_num_seqs=1, max_model_len=1200))
    now = time.time()
    engine.add_request("hold", [1, 2, 3], LONG, deadline=now + 0.6)
    engine.add_request("queued", list(range(10, 50)), LONG, deadline=now + 0.2)
    totals = _drain(engine, until=lambda t: "queued" in t and t["queued"].finished)
    queued = totals["queued"]
    assert queued.outputs[0].finish_reason == "abort" and queued.outputs[0].token_ids == []
    assert queued.error.startswith("Request timed out: its deadline passed while it was waiting to be "
                                   "scheduled (0.")
    assert not totals["hold"].finished  # still running
    totals.update(_drain(engine))
    hold = totals["hold"]
    assert hold.finished and hold.outputs[0].finish_reason == "abort"
    assert hold.error.startswith("Request timed out: its deadline passed while it was running (0.")
    assert 0 < len(hold.outputs[0].token_ids) < 1000
    assert time.time() - now >= 0.6
    bm = engine.block_manager
    assert bm.usage == 0.0 and not engine.requests
    bm.check_integrity([])
    stats = engine.get_stats()
    assert stats.num_requests_timed_out == 2 and stats.request_success.get("abort") == 2


class Collector:
    def __init__(self, block: threading.Event | None = None) -> None:
        self.total = None
        self.done = threading.Event()
        self.entered = threading.Event()
        self.block = block

    def __call__(self, out) -> None:
        self.total = accumulate(self.total, out)
        self.entered.set()
        if self.block is not None:
            self.block.wait(30)  # holds the thread that delivers outputs
        if out.finished:
            self.done.set()


def _bound_and_deadline(engine) -> None:
    """The same scenario for both drivers: while a callback holds the delivering thread, two
    requests are still without an output and a third is refused at once; once released, the
    admitted ones finish. Then a running request's deadline ends it."""
    release = threading.Event()
    blocker = Collector(release)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("blocker", [1, 2], params, blocker)
    assert blocker.entered.wait(60)
    admitted = {rid: Collector() for rid in ("a", "b")}
    for rid, c in admitted.items():
        engine.add_request(rid, [3, 4, 5], params, c)
    with pytest.raises(EngineOverloadedError) as info:
        engine.add_request("c", [6, 7], params, Collector())
    assert str(info.value) == BUSY
    release.set()
    for c in [blocker, *admitted.values()]:
        assert c.done.wait(60)
        assert c.total.error is None and len(c.total.outputs[0].token_ids) == 3
    late = Collector()
    engine.add_request("late", [8, 9], LONG, late, deadline=time.time() + 0.3)
    assert late.done.wait(60)
    assert late.total.outputs[0].finish_reason == "abort"
    assert late.total.error.startswith("Request timed out: its deadline passed while it was running")
    assert 0 < len(late.total.outputs[0].token_ids) < 1000
    stats = engine.get_stats()
    assert stats.num_requests_rejected == 1 and stats.num_requests_timed_out == 1
    assert stats.kv_cache_usage == 0.0 and stats.num_running == 0 and stats.num_waiting == 0


def test_bound_and_deadline_through_the_streaming_engine(llama_dir):
    engine = StreamingEngine(EngineArgs(model=llama_dir, max_waiting_requests=2, max_model_len=1200))
    try:
        _bound_and_deadline(engine)
        engine.engine.block_manager.check_integrity([])
    finally:
        engine.shutdown()


def test_bound_deadline_and_cache_salt_through_the_engine_process(llama_dir):
    engine = EngineProcess(EngineArgs(model=llama_dir, max_waiting_requests=2, max_model_len=1200))
    try:
        _bound_and_deadline(engine)
        # cache_salt: the prompt's block hashes are made on this side and used by the engine's.
        prompt = list(range(100, 140))
        cached = {}
        for rid, salt in (("s1", "x"), ("s2", "y"), ("s3", "x")):
            c = Collector()
            engine.add_request(rid, prompt, SamplingParams(max_tokens=1, cache_salt=salt), c)
            assert c.done.wait(60)
            cached[rid] = c.total.num_cached_tokens
        assert cached == {"s1": 0, "s2": 0, "s3": 32}
    finally:
        engine.shutdown()
