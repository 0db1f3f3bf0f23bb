"""ENABLE_VLLM_HEALTH_CHECK's answer when the engine is gone, as Triton's vLLM backend gives it:
the requests are refused, and the model is unloaded once."""
from __future__ import annotations

from typing import Any, Callable


def refuse_unhealthy(pb_utils: Any, model_name: str, first: bool, sender: Any, errors: Any, requests: list,
                     details: Callable[[Any], bool]) -> None:
    """first: the first time the engine is found gone (the model is unloaded then)."""
    if first:
        pb_utils.Logger.log_error("[vllm] Engine is not healthy and model will be unloaded: "
                                  "tritium: the engine's process is gone")
        try:
            pb_utils.unload_model(model_name)  # non-blocking; needs explicit model control
        except Exception as e:
            pb_utils.Logger.log_warn(f"tritium: cannot unload the model: {e}")
    error = errors.unavailable("Model is unavailable due to unhealthy vLLM engine")
    for request in requests:
        sender.reject(request.get_response_sender(), error, details(request))
