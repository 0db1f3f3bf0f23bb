"""Request errors and their kinds, shared by every layer: the engine makes them, they travel over
the engine process's socket, and each server maps a kind to its status code once (the Triton
adapter in backend/serving/response_sender.py, the OpenAI frontend in frontend/errors.py).

Imports nothing: the Triton stub and the OpenAI frontend import this without loading torch.
"""
from __future__ import annotations

import json
from enum import Enum
from typing import Any


# The request parameter (Tritium's own, not a sampling parameter) with which a Triton client asks
# for a request's error as JSON (`RequestError.to_json`: {"kind", "parameter", "message"}) in
# place of the message alone. Triton 2.51's stream carries an error as a message without a
# status code; the OpenAI frontend asks, to answer with the right HTTP status. A client that
# does not ask gets the message alone.
ERROR_DETAILS = "return_error_details"


class ErrorKind(str, Enum):
    """Why a request failed, as a client should act on it."""

    INVALID_ARGUMENT = "invalid_argument"  # the request's fault: fix it, do not retry as is
    UNAVAILABLE = "unavailable"  # the server's state (shutting down, restarting, busy): retry later
    TIMEOUT = "timeout"  # its deadline (Triton's request timeout) passed
    CANCELLED = "cancelled"  # its client cancelled it
    INTERNAL = "internal"  # a fault of the server


class RequestError(str):
    """A request's error: its message, its kind, and the request parameter it concerns (vLLM's
    sampling parameter names; None when it concerns no one parameter).

    It is the message itself (a `str` subclass): `RequestOutput.error` was a message, and code
    and tests that read it as text keep working, while servers read `kind` and `parameter`
    instead of matching the text. It pickles with its kind across the engine process's socket.
    """

    kind: ErrorKind
    parameter: str | None

    def __new__(cls, message: str, kind: ErrorKind = ErrorKind.INTERNAL,
                parameter: str | None = None) -> RequestError:
        error = super().__new__(cls, message)
        error.kind, error.parameter = ErrorKind(kind), parameter
        return error

    @property
    def message(self) -> str:
        return str.__str__(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return RequestError, (self.message, self.kind, self.parameter)

    def __repr__(self) -> str:
        return f"RequestError({self.message!r}, {self.kind}, {self.parameter!r})"

    @classmethod
    def of(cls, error: str) -> RequestError:
        """`error` as a RequestError: a plain message (from code that predates kinds) is INTERNAL."""
        return error if isinstance(error, RequestError) else cls(error, ErrorKind.INTERNAL)

    # ---- the JSON form a Triton client asks for with the ERROR_DETAILS request parameter ------
    def to_json(self) -> str:
        return json.dumps({"kind": self.kind.value, "parameter": self.parameter, "message": self.message})

    @classmethod
    def from_json(cls, text: str) -> RequestError | None:
        """The error `to_json` wrote, or None when `text` is not one (an error that tritonserver
        itself sent, which only ever carries a message)."""
        try:
            value = json.loads(text)
            return cls(value["message"], ErrorKind(value["kind"]), value.get("parameter"))
        except (ValueError, TypeError, KeyError):
            return None


# The error of every request still in an engine that stops (by either engine driver).
ENGINE_SHUTTING_DOWN = RequestError("The engine is shutting down.", ErrorKind.UNAVAILABLE)


class ParameterError(ValueError):
    """A request's parameter is invalid: `parameter` names it (vLLM's name). The message is the
    same as a plain ValueError's would be; servers answer INVALID_ARGUMENT naming the parameter."""

    def __init__(self, message: str, parameter: str) -> None:
        super().__init__(message)
        self.parameter = parameter


class EngineShutdownError(RuntimeError):
    """A request arrived after `shutdown()`, or while no engine serves (UNAVAILABLE)."""


class EngineOverloadedError(RuntimeError):
    """A request was refused because `max_waiting_requests` requests already wait to be
    scheduled (UNAVAILABLE: Triton UNAVAILABLE, HTTP 503); retry later."""


def request_error(exc: BaseException) -> RequestError:
    """The error a request refused with `exc` gets: a ValueError is the request's fault (with
    the parameter a ParameterError names), a stopped or full engine is unavailable, anything
    else is internal (its message prefixed "internal error: ")."""
    if isinstance(exc, ParameterError):
        return RequestError(str(exc), ErrorKind.INVALID_ARGUMENT, exc.parameter)
    if isinstance(exc, ValueError):
        return RequestError(str(exc), ErrorKind.INVALID_ARGUMENT)
    if isinstance(exc, (EngineShutdownError, EngineOverloadedError)):
        return RequestError(str(exc), ErrorKind.UNAVAILABLE)
    return RequestError(f"internal error: {exc}", ErrorKind.INTERNAL)


def unavailable(message: str) -> RequestError:
    return RequestError(message, ErrorKind.UNAVAILABLE)


def overloaded_message(max_waiting_requests: int) -> str:
    return (f"The server is busy: {max_waiting_requests} requests are already waiting to be "
            f"scheduled (max_waiting_requests={max_waiting_requests}). Retry later.")
