"""What speculation with a draft model or EAGLE-3 heads costs and gains per step, in-process,
on workload B (one request, 512 tokens in, 128 out): the draft's time per step (its first pass
and k - 1 one-token passes), the verification step's, and decode tok/s at the two bounds of
acceptance, against plain decoding on the same card.

Random weights (load_format=dummy) give no real acceptance, so acceptance is forced while the
draft still runs every step: `accept-all` proposes the plain run's continuation (every
proposal kept: k + 1 tokens a step), `accept-none` proposes wrong tokens (1 token a step), and
`draft` keeps the draft's own proposals (random: about none kept). Step time hardly depends on
acceptance, so the speed-up at an acceptance length tau (tokens a step) is predicted as
tau * plain step time / speculative step time, printed for `--tau` values.

    python -m benchmarks.engine.draft_speculation --model models/configs/llama-3-8b \
        --tokenizer models/tiny-llama --k 4 --drafts draft_model,eagle3 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from benchmarks.loadgen.workloads import make_prompts


def draft_dir(kind: str, target: str, out: str) -> dict[str, Any]:
    """The speculative config of a one-layer draft of the target's shape, or an EAGLE-3 head of
    its shape (config only: the weights are random, load_format=dummy)."""
    with open(os.path.join(target, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    os.makedirs(out, exist_ok=True)
    if kind == "draft_model":
        config["num_hidden_layers"] = 1
        with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        return {"model": out}
    from scripts.build_eagle_head import eagle3_head_config
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(eagle3_head_config(config), f)
    return {"method": "eagle3", "model": out}


def run_b(engine, prompt: list[int], params, propose=None) -> dict[str, Any]:
    """One request stepped to its end: TTFT, decode time and steps, draft time in the worker."""
    drafter = engine.executor.worker.drafter
    draft_s = [0.0]
    if drafter is not None:
        import torch
        real = drafter.propose
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

        def timed(*a):
            sync()
            t = time.perf_counter()
            out = real(*a)
            sync()
            draft_s[0] += time.perf_counter() - t
            return out
        drafter.propose = timed
    if propose is not None:
        engine._propose = propose
    t0 = time.perf_counter()
    engine.add_request("b", prompt, params)
    first = None
    steps = 0
    draft_at_first = 0.0
    tokens = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is not None:
            steps += 1
        for o in outs:
            if first is None and o.outputs and o.outputs[0].token_ids:
                first, draft_at_first = time.perf_counter(), draft_s[0]
            if o.outputs:
                tokens += o.outputs[0].token_ids  # (the engine's outputs are deltas)
    end = time.perf_counter()
    if drafter is not None:
        drafter.propose = real
    if propose is not None:
        del engine._propose
    decode_s = end - first
    return {"ttft_ms": (first - t0) * 1e3, "decode_tok_s": (len(tokens) - 1) / decode_s, "steps": steps,
            "ms_per_step": decode_s * 1e3 / max(steps, 1),
            "draft_ms_per_step": (draft_s[0] - draft_at_first) * 1e3 / max(steps, 1), "tokens": tokens}


def bench_speculation(llm, kind: str, rounds: int, prompt, warm, params, truth: list[int]) -> list[dict[str, Any]]:
    """Each forced acceptance and the draft's own, round by round; the engine is shut down
    after (one 8B engine at a time on the card)."""
    engine, rows = llm.engine, []
    real_propose = engine._propose

    def forced(wrong: bool):
        def propose():
            out = {}
            for sid, proposed in real_propose().items():
                done = engine.scheduler.sequences[sid].num_output_tokens
                guess = truth[done:done + len(proposed)]
                out[sid] = [(t + 1) % 1000 for t in guess] if wrong else list(guess)
            return out
        return propose
    run_b(engine, warm, params)
    for rnd in range(rounds):
        for mode in ("accept-all", "accept-none", "draft"):
            before = engine.get_stats()
            r = run_b(engine, prompt, params, None if mode == "draft" else forced(mode == "accept-none"))
            after = engine.get_stats()
            same = r.pop("tokens") == truth
            rows.append({"config": kind, "mode": mode, "round": rnd, "tokens_equal_plain": same,
                         "draft_tokens": after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                         "accepted": after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
                         **r})
    del engine, real_propose, forced
    llm.shutdown()
    _report_memory(kind)
    return rows


def _report_memory(after: str) -> None:
    import torch
    if torch.cuda.is_available():
        print(f"after {after}: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--drafts", default="draft_model,eagle3")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tau", default="2.0,3.0,3.5", help="acceptance lengths (tokens a step) to predict at")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from tritium import LLM, SamplingParams
    # Workload B is one request: few graph sizes to capture (three engines start).
    common = {"load_format": "dummy", "dtype": "bfloat16", "enable_prefix_caching": False, "max_num_seqs": 8,
              "gpu_memory_utilization": 0.85, "max_model_len": min(4096, args.input_len + args.output_len + 64)}
    if args.tokenizer:
        common["tokenizer"] = args.tokenizer
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompt = make_prompts(1, args.input_len, 7, "draft-b")[0]
    warm = make_prompts(1, args.input_len, 8, "draft-warm")[0]
    rows: list[dict[str, Any]] = []

    llm = LLM(args.model, **common)
    run_b(llm.engine, warm, params)
    truth = None
    for rnd in range(args.rounds):
        r = run_b(llm.engine, prompt, params)
        truth = r.pop("tokens")
        rows.append({"config": "plain", "mode": "plain", "round": rnd, **r})
    llm.shutdown()
    del llm
    _report_memory("plain")

    with tempfile.TemporaryDirectory() as tmp:
        for kind in [d for d in args.drafts.split(",") if d]:
            spec = {**draft_dir(kind, args.model, os.path.join(tmp, kind)), "num_speculative_tokens": args.k}
            rows += bench_speculation(LLM(args.model, speculative_config=spec, **common), kind, args.rounds,
                                      prompt, warm, params, truth)

    def mean(cfg, mode, key):
        vals = [r[key] for r in rows if r["config"] == cfg and r["mode"] == mode]
        return sum(vals) / len(vals)
    plain_step = mean("plain", "plain", "ms_per_step")
    print(f"\nworkload B ({args.input_len} in / {args.output_len} out), {args.model}, bf16, k={args.k}; "
          f"random weights: acceptance forced (accept-all / accept-none) or the random draft's own")
    print(f"{'config':<12} {'mode':<12} {'decode tok/s':>12} {'steps':>6} {'ms/step':>8} {'draft ms':>9} "
          f"{'verify ms':>10} {'accepted':>10} {'same tokens':>11}")
    summary = []
    for cfg in dict.fromkeys(r["config"] for r in rows):
        for mode in dict.fromkeys(r["mode"] for r in rows if r["config"] == cfg):
            mine = [r for r in rows if r["config"] == cfg and r["mode"] == mode]
            row = {k: mean(cfg, mode, k) for k in ("decode_tok_s", "steps", "ms_per_step", "draft_ms_per_step")}
            row["verify_ms_per_step"] = row["ms_per_step"] - row["draft_ms_per_step"]
            acc = "" if mode == "plain" else f"{sum(r['accepted'] for r in mine)}/{sum(r['draft_tokens'] for r in mine)}"
            same = "" if mode == "plain" else str(all(r["tokens_equal_plain"] for r in mine))
            summary.append({"config": cfg, "mode": mode, **row})
            print(f"{cfg:<12} {mode:<12} {row['decode_tok_s']:>12,.1f} {row['steps']:>6.0f} {row['ms_per_step']:>8.2f} "
                  f"{row['draft_ms_per_step']:>9.2f} {row['verify_ms_per_step']:>10.2f} {acc:>10} {same:>11}")
    taus = [float(t) for t in args.tau.split(",") if t]
    print(f"\npredicted decode speed-up over plain ({plain_step:.2f} ms a token) at acceptance length tau "
          f"(tokens a step; at most k + 1 = {args.k + 1}), step time = mean of accept-all and accept-none:")
    predicted = []
    for cfg in dict.fromkeys(r["config"] for r in rows if r["config"] != "plain"):
        step = (mean(cfg, "accept-all", "ms_per_step") + mean(cfg, "accept-none", "ms_per_step")) / 2
        cells = {t: min(t, args.k + 1) * plain_step / step for t in taus}
        predicted.append({"config": cfg, "step_ms": step, "speedup_at_tau": cells})
        print(f"  {cfg:<12} step {step:.2f} ms: " + ", ".join(f"tau {t:g} -> {v:.2f}x" for t, v in cells.items()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"k": args.k, "model": args.model, "input_len": args.input_len, "output_len": args.output_len,
                       "rows": rows, "summary": summary, "predicted": predicted}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
