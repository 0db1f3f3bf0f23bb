"""Prefill CUDA graphs on the GPU: the same tokens as eager prefill, and what they do to a lone
request's time to first token. One engine; each trial runs with the graphs and without
(`runner.prefill_graphs` set aside), alternating, so both see the same machine state.

    python3 scripts/check_prefill_graphs.py --model models/configs/llama-3-8b --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_cli import add_engine_arguments, engine_values  # noqa: E402
from ttft_after_idle import busy, lone_ttft_ms  # noqa: E402
from backend import EngineArgs, LLMEngine, SamplingParams  # noqa: E402

# Prompt lengths per step: one prompt, a burst of several, and sizes past the largest graph.
WAVES = [[512], [17], [100, 200, 300], [1000], [40] * 8, [1500]]


def generate(engine: LLMEngine, prompts: list[list[int]], tag: str) -> list[list[tuple[int, float]]]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, SamplingParams(temperature=0, max_tokens=8, logprobs=0,
                                                              ignore_eos=True))
    got: dict[str, list[tuple[int, float]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            got.setdefault(out.request_id, []).extend(
                (t, lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs))
    return [got[f"{tag}-{i}"] for i in range(len(prompts))]


def compare(engine: LLMEngine, graphs, rng: random.Random) -> list[dict]:
    rows = []
    for w, lens in enumerate(WAVES):
        prompts = [[rng.randrange(100, 500) for _ in range(n)] for n in lens]
        engine.runner.prefill_graphs = graphs
        with_graphs = generate(engine, prompts, f"graph{w}")
        engine.runner.prefill_graphs = None
        eager = generate(engine, prompts, f"eager{w}")
        engine.runner.prefill_graphs = graphs
        first_equal = sum(a[0][0] == b[0][0] for a, b in zip(with_graphs, eager))
        all_equal = sum([t for t, _ in a] == [t for t, _ in b] for a, b in zip(with_graphs, eager))
        first_dlp = max(abs(a[0][1] - b[0][1]) for a, b in zip(with_graphs, eager))
        row = {"prompt_lens": lens, "prompts": len(lens), "first_token_equal": first_equal,
               "all_8_tokens_equal": all_equal, "max_first_logprob_diff": round(first_dlp, 5)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def summary(values: list[float]) -> dict:
    s = sorted(values)
    return {"median": round(statistics.median(s), 2), "p90": round(s[int(0.9 * (len(s) - 1))], 2),
            "min": round(s[0], 2), "max": round(s[-1], 2), "n": len(s)}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_engine_arguments(ap)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--json")
    a = ap.parse_args()
    values = engine_values(a)
    values.setdefault("enable_prefix_caching", "false")  # each run computes its whole prompt
    engine = LLMEngine(EngineArgs.from_strings(values))
    graphs = engine.runner.prefill_graphs
    if graphs is None:
        sys.exit("no prefill graphs: run on a GPU without enforce_eager and max_prefill_graph_tokens > 0")
    print(f"prefill graphs for token counts {graphs.sizes}", flush=True)
    rng = random.Random(0)
    rows = compare(engine, graphs, rng)
    ttft = {"graphs": [], "eager": []}
    first_step = {"graphs": [], "eager": []}
    for mode in ("graphs", "eager"):  # warm both paths
        engine.runner.prefill_graphs = graphs if mode == "graphs" else None
        lone_ttft_ms(engine, rng, a.input_len, f"warm-{mode}")
    for trial in range(a.trials):
        for mode in ("graphs", "eager") if trial % 2 == 0 else ("eager", "graphs"):
            engine.runner.prefill_graphs = graphs
            busy(engine, rng, 0.5, a.input_len)  # from a loaded GPU, as in ttft_after_idle.py
            time.sleep(0.2)
            engine.runner.prefill_graphs = graphs if mode == "graphs" else None
            r = lone_ttft_ms(engine, rng, a.input_len, f"t{trial}-{mode}")
            ttft[mode].append(r["ttft_ms"])
            first_step[mode].append(r["step_ms"][0])
    result = {"engine_args": values, "graph_sizes": graphs.sizes, "correctness": rows,
              "lone_ttft_ms": {m: summary(v) for m, v in ttft.items()},
              "lone_first_step_ms": {m: summary(v) for m, v in first_step.items()},
              "raw_ttft_ms": ttft}
    print(json.dumps({k: result[k] for k in ("lone_ttft_ms", "lone_first_step_ms")}, indent=1), flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
