"""The entry point of disaggregated prefill inside Triton: a `tritium` model whose config sets
`disaggregated_prefill` ({"prefill_model": ..., "decode_model": ...}) runs no engine; it serves
the same request interface by sending each request to the prefill model (max_tokens 1,
kv_transfer_params {"do_remote_decode": true}) and then to the decode model with the
kv_transfer_params the prefill model returned, streaming the decode model's responses back
(Triton's business logic scripting: `pb_utils.InferenceRequest(...).exec(decoupled=True)`).

A failed prefill, or one that returns no parameters (its model unloaded, its engine gone),
fails the request with a clear error; the decode model's errors pass through.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Callable

import numpy as np

from tritium.serving.triton_request import MODEL_INFO

_CONTROL = ("sampling_parameters", "stream")  # set per call by the router


def router_targets(parameters: dict[str, Any]) -> tuple[str, str] | None:
    """(prefill model, decode model) when the config's parameters make this model a router."""
    raw = parameters.get("disaggregated_prefill", {}).get("string_value")
    if raw is None:
        return None
    try:
        d = json.loads(raw)
        prefill, decode = d["prefill_model"], d["decode_model"]
    except (ValueError, KeyError, TypeError):
        raise ValueError('disaggregated_prefill must be JSON {"prefill_model": NAME, "decode_model": NAME}, '
                         f"got {raw!r}") from None
    if not all(isinstance(m, str) and m for m in (prefill, decode)):
        raise ValueError(f"disaggregated_prefill: model names must be non-empty strings, got {raw!r}")
    return prefill, decode


class DisaggregatedRouter:
    def __init__(self, pb_utils: Any, prefill_model: str, decode_model: str,
                 log: Callable[[str], None]) -> None:
        self.pb = pb_utils
        self.prefill_model, self.decode_model = prefill_model, decode_model
        self._log = log
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self.closing = False

    def execute(self, requests: list) -> None:
        for request in requests:
            thread = threading.Thread(target=self._route, args=(request,), daemon=True,
                                      name="tritium-disagg-route")
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def finalize(self, timeout: float) -> None:
        self.closing = True
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout)

    def _route(self, request) -> None:
        pb = self.pb
        sender = request.get_response_sender()
        try:
            if self.closing:
                raise RuntimeError("The model is being unloaded.")
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            parameters = json.loads(request.parameters() or "{}")
            if parameters.get(MODEL_INFO):  # (the OpenAI frontend's description of the model)
                for response in self._call(self.decode_model, inputs, None, False, parameters):
                    if response.has_error():
                        raise RuntimeError(response.error().message())
                    if response.output_tensors():
                        sender.send(pb.InferenceResponse(output_tensors=response.output_tensors()))
                sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            sampling = _sampling(inputs)
            stream = bool(inputs["stream"].reshape(-1)[0]) if "stream" in inputs else False
            params = self._prefill(inputs, sampling, parameters)
            decode = {**sampling, "kv_transfer_params": params}
            for response in self._call(self.decode_model, inputs, decode, stream, parameters):
                if response.has_error():
                    raise RuntimeError(response.error().message())
                tensors = [t for t in response.output_tensors() if t.name() != "kv_transfer_params"]
                if tensors:
                    sender.send(pb.InferenceResponse(output_tensors=tensors))
                if sender.is_cancelled():
                    break
            sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:  # the request fails alone; the router serves on
            sender.send(pb.InferenceResponse(error=pb.TritonError(str(exc))),
                        flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _prefill(self, inputs: dict[str, np.ndarray], sampling: dict[str, Any],
                 parameters: dict[str, Any]) -> dict[str, Any]:
        prefill = {**sampling, "max_tokens": 1, "min_tokens": 0,
                   "kv_transfer_params": {"do_remote_decode": True}}
        params = None
        for response in self._call(self.prefill_model, inputs, prefill, False, parameters):
            if response.has_error():
                raise RuntimeError(f"The prefill model {self.prefill_model} failed: {response.error().message()}")
            tensor = self.pb.get_output_tensor_by_name(response, "kv_transfer_params")
            if tensor is not None:
                params = json.loads(tensor.as_numpy().reshape(-1)[0])
        if params is None:
            raise RuntimeError(f"The prefill model {self.prefill_model} returned no kv_transfer_params "
                               f"(is it a Tritium model with kv_role kv_producer or kv_both?)")
        return params

    def _call(self, model: str, inputs: dict[str, np.ndarray], sampling: dict[str, Any] | None, stream: bool,
              parameters: dict[str, Any]):
        """One call to `model` with the request's inputs and parameters (its error-detail and
        description switches), these sampling parameters (None: the request's own) and stream flag."""
        pb = self.pb
        tensors = [pb.Tensor(name, array) for name, array in inputs.items()
                   if sampling is None or name not in _CONTROL]
        if sampling is not None:
            tensors.append(pb.Tensor("sampling_parameters",
                                     np.array([json.dumps(sampling).encode()], dtype=np.object_)))
            tensors.append(pb.Tensor("stream", np.array([stream], dtype=bool)))
        return pb.InferenceRequest(model_name=model, inputs=tensors, requested_output_names=[],
                                   parameters=parameters).exec(decoupled=True)


def _sampling(inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    if "sampling_parameters" not in inputs:
        return {}
    raw = inputs["sampling_parameters"].reshape(-1)[0]
    value = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    if not isinstance(value, dict):
        raise ValueError("sampling_parameters must be a JSON object.")
    return value
