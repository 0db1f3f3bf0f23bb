"""Command-line engine arguments shared by the profiling scripts: a model config run with dummy
(random) weights in bf16, any other engine argument as `--engine-arg KEY=VALUE`."""
from __future__ import annotations

import argparse


def add_engine_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer")
    ap.add_argument("--engine-arg", action="append", default=[])


def engine_values(a: argparse.Namespace) -> dict[str, str]:
    """The engine arguments as strings, for `EngineArgs.from_strings`."""
    values = {"model": a.model, "load_format": "dummy", "dtype": "bfloat16"}
    if a.tokenizer:
        values["tokenizer"] = a.tokenizer
    values.update(kv.split("=", 1) for kv in a.engine_arg)
    return values
