"""Errors in the OpenAI API's shape: `{"error": {"message", "type", "param", "code"}}`."""
from __future__ import annotations

import json
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


# The request parameter that asks a Tritium model for its errors as JSON, {"kind", "parameter",
# "message"}: Triton 2.51's stream carries an error as a message alone, without a status code.
# Its name and the kinds are backend/errors.py's (ERROR_DETAILS, ErrorKind), a wire contract
# that tests/test_frontend_units.py checks; this process does not import the engine's package.
ERROR_DETAILS = "return_error_details"

# Each error kind's HTTP status, once. A timeout is 504 (Gateway Timeout): the frontend is a
# gateway and the model behind it did not finish within the request's deadline (408 would say
# the client was too slow to send its request). A cancelled request is 499, nginx's "client
# closed request", which OpenAI's error types also name.
STATUSES = {"invalid_argument": 400, "unavailable": 503, "timeout": 504, "cancelled": 499, "internal": 500}


def from_triton(message: str) -> OpenAIError | None:
    """The OpenAI error for a per-request error on the stream: the model's JSON (asked for
    with ERROR_DETAILS) mapped by its kind, the parameter kept for an invalid argument; None
    when `message` is not that JSON. An error tritonserver itself sent (the model was unloaded
    after the frontend looked it up, a request Triton refused) is plain text: the gateway
    answers it from the model's readiness instead (TritonGateway.refused)."""
    try:
        error = json.loads(message)
        kind, text, parameter = error["kind"], error["message"], error.get("parameter")
        status = STATUSES[kind]
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(text, str) or not (parameter is None or isinstance(parameter, str)):
        return None
    return OpenAIError(status, text, parameter if kind == "invalid_argument" else None)
