"""Engine arguments from a Triton model configuration's `parameters` section."""
from __future__ import annotations

import os
from typing import Any, Mapping

from backend.config import EngineArgs

_PATH_ARGUMENTS = ("model", "tokenizer")


def engine_args_from_model_config(parameters: Mapping[str, Any], root: str) -> EngineArgs:
    """Build EngineArgs from `parameters { key: "<argument>" value { string_value: "..." } }`.

    `parameters` is the model config's JSON form ({key: {"string_value": v}}) or plain strings.
    Relative `model` / `tokenizer` paths are taken relative to `root` (the repository root);
    absolute paths are used as they are. Raises ValueError naming a bad or unknown argument.
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
            path = os.path.expanduser(values[key].strip())
            values[key] = path if os.path.isabs(path) else os.path.normpath(os.path.join(root, path))
    if not values.get("model"):
        raise ValueError("the model configuration needs a 'model' parameter: "
                         "the path of a Hugging Face model directory.")
    return EngineArgs.from_strings(values)
