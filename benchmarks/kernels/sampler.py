"""Host and device time of the sampler's per-token adjustments (penalties, allowed ids, bias)
for a full batch, as the engine runs them, best of several runs: `Sampler.prepare` at a
sequence's first step (its penalty counts filled from its tokens on the host) and at later
steps (the counts already on the device), and `Sampler._apply_penalties` (the device work).

    python3 benchmarks/kernels/sampler.py --rows 256 --history 640 --vocab 128256 [--device cuda] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from tritium.layers.penalties import PenaltyCounts
from tritium.layers.sampler import Sampler
from tritium.sampling_params import SamplingParams
from tritium.core.sequence import Sequence, SequenceStatus

CASES = {
    "repetition + frequency + presence": dict(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2),
    "repetition only": dict(repetition_penalty=1.1),
    "allowed ids (64) + bias (8)": dict(allowed_token_ids=list(range(100, 164)), logit_bias={i: 0.5 for i in range(8)}),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--history", type=int, default=640, help="tokens per row (prompt + output)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    device = torch.device(a.device)
    rng = random.Random(0)
    logits = torch.randn(a.rows, a.vocab, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results = []
    print(f"{a.rows} rows x {a.history} tokens, vocabulary {a.vocab}, {device}")
    print(f"{'case':<36} {'first step ms':>14} {'prepare ms':>11} {'apply ms':>9}")
    for name, kwargs in CASES.items():
        params = SamplingParams(temperature=0, max_tokens=1024, **kwargs)
        best_first = best_prepare = best_apply = float("inf")
        for _ in range(a.repeat):
            rows = [Sequence("bench", [rng.randrange(a.vocab) for _ in range(a.history)], a.prompt, params)
                    for _ in range(a.rows)]
            for r in rows:
                r.status = SequenceStatus.RUNNING
            counts = PenaltyCounts(a.rows, a.vocab, device)
            sync()
            t = time.perf_counter()
            Sampler.prepare(rows, a.vocab, device, counts=counts)  # the slots are taken and filled
            sync()
            best_first = min(best_first, time.perf_counter() - t)
            t = time.perf_counter()
            md = Sampler.prepare(rows, a.vocab, device, counts=counts)
            sync()
            best_prepare = min(best_prepare, time.perf_counter() - t)
            work = logits.clone()
            sync()
            t = time.perf_counter()
            Sampler._apply_penalties(work, md)
            sync()
            best_apply = min(best_apply, time.perf_counter() - t)
            del counts
        results.append({"case": name, "first_step_ms": best_first * 1000, "prepare_ms": best_prepare * 1000,
                        "apply_ms": best_apply * 1000})
        print(f"{name:<36} {best_first * 1000:>14.2f} {best_prepare * 1000:>11.2f} {best_apply * 1000:>9.2f}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"rows": a.rows, "history": a.history, "vocab": a.vocab, "device": str(device),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
