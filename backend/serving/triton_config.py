"""Engine arguments from a Triton model configuration: its `parameters` and `1/model.json`."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from tritium.config import EngineArgs, parse_bool
from . import vllm_compat

_PATH_ARGUMENTS = ("model", "tokenizer")


MULTI_LORA_FILE = "multi_lora.json"
# A Triton-level setting, not an engine argument (vLLM has none): how long an unload lets the
# running requests finish before it aborts them.
DRAIN_TIMEOUT_S = "drain_timeout_s"
DEFAULT_DRAIN_TIMEOUT_S = 30.0


@dataclass
class ServingConfig:
    """What a model's configuration asks of the engine and of the Triton adapter."""

    engine_args: EngineArgs
    report_metrics: bool = False  # the vllm: metrics (REPORT_CUSTOM_METRICS, disable_log_stats)
    health_check: bool = False  # ENABLE_VLLM_HEALTH_CHECK: check the engine before each batch
    gpu_device_ids: str | None = None  # GPU_DEVICE_IDS: CUDA_VISIBLE_DEVICES for the engine
    notes: list[str] = field(default_factory=list)  # log lines: arguments accepted but ignored
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # unload: running requests' grace period


def serving_config(parameters: Mapping[str, Any], root: str, version_dir: str | None = None,
                   cwd: str | None = None) -> ServingConfig:
    """The model's configuration from config.pbtxt `parameters` and `<version_dir>/model.json`.

    config.pbtxt parameters are strings; their relative `model`, `tokenizer` and `lora_modules`
    paths are taken from `root` (the Tritium checkout). model.json holds vLLM engine arguments as
    JSON, as Triton's vLLM backend reads it; its relative paths, and those of multi_lora.json,
    are taken from `cwd` (the server's working directory), where vLLM looks for them. A key set
    in both must say the same. The vLLM backend's keys (REPORT_CUSTOM_METRICS,
    ENABLE_VLLM_HEALTH_CHECK, GPU_DEVICE_IDS) keep its meaning: metrics and the health check
    are off unless set true. Raises ValueError naming a bad, unknown or conflicting argument.
    """
    cwd = cwd or os.getcwd()
    values: dict[str, str] = {}
    for key, value in parameters.items():
        if isinstance(value, Mapping):
            value = value.get("string_value", "")
        if not isinstance(value, str):
            raise ValueError(f"model parameter '{key}' must be a string_value.")
        values[key] = value
    triton = {k: values.pop(k) for k in list(values) if k in vllm_compat.TRITON_KEYS}
    drain = _drain_timeout(values.pop(DRAIN_TIMEOUT_S, None))
    for key in _PATH_ARGUMENTS:
        if values.get(key):
            values[key] = _resolve(values[key], root)
    model_json = vllm_compat.read_model_json(version_dir)
    from_json: set[str] = set()
    for key, raw in (model_json or {}).items():
        value = vllm_compat.as_string(raw)
        if key in _PATH_ARGUMENTS and isinstance(raw, str) and raw:
            value = _resolve(raw, cwd)
        if key in values and not (vllm_compat.same_value(values[key], value)
                                  or key in _PATH_ARGUMENTS and values[key] == value):
            raise ValueError(f"engine argument '{key}' is set differently in config.pbtxt "
                             f"parameters ({values[key]!r}) and in 1/{vllm_compat.MODEL_JSON} ({value!r}).")
        values[key] = value
        from_json.add(key)
    # Off unless asked for, as in the vLLM backend: its repositories expect no vllm: metrics.
    metrics = _flag(triton, vllm_compat.REPORT_CUSTOM_METRICS, False)
    if parse_bool(values.get("disable_log_stats", "false")):
        metrics = False
    notes = vllm_compat.drop_unimplemented(values)
    lora_base = root
    if version_dir and "lora_modules" not in values and parse_bool(values.get("enable_lora", "")):
        path = os.path.join(version_dir, MULTI_LORA_FILE)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                values["lora_modules"] = f.read()
            lora_base = cwd  # as the vLLM backend: its paths go to vLLM as they are
    elif "lora_modules" in from_json:
        lora_base = cwd
    devices = triton.get(vllm_compat.GPU_DEVICE_IDS, "").strip()
    return ServingConfig(_engine_args(values, lora_base), report_metrics=metrics,
                         health_check=_flag(triton, vllm_compat.ENABLE_VLLM_HEALTH_CHECK, False),
                         gpu_device_ids=vllm_compat.device_ids(devices) if devices else None,
                         notes=notes, drain_timeout_s=drain)


def _drain_timeout(value: str | None) -> float:
    if value is None or not value.strip():
        return DEFAULT_DRAIN_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0.0 <= seconds < float("inf"):
        raise ValueError(f"{DRAIN_TIMEOUT_S} must be a number of seconds >= 0, got {value!r}.")
    return seconds


def engine_args_from_model_config(parameters: Mapping[str, Any], root: str,
                                  version_dir: str | None = None, cwd: str | None = None) -> EngineArgs:
    """`serving_config(...).engine_args`."""
    return serving_config(parameters, root, version_dir, cwd).engine_args


def _flag(values: dict[str, str], key: str, default: bool) -> bool:
    if key not in values:
        return default
    value = parse_bool(values[key])
    if value is None:
        raise ValueError(f"{key} must be true or false, got {values[key]!r}.")
    return value


def _engine_args(values: dict[str, str], lora_base: str) -> EngineArgs:
    """EngineArgs from string values, adapters' relative paths taken from `lora_base`."""
    if values.get("lora_modules"):
        try:
            modules = json.loads(values["lora_modules"])
        except ValueError:
            raise ValueError(f"lora_modules: not a JSON object of adapter names to directories: "
                             f"{values['lora_modules'][:200]!r}.") from None
        if not isinstance(modules, dict) or not all(isinstance(p, str) for p in modules.values()):
            raise ValueError(f"lora_modules must map adapter names to directories, got {modules!r}.")
        values["lora_modules"] = json.dumps({name: _resolve(p, lora_base) for name, p in modules.items()})
    if parse_bool(values.get("enable_lora", "")) and not values.get("lora_modules"):
        # Through Triton a request names an adapter; it cannot bring one (as with Triton's vLLM backend).
        raise ValueError(f"enable_lora: no adapters to serve; list them in 1/{MULTI_LORA_FILE} or a "
                         f"lora_modules parameter.")
    if not values.get("model"):
        raise ValueError("the model configuration needs a 'model' parameter (or 'model' in "
                         "1/model.json): the path of a Hugging Face model directory.")
    return EngineArgs.from_strings(values)


def _resolve(path: str, root: str) -> str:
    path = os.path.expanduser(path.strip())
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(root, path))
