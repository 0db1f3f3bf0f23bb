"""The `tritium` command.

    tritium serve MODEL_DIR [--served-model-name NAME] [engine flags, vLLM's names]
    tritium serve --model-repository DIR
    tritium bench --url HOST:8001 --workload A [load generator flags]
"""
from __future__ import annotations

import sys

_COMMANDS = {"serve": "tritonserver and the OpenAI-compatible frontend, serving a model",
             "bench": "the benchmark workloads against a running server (tritium bench --help)"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else (None, [])
    if command == "serve":
        from .serve import main as serve

        return serve(rest)
    if command == "bench":
        # The load generator's own command line, written once (benchmarks/loadgen/bench.py).
        from tritium.bench.bench import main as bench

        return bench(rest, prog="tritium bench")
    usage = __doc__.strip().split("\n\n", 1)[1] + "\n\n" + "\n".join(
        f"  {name:6} {what}" for name, what in _COMMANDS.items())
    if command in ("-h", "--help"):
        print(f"usage:\n{usage}")
        return 0
    print(f"usage:\n{usage}\ntritium: error: " + (f"unknown command {command!r}" if command else "give a command"),
          file=sys.stderr)
    return 2
