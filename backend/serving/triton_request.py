"""The request interface of Triton's vLLM backend, as pure Python: parsing and response building.

model.py decodes pb_utils tensors into numpy arrays and hands them here, so that everything that
decides what a request means, and what its responses hold, is testable without a server.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from tritium.errors import ERROR_DETAILS, ParameterError, RequestError
from tritium.serving import request_limits
from tritium.outputs import CompletionOutput, RequestOutput
from tritium.sampling_params import SamplingParams

# Optional BOOL inputs; each may also arrive as a request parameter (the HTTP generate endpoint
# turns top-level JSON keys that are not inputs into request parameters).
FLAG_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason",
               "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
               "return_num_output_tokens", "return_num_cached_tokens", "return_stop_reason")
INPUT_NAMES = ("text_input", "input_ids", "sampling_parameters") + FLAG_INPUTS
# Request parameters that belong to Triton, not to the model (see Triton's parameters extension).
_RESERVED_PARAMETERS = frozenset({"sequence_id", "priority", "timeout", "sequence_start",
                                  "sequence_end", "headers"})


@dataclass
class ParsedRequest:
    """What one Triton request asks of the engine and of its responses."""

    prompt: str | list[int]
    sampling_params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    # Tritium's own: the prompt tokens served from the prefix cache (OpenAI's usage
    # prompt_tokens_details.cached_tokens); an input the vLLM backend's config does not declare.
    return_num_cached_tokens: bool = False
    # Tritium's own: what stopped each sample (vLLM's stop_reason: the stop string or stop token
    # id; null for EOS, length or abort), for the OpenAI frontend's `stop_reason`.
    return_stop_reason: bool = False
    # The engine's scheduling priority (vLLM's add_request argument; lower first). Triton keeps
    # its own `priority` request parameter, which a Python-backend model cannot read, so this one
    # arrives in sampling_parameters.
    priority: int = 0
    # The LoRA adapter to run with (Triton's vLLM backend takes `lora_name` in sampling_parameters).
    lora_name: str | None = None


def parse_request(inputs: Mapping[str, np.ndarray], parameters: str | Mapping[str, Any] | None = None
                  ) -> ParsedRequest:
    """Parse a request's decoded input tensors and its request parameters (JSON or dict).

    Raises ValueError with a message meant for the client when the request is malformed; what
    depends on the engine (n against max_num_seqs, the prompt's length) the engine checks.
    """
    unknown = sorted(set(inputs) - set(INPUT_NAMES))
    if unknown:
        raise ValueError(f"unexpected input '{unknown[0]}'. Valid inputs: {', '.join(INPUT_NAMES)}.")
    request_params = _parse_request_parameters(parameters)

    flags: dict[str, bool] = {}
    for name in FLAG_INPUTS:
        if name in request_params:
            flags[name] = _bool_value(f"request parameter '{name}'", request_params.pop(name), name)
        if inputs.get(name) is not None:  # the tensor wins over a request parameter
            flags[name] = _bool_input(name, inputs[name])
    stream = flags.get("stream", False)
    # The vLLM backend's defaults: a stream sends only new text; otherwise the prompt comes first.
    exclude = flags.get("exclude_input_in_output", stream)
    if stream and not exclude:  # the vLLM backend's message, word for word: its CI compares it whole
        raise ParameterError("Error generating stream: When streaming, `exclude_input_in_output` = False "
                             "is not allowed.", "exclude_input_in_output")

    sampling = dict(request_params)
    if inputs.get("sampling_parameters") is not None:
        sampling.update(_json_object_input("sampling_parameters", inputs["sampling_parameters"]))
    priority = sampling.pop("priority", 0)
    if isinstance(priority, str) and priority.lstrip("-").isdigit():
        priority = int(priority)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ParameterError(f"priority must be an integer, got {priority!r}.", "priority")
    lora_name = sampling.pop("lora_name", None)
    if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
        raise ParameterError(f"lora_name must be a non-empty string, got {lora_name!r}.", "lora_name")
    # Disaggregated prefill: vLLM's kv_transfer_params, as its proxy sends them.
    kv_transfer_params = sampling.pop("kv_transfer_params", None)
    if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
        raise ParameterError(f"kv_transfer_params must be an object, got {type(kv_transfer_params).__name__}.",
                             "kv_transfer_params")
    request_limits.check_sampling_sizes(sampling)  # before anything is built per sample or item
    params = SamplingParams.from_dict(_openai_frontend_keys(sampling))
    if kv_transfer_params is not None:
        params.extra_args = {"kv_transfer_params": kv_transfer_params}

    return ParsedRequest(prompt=_prompt(inputs), sampling_params=params, stream=stream,
                         exclude_input_in_output=exclude, priority=priority, lora_name=lora_name,
                         **{k: v for k, v in flags.items() if k.startswith("return_")})


def deadline(timeout_us: int) -> float | None:
    """Triton's request timeout (microseconds, 0: none; the `timeout` request parameter) as an
    absolute deadline for the engine."""
    return time.time() + timeout_us / 1e6 if timeout_us else None


def check_lora(lora_name: str | None, served: list[str] | None,
               log: Callable[[str], None] = lambda line: None) -> None:
    """The vLLM backend's check of a request's `lora_name` against the model's adapters. The
    client gets its message word for word (its CI and clients compare it whole); `log` gets its
    log line with Tritium's hint after it. Raises ParameterError."""
    if lora_name is None:
        return
    if not served:
        log("[vllm] LoRA is not enabled, please restart the backend with LoRA enabled. tritium: set "
            "enable_lora and list the adapters in 1/multi_lora.json (or a lora_modules parameter), "
            "then load the model again.")
        raise ParameterError("LoRA feature is not enabled.", "lora_name")
    if lora_name not in served:
        log(f"[vllm] LoRA {lora_name} not found. tritium: lora_name must name one of the model's "
            f"adapters {served}; to serve another, add it to 1/multi_lora.json and load the model again.")
        raise ParameterError(f"LoRA {lora_name} is not supported, we currently support {served}", "lora_name")


def _openai_frontend_keys(sampling: dict[str, Any]) -> dict[str, Any]:
    """Map the OpenAI request fields that Triton's OpenAI frontend passes through as sampling
    parameters (with its defaults, e.g. best_of=1 and chat's logprobs=false) to vLLM's."""
    sampling = dict(sampling)
    if "max_completion_tokens" in sampling:
        value = sampling.pop("max_completion_tokens")
        if value is not None:
            sampling.setdefault("max_tokens", value)
    best_of = sampling.pop("best_of", None)
    if best_of is not None and str(best_of) != str(sampling.get("n", 1)):
        raise ParameterError(f"best_of must equal n (sampling more candidates than returned is not "
                             f"supported), got best_of={best_of}.", "best_of")
    # Chat completions: logprobs is a boolean and top_logprobs the number of alternatives.
    top_logprobs = sampling.pop("top_logprobs", None)
    if isinstance(sampling.get("logprobs"), bool):
        sampling["logprobs"] = (top_logprobs or 0) if sampling["logprobs"] else None
    return sampling


def _prompt(inputs: Mapping[str, np.ndarray]) -> str | list[int]:
    text, ids = inputs.get("text_input"), inputs.get("input_ids")
    if text is not None and ids is not None:
        raise ValueError("give either text_input or input_ids, not both.")
    if ids is not None:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must hold integers, got {ids.dtype}.")
        request_limits.check_input_ids(ids.size)
        token_ids = ids.reshape(-1).tolist()  # Python ints, converted in C
        if not token_ids:
            raise ValueError("input_ids must not be empty.")
        if min(token_ids) < 0:
            raise ValueError(f"input_ids must be non-negative, got {min(token_ids)}.")
        return token_ids
    if text is None:
        raise ValueError("text_input is required (or input_ids, for a prompt of token ids).")
    prompt = _string_input("text_input", text)
    if not prompt:
        raise ValueError("text_input must not be empty.")
    request_limits.check_text_input(prompt)
    return prompt


def _single(name: str, array: np.ndarray) -> Any:
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise ValueError(f"{name} must hold exactly one element, got {flat.size}.")
    return flat[0]


def _string_input(name: str, array: np.ndarray) -> str:
    value = _single(name, array)
    if isinstance(value, str):
        return value
    if not isinstance(value, (bytes, np.bytes_)):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}.")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name} is not valid UTF-8: {e.reason} at byte {e.start}.") from None


def _bool_input(name: str, array: np.ndarray) -> bool:
    value = _single(name, array)
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be a BOOL tensor, got {np.asarray(array).dtype}.")


def _bool_value(what: str, value: Any, parameter: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ParameterError(f"{what} must be a boolean, got {value!r}.", parameter)


def _json_object_input(name: str, array: np.ndarray) -> dict[str, Any]:
    text = _string_input(name, array)
    request_limits.check_sampling_parameters(text)
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON: {e}.") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}.")
    return value


def _parse_request_parameters(parameters: str | Mapping[str, Any] | None) -> dict[str, Any]:
    if parameters is None or parameters == "":
        return {}
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters)
        except json.JSONDecodeError as e:
            raise ValueError(f"request parameters are not valid JSON: {e}.") from None
    if not isinstance(parameters, Mapping):
        raise ValueError(f"request parameters must be a JSON object, got {type(parameters).__name__}.")
    if ERROR_DETAILS in parameters:  # a bad value is refused (error_details_asked reads it leniently)
        _bool_value(f"request parameter '{ERROR_DETAILS}'", parameters[ERROR_DETAILS], ERROR_DETAILS)
    return {k: v for k, v in parameters.items()
            if k not in _RESERVED_PARAMETERS and k != ERROR_DETAILS and not k.startswith("triton_")}


def error_details_asked(parameters: str | Mapping[str, Any] | None) -> bool:
    """Whether a request's parameters ask for its errors as JSON (ERROR_DETAILS); read before
    and apart from parsing, so that a request refused for any reason is answered as it asked."""
    return _parameter_is_true(parameters, ERROR_DETAILS)


# A request parameter (Tritium's own) that asks the model to describe itself instead of
# generating: the OpenAI frontend lists its max_model_len and LoRA adapters from the answer.
MODEL_INFO = "model_info"


def model_info_asked(parameters: str | Mapping[str, Any] | None) -> bool:
    """Whether a request's parameters ask for the model's description (MODEL_INFO)."""
    return _parameter_is_true(parameters, MODEL_INFO)


def model_info_outputs(engine_args: Any, model_config: Any) -> dict[str, np.ndarray]:
    """The outputs of the one response to a MODEL_INFO request: `text_output` holds
    {"model": the model's path, "max_model_len", "lora_modules": {adapter name: directory}} as JSON."""
    loras = engine_args.lora_modules if engine_args.enable_lora else None
    info = {"model": engine_args.model, "max_model_len": model_config.max_model_len, "lora_modules": dict(loras or {})}
    return {"text_output": np.array([json.dumps(info).encode("utf-8")], dtype=np.object_)}


def _parameter_is_true(parameters: str | Mapping[str, Any] | None, name: str) -> bool:
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters) if parameters else None
        except json.JSONDecodeError:
            return False
    value = parameters.get(name) if isinstance(parameters, Mapping) else None
    return value is True or (isinstance(value, str) and value.strip().lower() == "true")


@dataclass
class Response:
    """One response to send: output tensors by name, whether it is the FINAL one, and an error
    message when the request failed (then `outputs` is empty)."""

    outputs: dict[str, np.ndarray]
    final: bool
    error: RequestError | str | None = None


@dataclass
class _Sample:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    cumulative_logprob: float | None = None
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ResponseBuilder:
    """Turns the engine's delta outputs for one request into the responses the vLLM backend sends.

    Streaming: one response per engine output, holding only what is new. Otherwise: a single
    FINAL response with the whole completion, prefixed by the prompt unless excluded.
    """

    def __init__(self, request: ParsedRequest) -> None:
        self.request = request
        self._samples = [_Sample() for _ in range(request.sampling_params.n)]
        self._num_input_tokens = 0
        self._num_cached_tokens = 0
        self._prompt_logprobs: str | None = None  # JSON, once the engine has sent them
        self._kv_transfer_params: str | None = None  # JSON: a prefill instance's, with its last output
        self.finished = False

    def add(self, output: RequestOutput) -> Response | None:
        """Record one engine output; return the response to send now, if any."""
        assert not self.finished, "engine output after the final one"
        self.finished = output.finished
        self._num_input_tokens = len(output.prompt_token_ids)
        self._num_cached_tokens = output.num_cached_tokens
        if output.kv_transfer_params is not None:
            self._kv_transfer_params = json.dumps(output.kv_transfer_params)
        new_prompt_logprobs = output.prompt_logprobs is not None
        if new_prompt_logprobs:
            self._prompt_logprobs = json.dumps([None if d is None else _logprob_entry(d)
                                                for d in output.prompt_logprobs])
        deltas: dict[int, CompletionOutput] = {c.index: c for c in output.outputs}
        for index, c in deltas.items():
            s = self._samples[index]
            s.text.append(c.text)
            s.num_tokens += len(c.token_ids)
            s.cumulative_logprob = c.cumulative_logprob
            s.finish_reason, s.stop_reason = c.finish_reason, c.stop_reason
            if c.logprobs is not None:
                s.logprobs = (s.logprobs or []) + [_logprob_entry(d) for d in c.logprobs]
        if output.error is not None:
            return Response({}, final=output.finished, error=output.error)
        if self.request.stream:
            return Response(self._tensors(deltas, new_prompt_logprobs), final=output.finished)
        if not output.finished:
            return None
        return Response(self._tensors(None, True), final=True)

    def _tensors(self, deltas: dict[int, CompletionOutput] | None,
                 with_prompt_logprobs: bool) -> dict[str, np.ndarray]:
        """Tensors over all samples: this output's deltas, or (deltas=None) the whole completion.
        The prompt's logprobs (when asked for) go in one response: the first that has them."""
        r = self.request
        if deltas is None:
            prefix = "" if r.exclude_input_in_output or not isinstance(r.prompt, str) else r.prompt
            texts = [prefix + "".join(s.text) for s in self._samples]
            counts = [s.num_tokens for s in self._samples]
            logprobs = [s.logprobs for s in self._samples]
        else:
            got = [deltas.get(i, _NO_DELTA) for i in range(len(self._samples))]
            texts = [c.text for c in got]
            counts = [len(c.token_ids) for c in got]
            logprobs = None
            if r.return_logprobs:
                logprobs = [None if c.logprobs is None else [_logprob_entry(d) for d in c.logprobs]
                            for c in got]
        out = {"text_output": _strings(texts)}
        if r.return_finish_reason:
            out["finish_reason"] = _strings([str(s.finish_reason) for s in self._samples])
        if r.return_stop_reason:  # JSON per sample: a string, a token id or null
            out["stop_reason"] = _strings([json.dumps(s.stop_reason) for s in self._samples])
        if r.return_cumulative_logprob:
            out["cumulative_logprob"] = np.array(
                [np.nan if s.cumulative_logprob is None else s.cumulative_logprob
                 for s in self._samples], dtype=np.float32)
        if r.return_logprobs:
            out["logprobs"] = _strings([json.dumps(lp) for lp in logprobs])
        if r.return_num_input_tokens:
            out["num_input_tokens"] = np.array([self._num_input_tokens], dtype=np.uint32)
        if r.return_num_output_tokens:
            out["num_output_tokens"] = np.array(counts, dtype=np.uint32)
        if r.return_num_cached_tokens:
            out["num_cached_tokens"] = np.array([self._num_cached_tokens], dtype=np.uint32)
        if with_prompt_logprobs and self._prompt_logprobs is not None:
            out["prompt_logprobs"] = _strings([self._prompt_logprobs])
        if self._kv_transfer_params is not None:
            out["kv_transfer_params"] = _strings([self._kv_transfer_params])
        return out


_NO_DELTA = CompletionOutput(0, "", [], None, None)  # a sample with nothing new in this output


# A token that cannot be sampled (masked by a grammar) has logprob -inf, which JSON cannot
# carry ("-Infinity" is not JSON): it is sent as vLLM's OpenAI server sends it.
_MIN_LOGPROB = -9999.0


def _logprob_entry(d: Mapping[int, Any]) -> dict[str, Any]:
    # The vLLM backend's format: {token_id: {"logprob", "rank", "decoded_token"}} per token.
    return {str(tid): {"logprob": max(lp.logprob, _MIN_LOGPROB), "rank": lp.rank,
                       "decoded_token": lp.decoded_token}
            for tid, lp in d.items()}


def _strings(values: list[str]) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_)
