"""Errors in the OpenAI API's shape: `{"error": {"message", "type", "param", "code"}}`."""
from __future__ import annotations

import re
from typing import Any

from fastapi.responses import JSONResponse

# OpenAI's error types by HTTP status (its API answers a wrong method or URL with
# invalid_request_error too); a status not listed takes its class's type.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
          413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 499: "client_closed_request", 500: "server_error",
          503: "service_unavailable_error"}


class OpenAIError(Exception):
    """An error to send to the client: HTTP status, message, and the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def renamed(self, fields: dict[str, str]) -> OpenAIError:
        """This error told in the request's own field names: an engine message about a sampling
        parameter that the request named otherwise (chat's top_logprobs is the engine's logprobs)."""
        name = fields.get(self.param or "")
        if name is None:
            return self
        message = re.sub(rf"(?<!\w){re.escape(self.param)}(?!\w)", name, self.message, count=1)
        return OpenAIError(self.status, message, name, self.code)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


# Triton 2.51's stream carries a per-request error as a message alone (no status code), so the
# engine's well-known messages for "not now" are recognized by their text; everything else that
# the model rejects is the request's fault (the model sends INVALID_ARG for those).
_UNAVAILABLE = ("The model is being unloaded.", "the model was unloaded",
                "The engine is shutting down.", "The engine is shut down.", "The engine is restarting",
                "The engine process exited", "The server is busy", "Request timed out")


def from_triton(message: str) -> OpenAIError:
    """The OpenAI error for a per-request error that tritonserver or the model sent."""
    if message.startswith(_UNAVAILABLE) or "is not ready" in message or "unavailable" in message.lower():
        return OpenAIError(503, message)
    if message.startswith("internal error:"):
        return OpenAIError(500, message)
    if "unknown model" in message.lower() or "is not found" in message:
        return OpenAIError(404, message, "model", "model_not_found")
    if message == "Request was cancelled":
        return OpenAIError(499, message)
    # The engine's messages start with the parameter they are about ("top_p must be ...").
    first = re.match(r"(?:sampling parameter ')?(\w+)", message)
    return OpenAIError(400, message, first.group(1) if first and first.group(1) in PARAMETERS else None)


# Request fields an engine message may be about (vLLM's sampling parameter names).
PARAMETERS = frozenset({
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "logit_bias", "allowed_token_ids", "bad_words", "ignore_eos",
    "structured_outputs", "truncate_prompt_tokens", "lora_name", "priority"})
