"""The model repository `tritium serve MODEL_DIR` writes: one model served by the `tritium` backend,
its engine arguments as config.pbtxt string parameters (as model_repository/llm/ has them, and
where the OpenAI frontend reads the model's tokenizer and max_model_len)."""
from __future__ import annotations

import os
import re
from typing import Any

from tritium.serving import vllm_compat

DEFAULT_MODEL_NAME = "llm"
_NOT_IN_A_TRITON_NAME = re.compile(r"[^A-Za-z0-9_.-]")


def triton_model_name(served_name: str | None) -> str:
    """The Triton model (directory) name for a served name: the name itself where Triton allows
    it, else with each other character replaced (a Hugging Face id's '/', say)."""
    if not served_name:
        return DEFAULT_MODEL_NAME
    name = _NOT_IN_A_TRITON_NAME.sub("_", served_name)
    return DEFAULT_MODEL_NAME if name in (".", "..") else name


def config_pbtxt(arguments: dict[str, Any]) -> str:
    """A config.pbtxt for the `tritium` backend with these engine arguments; Triton's
    auto-complete adds the inputs and outputs (tritium.serving.model_config_check)."""
    lines = ["# Written by `tritium serve`: the engine arguments are the string parameters below.",
             'backend: "tritium"',
             "max_batch_size: 0  # the engine batches (continuous batching), not Triton",
             "model_transaction_policy { decoupled: true }",
             "instance_group [ { count: 1 kind: KIND_MODEL } ]",
             # vLLM's metrics on Triton's metrics endpoint (off unless set, as in the vLLM backend).
             _parameter(vllm_compat.REPORT_CUSTOM_METRICS, "true")]
    lines += [_parameter(key, vllm_compat.as_string(value)) for key, value in arguments.items()]
    return "\n".join(lines) + "\n"


def write_model_repository(dest: str, name: str, arguments: dict[str, Any]) -> str:
    """`dest`/`name`/config.pbtxt (and the version directory 1/); returns `dest`."""
    model_dir = os.path.join(dest, name)
    os.makedirs(os.path.join(model_dir, "1"), exist_ok=True)
    with open(os.path.join(model_dir, "config.pbtxt"), "w", encoding="utf-8") as f:
        f.write(config_pbtxt(arguments))
    return dest


def _parameter(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value {{ string_value: "{_quoted(value)}" }} }}'


def _quoted(text: str) -> str:
    # Protocol-buffer text format: a JSON value's quotes and any backslash or line break escaped.
    return (text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
            .replace("\r", "\\r").replace("\t", "\\t"))
