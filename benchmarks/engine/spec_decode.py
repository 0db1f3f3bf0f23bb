"""What speculative decoding (n-gram, `speculative_config`) gains and costs, in-process: requests
decoded plainly and with proposals of k tokens, by one engine, for batches of 1 and more.

The gain depends on how often proposals are right, which random weights cannot show honestly,
so the proposals come from three sources: `ngram` (the real proposer: on random weights it is
right only where the output happens to repeat), `oracle` (the continuation the plain run
produced: every proposal right, the best case for this k) and `wrong` (every proposal wrong:
the cost of verifying for nothing). Each run's tokens are compared with the plain run's: in
float32 they are equal (tests/engine/test_spec_decode.py); in bf16 a verification step computes
a position in other kernels than a decode step, so a near-tie may flip a token, and the
continuation (and an oracle's proposals after it) with it. Batches of at most
SPEC_GRAPH_MAX_SEQS sequences (backend/worker/cuda_graph.py) verify in CUDA graphs; larger
ones do not speculate (1.00x). `--spec-graph-seqs` sets that limit for this run, to measure
where speculation stops paying. `--params` adds sampling parameters to the greedy requests
(penalties, a seed with a temperature, bad words, a grammar): every kind speculates, and a
seeded request's tokens are its plain run's.

    python -m benchmarks.engine.spec_decode --model models/configs/llama-3-8b --tokenizer models/tiny-llama \
        --k 4 --batch-sizes 1,8,16,32 --json spec.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from benchmarks.loadgen.workloads import make_prompts


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of sampling parameters, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--batch-sizes", default="1,8,16,32")
    ap.add_argument("--spec-graph-seqs", type=int, help="most sequences a verification graph takes "
                    "(and so most that speculate); default backend.worker.cuda_graph.SPEC_GRAPH_MAX_SEQS")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--modes", default="ngram,oracle,wrong")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--params", type=_json_object, default={}, help="JSON object of sampling parameters for every "
                    "request, over the default greedy, ignore_eos and max_tokens=--output-len")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from tritium import LLM, SamplingParams
    from tritium.worker import worker
    from benchmarks.loadgen.bench_model_repo import parse_assignments
    if args.spec_graph_seqs:
        worker.SPEC_GRAPH_MAX_SEQS = args.spec_graph_seqs

    # No prefix caching: every mode runs the same prompts, and later runs would skip the prefill.
    values: dict[str, Any] = {"load_format": "dummy", "dtype": "bfloat16", "enable_prefix_caching": False}
    values.update(parse_assignments(args.engine_arg))
    if args.tokenizer:
        values["tokenizer"] = args.tokenizer
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    llm = LLM(args.model, speculative_config=spec, **values)
    engine = llm.engine
    proposer, real_propose = engine.proposer, engine.proposer.propose
    params = SamplingParams(**{"temperature": 0, "max_tokens": args.output_len, "ignore_eos": True,
                               **args.params})
    rows: list[dict[str, Any]] = []

    def timed(prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]

    for bs in [int(b) for b in args.batch_sizes.split(",") if b]:
        prompts = make_prompts(bs, args.input_len, 7, f"spec-{bs}")
        engine.proposer = None  # plain decoding: the pipelined engine
        timed(make_prompts(bs, args.input_len, 8, f"spec-warm-{bs}"))
        _, truth = timed(prompts)
        by_prompt = {tuple(p): t for p, t in zip(prompts, truth)}
        for rnd in range(1, args.rounds + 1):  # the modes alternate with plain runs, round by round
            for mode in ["plain"] + [m for m in args.modes.split(",") if m]:
                engine.proposer = None if mode == "plain" else proposer
                if mode == "ngram":
                    proposer.propose = real_propose
                elif mode != "plain":
                    def propose(token_ids, max_tokens, key=None, wrong=(mode == "wrong")):
                        # Every prompt has input_len tokens: one lookup, not one per prompt (a
                        # scan of all prompts per sequence would be host time the real proposer
                        # does not spend).
                        out = by_prompt.get(tuple(token_ids[:args.input_len]))
                        if out is None:
                            return []
                        done = len(token_ids) - args.input_len
                        guess = out[done:done + min(args.k, max_tokens)]
                        return [(t + 1) % 1000 for t in guess] if wrong else list(guess)
                    proposer.propose = propose
                before = engine.get_stats()
                seconds, got = timed(prompts)
                after = engine.get_stats()
                rows.append({"batch": bs, "round": rnd, "mode": mode, "seconds": seconds,
                             "tok_s": bs * args.output_len / seconds,
                             "draft_tokens": after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                             "accepted": after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
                             "tokens_equal_plain": got == truth})
    graph_seqs = engine.max_speculating_seqs
    print(f"\nspeculative decoding, k={args.k}, {args.input_len} in / {args.output_len} out, {args.model}, "
          f"speculating up to {graph_seqs} sequences, parameters {json.dumps(args.params)}")
    print(f"{'batch':>5} {'proposals':<9} {'tok/s (mean)':>13} {'vs plain':>9} {'accepted':>14} {'same tokens':>12}")
    summary = []
    for bs in dict.fromkeys(r["batch"] for r in rows):
        plain = [r["tok_s"] for r in rows if r["batch"] == bs and r["mode"] == "plain"]
        for mode in dict.fromkeys(r["mode"] for r in rows if r["batch"] == bs):
            mine = [r for r in rows if r["batch"] == bs and r["mode"] == mode]
            mean = sum(r["tok_s"] for r in mine) / len(mine)
            ratio = mean / (sum(plain) / len(plain))
            acc = "" if mode == "plain" else f"{sum(r['accepted'] for r in mine)}/{sum(r['draft_tokens'] for r in mine)}"
            same = all(r["tokens_equal_plain"] for r in mine)
            summary.append({"batch": bs, "mode": mode, "tok_s": mean, "vs_plain": ratio, "tokens_equal_plain": same})
            print(f"{bs:>5} {mode:<9} {mean:>13,.1f} {ratio:>8.2f}x {acc:>14} {str(same):>12}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"k": args.k, "input_len": args.input_len, "output_len": args.output_len,
                       "params": args.params,
                       "model": args.model, "max_speculating_seqs": graph_seqs, "rows": rows,
                       "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
