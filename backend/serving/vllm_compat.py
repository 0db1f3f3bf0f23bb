"""What a model repository written for Triton's vLLM backend says, and what Tritium makes of it.

Triton's vLLM backend reads vLLM engine arguments from `1/model.json` and a few keys of its own
from config.pbtxt parameters. Tritium accepts the same files: the vLLM engine arguments it
implements keep their names; those it does not implement are accepted only where ignoring them
cannot change what a client gets (each with a log line), and refused with the reason otherwise.
"""
from __future__ import annotations

import json
import os
from typing import Any

MODEL_JSON = "model.json"

# The vLLM backend's own config.pbtxt keys (not engine arguments), and the python backend's.
REPORT_CUSTOM_METRICS = "REPORT_CUSTOM_METRICS"
ENABLE_VLLM_HEALTH_CHECK = "ENABLE_VLLM_HEALTH_CHECK"
GPU_DEVICE_IDS = "GPU_DEVICE_IDS"
TRITON_KEYS = frozenset({REPORT_CUSTOM_METRICS, ENABLE_VLLM_HEALTH_CHECK, GPU_DEVICE_IDS,
                         "EXECUTION_ENV_PATH"})

# vLLM engine arguments Tritium does without: ignoring them changes no response.
IGNORED = {
    "disable_log_requests": "Tritium does not log requests",
    "enable_log_requests": "Tritium does not log requests",
    "disable_log_stats": "Tritium logs no periodic statistics; true also turns the vllm: metrics "
                         "off, as in the vLLM backend",
    "disable_custom_all_reduce": "Tritium has no custom all-reduce",
    "max_seq_len_to_capture": "Tritium sizes its CUDA graphs itself (max_prefill_graph_tokens)",
    "trust_remote_code": "Tritium runs its own model code, never a model's remote code",
    "served_model_name": "Triton names the model (the model directory's name)",
    "tokenizer_mode": "Tritium loads the model's Hugging Face tokenizer",
    "disable_async_output_proc": "Tritium's output processing overlaps steps by itself",
    "compilation_config": "Tritium does not use torch.compile",
}
# vLLM engine arguments that are harmless only at their default (the single-device case, ...).
AT_DEFAULT_ONLY = {
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
    "revision": None,
    "tokenizer_revision": None,
    "code_revision": None,
    "max_num_partial_prefills": 1,
}


def read_model_json(version_dir: str | None) -> dict[str, Any] | None:
    """`<version_dir>/model.json` as the vLLM backend reads it, or None when there is none."""
    if not version_dir:
        return None
    path = os.path.join(version_dir, MODEL_JSON)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            value = json.load(f)
        except ValueError as e:
            raise ValueError(f"1/{MODEL_JSON} is not valid JSON: {e}.") from None
    if not isinstance(value, dict):
        raise ValueError(f"1/{MODEL_JSON} must be a JSON object of vLLM engine arguments, "
                         f"got {type(value).__name__}.")
    return value


def as_string(value: Any) -> str:
    """A model.json value in the string form of config.pbtxt parameters."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def same_value(a: str, b: str) -> bool:
    """Whether two string forms of an argument say the same (true/True, 16/16.0, JSON spacing)."""
    a, b = a.strip(), b.strip()
    if a.lower() == b.lower():
        return True
    try:
        return json.loads(a.lower() if a.lower() in ("true", "false") else a) == \
            json.loads(b.lower() if b.lower() in ("true", "false") else b)
    except ValueError:
        return False


def drop_unimplemented(values: dict[str, str]) -> list[str]:
    """Remove the vLLM engine arguments Tritium does without from `values` (in place); returns
    one log line for each. Raises ValueError for one that would change what clients get."""
    notes = []
    for key in list(values):
        if key in IGNORED:
            notes.append(f"tritium: ignoring vLLM engine argument {key}={values.pop(key)}: {IGNORED[key]}")
        elif key in AT_DEFAULT_ONLY:
            default, value = AT_DEFAULT_ONLY[key], values.pop(key)
            if not same_value(value, as_string(default)):
                raise ValueError(f"vLLM engine argument '{key}' is not supported by Tritium with a value "
                                 f"other than {as_string(default)}, got {value!r}.")
            notes.append(f"tritium: vLLM engine argument {key}={value} is Tritium's only behaviour")
        elif key == "distributed_executor_backend" and values[key].strip() == "ray":
            values.pop(key)  # Tritium's default executor for this tensor_parallel_size
            notes.append(_ray_note(values.get("tensor_parallel_size", "1")))
    return notes


def _ray_note(tensor_parallel_size: str) -> str:
    """The log line for `distributed_executor_backend: "ray"` (the vLLM backend's multi-GPU
    samples): Tritium has no Ray workers, its own processes on this host run the same ranks."""
    try:
        ranks = int(tensor_parallel_size)
    except ValueError:
        ranks = 0  # the engine arguments refuse it, naming tensor_parallel_size
    if ranks > 1:
        return (f"tritium: distributed_executor_backend=ray: the {ranks} tensor-parallel ranks run as Tritium's "
                f"own processes on this host ('mp'), not as Ray workers")
    return ("tritium: distributed_executor_backend=ray: the one rank runs in Tritium's engine process "
            "('uni'), not as a Ray worker")


def device_ids(text: str) -> str:
    """GPU_DEVICE_IDS as the vLLM backend checks it: distinct non-negative integers."""
    try:
        ids = [int(x.strip()) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"Invalid value for GPU_DEVICE_IDS: '{text}'. Expected a comma-separated "
                         f"list of integer GPU IDs (e.g., '0,1,2').") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"GPU_DEVICE_IDS must hold distinct non-negative GPU IDs, got '{text}'.")
    return ",".join(map(str, ids))
