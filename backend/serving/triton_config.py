"""Engine arguments from a Triton model configuration's `parameters` section."""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

from backend.config import EngineArgs, parse_bool

_PATH_ARGUMENTS = ("model", "tokenizer")


MULTI_LORA_FILE = "multi_lora.json"


def engine_args_from_model_config(parameters: Mapping[str, Any], root: str,
                                  version_dir: str | None = None) -> EngineArgs:
    """Build EngineArgs from `parameters { key: "<argument>" value { string_value: "..." } }`.

    `parameters` is the model config's JSON form ({key: {"string_value": v}}) or plain strings.
    Relative `model` / `tokenizer` paths are taken relative to `root` (the repository root);
    absolute paths are used as they are. With `enable_lora`, the adapters are those of
    `lora_modules` (a JSON object of names to directories) or else, as Triton's vLLM backend
    reads them, of `multi_lora.json` in the model's version directory; their relative paths
    too are taken relative to `root`. Raises ValueError naming a bad or unknown argument.
    """
    values: dict[str, str] = {}
    for key, value in parameters.items():
        if isinstance(value, Mapping):
            value = value.get("string_value", "")
        if not isinstance(value, str):
            raise ValueError(f"model parameter '{key}' must be a string_value.")
        values[key] = value
    for key in _PATH_ARGUMENTS:
        if values.get(key):
            values[key] = _resolve(values[key], root)
    if version_dir and "lora_modules" not in values and parse_bool(values.get("enable_lora", "")):
        path = os.path.join(version_dir, MULTI_LORA_FILE)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                values["lora_modules"] = f.read()
    if values.get("lora_modules"):
        try:
            modules = json.loads(values["lora_modules"])
        except ValueError:
            raise ValueError(f"lora_modules: not a JSON object of adapter names to directories: "
                             f"{values['lora_modules'][:200]!r}.") from None
        if not isinstance(modules, dict) or not all(isinstance(p, str) for p in modules.values()):
            raise ValueError(f"lora_modules must map adapter names to directories, got {modules!r}.")
        values["lora_modules"] = json.dumps({name: _resolve(p, root) for name, p in modules.items()})
    if parse_bool(values.get("enable_lora", "")) and not values.get("lora_modules"):
        # Through Triton a request names an adapter; it cannot bring one (as with Triton's vLLM backend).
        raise ValueError(f"enable_lora: no adapters to serve; list them in 1/{MULTI_LORA_FILE} or a "
                         f"lora_modules parameter.")
    if not values.get("model"):
        raise ValueError("the model configuration needs a 'model' parameter: "
                         "the path of a Hugging Face model directory.")
    return EngineArgs.from_strings(values)


def _resolve(path: str, root: str) -> str:
    path = os.path.expanduser(path.strip())
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(root, path))
