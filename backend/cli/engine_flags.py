"""`tritium serve`'s engine flags: one per EngineArgs field, spelt as vLLM spells them
(`max_model_len` is `--max-model-len`), typed by the field (a dict-valued one takes JSON)."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import fields
from typing import Any, Callable

from tritium.config import EngineArgs

# vLLM's short forms.
ALIASES = {"tensor_parallel_size": ("-tp",), "quantization": ("-q",)}
# Given by MODEL_DIR, not by a flag.
POSITIONAL = ("model",)
# vLLM arguments that Tritium accepts and ignores (tritium.serving.vllm_compat logs each at load):
# taken so that a vLLM command line works unchanged.
IGNORED_FLAGS = {"trust_remote_code": "vLLM's; Tritium runs its own model code, so it is ignored"}
# Paths a user gives relative to where they run the command; the server may run elsewhere.
PATH_FIELDS = ("tokenizer",)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for each engine argument. Only flags given appear in the parsed namespace, so the
    engine's own defaults (tritium.config) stay the only ones."""
    group = parser.add_argument_group("engine arguments (vLLM's names; docs/serving.md)")
    for field in fields(EngineArgs):
        if field.name in POSITIONAL:
            continue
        names = (*ALIASES.get(field.name, ()), "--" + field.name.replace("_", "-"))
        kind = _kind(str(field.type))
        if kind == "bool":
            group.add_argument(*names, dest=field.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=f"(default: {field.default})")
        else:
            group.add_argument(*names, dest=field.name, type=_PARSERS[kind], default=argparse.SUPPRESS,
                               metavar="JSON" if kind == "dict" else kind.upper(),
                               help=f"(default: {_default(field)})")
    for name, why in IGNORED_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), dest=name, action="store_true",
                           default=argparse.SUPPRESS, help=why)


def engine_arguments(namespace: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    """The engine arguments the command line gives (MODEL_DIR as `model`), paths made absolute."""
    given = {f.name: getattr(namespace, f.name) for f in fields(EngineArgs) if hasattr(namespace, f.name)}
    given["model"] = os.path.abspath(model_dir)
    for name in PATH_FIELDS:
        if given.get(name):
            given[name] = os.path.abspath(given[name])
    if given.get("lora_modules"):
        given["lora_modules"] = {k: os.path.abspath(v) if isinstance(v, str) else v
                                 for k, v in given["lora_modules"].items()}
    spec = given.get("speculative_config")
    if spec and isinstance(spec.get("model"), str) and os.path.isdir(spec["model"]):
        given["speculative_config"] = {**spec, "model": os.path.abspath(spec["model"])}
    return given


def ignored_arguments(namespace: argparse.Namespace) -> dict[str, Any]:
    """The vLLM arguments given that Tritium ignores (passed on, so the server says so)."""
    return {name: getattr(namespace, name) for name in IGNORED_FLAGS if hasattr(namespace, name)}


def check_engine_arguments(arguments: dict[str, Any]) -> None:
    """Raises ValueError naming a bad argument, as the server would at load, before anything starts."""
    EngineArgs.from_kwargs(**arguments)


def _kind(type_name: str) -> str:
    # The fields' annotations are strings (postponed evaluation): "int | None", "dict[str, Any] | None".
    base = type_name.replace(" ", "").replace("|None", "")
    for kind in ("bool", "int", "float", "dict"):
        if base.startswith(kind):
            return kind
    return "str"


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


_PARSERS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "dict": _json_object, "str": str}


def _default(field: Any) -> Any:
    return "none" if field.default is None else field.default
