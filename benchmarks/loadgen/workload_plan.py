"""Which benchmark workloads one model can serve, and the max_model_len its engine needs for
them: what benchmarks/gpu.sh e2e asks before it writes a model's repository.

    python -m benchmarks.loadgen.workload_plan --model-dir models/configs/qwen2.5-7b --workloads A,B,C,L \
        [--num-requests N --input-len N --output-len N] [--set KEY=VALUE]... [--json FILE]

Prints one line of three tab-separated fields for the shell: the workloads to run, those skipped
and the max_model_len to set ('-' for none: nothing skipped, the repository's value suffices).
The reasons go to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

from .bench_model_repo import get_parameters, parse_assignments
from .workloads import WORKLOADS, parse_workload_names, with_overrides

# The checkout's model repository (what gpu.sh serves), read unless --repo-config names another.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPO_CONFIG = os.path.join(ROOT, "model_repository", "llm", "config.pbtxt")


@dataclass(frozen=True)
class WorkloadPlan:
    run: list[str]
    skipped: dict[str, str]      # name -> why it cannot run on this model
    max_model_len: int | None    # to set in the model repository; None: keep its value


def repository_max_model_len(path: str = REPO_CONFIG) -> int:
    """The max_model_len of the model repository that the benchmark copies."""
    with open(path, encoding="utf-8") as f:
        return int(get_parameters(f.read())["max_model_len"])


def model_context_limit(model_dir: str) -> tuple[int, str]:
    """The longest sequence the engine serves for this model, and what sets it (sliding windows
    set nothing: the attention kernels apply them)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    limit = int(config.get("max_position_embeddings") or 4096)  # EngineConfig's fallback
    return limit, f"max_position_embeddings={limit}"


def plan(names: list[str], limit: int, limit_reason: str, repo_len: int,
         num_requests: int | None = None, input_len: int | None = None, output_len: int | None = None,
         given_len: int | None = None) -> WorkloadPlan:
    """Workloads whose prompt + output exceed the model's limit (or a max_model_len given with
    --engine-arg) are skipped. When one that runs needs more than the repository's max_model_len,
    it is raised to what the longest defined workload that fits needs, so that a workload's
    figures do not depend on which others share the call (the decode graphs are sized by it)."""
    ceiling, why = (limit, limit_reason) if given_len is None or given_len >= limit else \
        (given_len, f"the max_model_len={given_len} given")
    sizes = (num_requests, input_len, output_len)
    run, skipped = [], {}
    for name in names:
        w = with_overrides(name, *sizes)
        if w.max_seq_len > ceiling:
            skipped[name] = f"{w.input_len:,} + {w.output_len:,} tokens exceed {why}"
        else:
            run.append(name)
    needs = [with_overrides(n, *sizes).max_seq_len for n in run]
    if given_len is not None or not needs or max(needs) <= repo_len:
        return WorkloadPlan(run, skipped, None)
    fitting = [with_overrides(n, *sizes).max_seq_len for n in WORKLOADS]
    return WorkloadPlan(run, skipped, max(n for n in fitting if n <= ceiling))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True, help="a directory with the model's config.json")
    ap.add_argument("--workloads", default="A,B")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--input-len", type=int)
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="the engine arguments the run sets (only max_model_len matters here)")
    ap.add_argument("--repo-config", default=REPO_CONFIG)
    ap.add_argument("--json", help="also write the plan here")
    args = ap.parse_args(argv)
    try:
        names = parse_workload_names(args.workloads)
        given = parse_assignments(args.set).get("max_model_len")
        given_len = int(given) if given is not None else None
    except ValueError as e:
        ap.error(str(e))
    limit, reason = model_context_limit(args.model_dir)
    repo_len = repository_max_model_len(args.repo_config)
    p = plan(names, limit, reason, repo_len, args.num_requests, args.input_len, args.output_len, given_len)
    model = os.path.basename(os.path.normpath(args.model_dir))
    note = f"max_model_len {p.max_model_len} (raised from the repository's {repo_len})" if p.max_model_len \
        else "max_model_len as configured"
    skipped = "; ".join(f"{n}: {why}" for n, why in p.skipped.items())
    print(f"{model}: workloads {','.join(p.run) or 'none'}; {note}"
          + (f"; skipped {skipped}" if skipped else ""), file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model_dir": os.path.abspath(args.model_dir), "context_limit": limit,
                       "limited_by": reason, "repository_max_model_len": repo_len, **asdict(p)}, f, indent=1)
    print("\t".join([",".join(p.run) or "-", ",".join(p.skipped) or "-", str(p.max_model_len or "-")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
