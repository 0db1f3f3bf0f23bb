"""The engine process's parent-side receiver on the CPU: time per engine output to unpack a
message of 256 one-token outputs, make their text and build the outputs, and how much of that
time it holds the GIL (a second thread counts while it runs: the Triton stub's sender shares
the interpreter with it). Compares text made token by token (`--one-by-one`, the old path) with
the batched path of `EngineProcess._deliver`.

    python3 scripts/bench_receiver.py --tokenizer DIR [--one-by-one]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backend import SamplingParams  # noqa: E402
from backend.engine.engine_process import EngineProcess, OutputDetokenizer, pack_output  # noqa: E402
from backend.outputs import CompletionOutput, RequestOutput  # noqa: E402
from backend.engine.tokenizer import load_tokenizer  # noqa: E402


def receiver(tokenizer, streams: int) -> EngineProcess:
    eng = EngineProcess.__new__(EngineProcess)  # the receiver's state only: no engine process
    eng._lock = threading.Lock()
    eng.receiver_stats = {"messages": 0, "outputs": 0, "busy_s": 0.0}
    eng._requests = {}
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    for i in range(streams):
        req = type("Req", (), {"params": params, "prompt": None, "prompt_token_ids": [1, 2, 3],
                               "metrics": None})()
        eng._requests[str(i)] = (req, lambda out: None, OutputDetokenizer(tokenizer, req))
    return eng


def count_while(fn, seconds: float) -> tuple[int, int]:
    """(calls of fn, increments a counting thread made meanwhile)."""
    stop, count = [False], [0]

    def counter() -> None:
        while not stop[0]:
            count[0] += 1

    t = threading.Thread(target=counter)
    t.start()
    calls, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        fn()
        calls += 1
    stop[0] = True
    t.join()
    return calls, count[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--messages", type=int, default=200)
    ap.add_argument("--one-by-one", action="store_true", help="text token by token (the old path)")
    a = ap.parse_args()
    tok = load_tokenizer(a.tokenizer)
    rng = random.Random(0)
    eng = receiver(tok, a.streams)
    if a.one_by_one:
        OutputDetokenizer.one_token = lambda self, outputs: None  # every output through fill()
    vocab = len(tok)

    def message() -> list[tuple]:
        return [pack_output(RequestOutput(str(i), None, [1, 2, 3],
                                          [CompletionOutput(0, "", [rng.randrange(100, vocab)], -1.0, None)], False))
                for i in range(a.streams)]

    payloads = [message() for _ in range(a.messages)]
    it = iter(payloads * 1000)
    start = time.perf_counter()
    for p in payloads:
        eng._deliver(p)
    per_output = (time.perf_counter() - start) / (a.messages * a.streams) * 1e6
    _, alone = count_while(lambda: time.sleep(0.001), 1.0)
    calls, shared = count_while(lambda: eng._deliver(next(it)), 1.0)
    print(f"{'one by one' if a.one_by_one else 'batched'}: {per_output:.2f} us per output; while it "
          f"ran ({calls} messages in 1 s) a counting thread got {shared / alone:.0%} of its speed alone")


if __name__ == "__main__":
    main()
