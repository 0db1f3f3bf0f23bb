"""OpenAI request fields -> the vLLM backend's sampling_parameters (vLLM's names)."""
from __future__ import annotations

import json
from typing import Any

from tritium.frontend.errors import bad_request
from tritium.frontend.protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat, SamplingFields
from tritium.frontend.tool_parsers.required import required_schema

# Fields whose names and meanings are the same in OpenAI's API, vLLM's and the engine's.
_PASS_THROUGH = ("n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "logit_bias",
                 "seed", "stop", "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens",
                 "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                 "spaces_between_special_tokens", "bad_words", "allowed_token_ids",
                 "truncate_prompt_tokens", "priority", "lora_name", "cache_salt")


def common_sampling(req: SamplingFields) -> dict[str, Any]:
    if req.stream_options is not None and not req.stream:  # vLLM's words
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    params = {k: getattr(req, k) for k in _PASS_THROUGH if getattr(req, k) is not None}
    structured = _structured_outputs(req)
    if structured is not None:
        params["structured_outputs"] = structured
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of must equal n (sampling more candidates than returned is not "
                          f"supported), got best_of={req.best_of}", "best_of")
    if req.truncation_side == "right":
        raise bad_request("truncation_side 'right' is not supported by this server: "
                          "truncate_prompt_tokens keeps the prompt's last tokens", "truncation_side")
    if req.prompt_logprobs is not None:
        if req.stream:  # vLLM's words: a stream's chunks have no place for them
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        params["prompt_logprobs"] = req.prompt_logprobs
    if req.kv_transfer_params:  # {} asks for nothing, as in vLLM: not sent
        params["kv_transfer_params"] = req.kv_transfer_params
    return params


def chat_sampling(req: ChatCompletionRequest) -> dict[str, Any]:
    params = common_sampling(req)
    if req.max_completion_tokens is not None and req.max_tokens is not None \
            and req.max_completion_tokens != req.max_tokens:
        raise bad_request("give max_completion_tokens or max_tokens (its older name), not both",
                          "max_completion_tokens")
    # Chat's default is "until the model stops" (the engine: up to max_model_len).
    params["max_tokens"] = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if req.logprobs:
        params["logprobs"] = req.top_logprobs or 0
    structured = response_structure(req)
    if structured is not None:
        given = params.get("structured_outputs") or {}
        if set(given) - _OPTIONS:
            raise bad_request("give one of response_format, a named tool_choice or the "
                              "guided_*/structured_outputs fields", "response_format")
        # structured_outputs may still carry options (vLLM's disable_any_whitespace).
        params["structured_outputs"] = {**structured, **given}
    if req.echo and req.prompt_logprobs is None and not req.stream:
        # vLLM's: echo asks for the prompt's logprobs (top_logprobs of them), which a
        # non-streamed reply carries as prompt_logprobs.
        params["prompt_logprobs"] = req.top_logprobs or 0
    return _with_decoding_backend(params, req)


_OPTIONS = {"disable_any_whitespace"}


def completion_sampling(req: CompletionRequest) -> dict[str, Any]:
    params = common_sampling(req)
    if req.max_tokens is not None:
        params["max_tokens"] = req.max_tokens
    if req.logprobs is not None:
        params["logprobs"] = req.logprobs
        if req.echo and req.prompt_logprobs is None:
            params["prompt_logprobs"] = req.logprobs
    structured = format_structure(req.response_format)
    if structured is not None:
        given = params.get("structured_outputs") or {}
        if set(given) - _OPTIONS:
            raise bad_request("give response_format or the guided_*/structured_outputs fields, "
                              "not both", "response_format")
        params["structured_outputs"] = {**structured, **given}
    return _with_decoding_backend(params, req)


def _with_decoding_backend(params: dict[str, Any], req: SamplingFields) -> dict[str, Any]:
    """vLLM's guided_decoding_backend: the engine has xgrammar only. Without a structured output
    there is nothing for it to choose, as in vLLM."""
    backend = req.guided_decoding_backend
    if backend is not None and backend not in ("auto", "xgrammar"):
        raise bad_request(f"guided_decoding_backend {backend!r} is not available: the engine uses "
                          "xgrammar ('auto' or 'xgrammar')", "guided_decoding_backend")
    if backend is not None and "structured_outputs" in params:
        params["structured_outputs"] = {**params["structured_outputs"], "backend": backend}
    return params


def named_tool(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The function a named tool_choice forces (its definition), or None."""
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        if choice == "required" and not req.tools:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        return None
    for tool in req.tools or []:
        if tool.function.name == choice.function.name:
            return tool.function.model_dump(exclude_none=True)
    raise bad_request(f"tool_choice names the function '{choice.function.name}', which is not "
                      "among the request's tools", "tool_choice")


def response_structure(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """structured_outputs for response_format, a named tool_choice or tool_choice "required"
    (a JSON array of calls, as vLLM constrains it)."""
    tool = named_tool(req)
    fmt = req.response_format
    required = req.tool_choice == "required"
    if (tool is not None or required) and fmt is not None and fmt.type != "text":
        raise bad_request("give response_format or a named or required tool_choice, not both",
                          "response_format")
    if tool is not None:
        return {"json": tool.get("parameters") or {"type": "object"}}
    if required:
        try:
            return {"json": required_schema([t.function.model_dump(exclude_none=True) for t in req.tools])}
        except ValueError as e:
            raise bad_request(str(e), "tools") from None
    return format_structure(fmt)


def format_structure(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """structured_outputs for a response_format (json_object, json_schema), or None."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_request("response_format json_schema needs json_schema.schema",
                          "response_format.json_schema")
    return {"json": fmt.json_schema.schema_}


def _structured_outputs(req: SamplingFields) -> dict[str, Any] | None:
    guided = {"json": req.guided_json, "regex": req.guided_regex, "choice": req.guided_choice,
              "grammar": req.guided_grammar}
    given = {k: v for k, v in guided.items() if v is not None}
    if req.structured_outputs is not None:
        if given:
            raise bad_request("give structured_outputs or the guided_* fields, not both",
                              "structured_outputs")
        return req.structured_outputs
    if not given:
        return None
    if "json" in given and isinstance(given["json"], str):
        try:
            given["json"] = json.loads(given["json"])
        except json.JSONDecodeError as e:
            raise bad_request(f"guided_json is not valid JSON: {e}", "guided_json") from None
    return given
