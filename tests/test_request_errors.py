"""Typed request errors (issue 33): a request error carries its kind and parameter from where it
is made to the Triton adapter, which maps the kind to a TritonError code once; nothing reads the
message to classify it. The adapter's sender runs against a stand-in for
triton_python_backend_utils with the 2.51 stub's codes (the server tests cover the real one)."""
import json
import pickle
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from tritium.drivers.messages import PackedOutput, pack_output, unpack_output
from tritium.errors import (ERROR_DETAILS, EngineOverloadedError, EngineShutdownError, ErrorKind, ParameterError,
                            RequestError, request_error)
from tritium.outputs import CompletionOutput, RequestOutput
from tritium.sampling_params import SamplingParams
from tritium.serving.response_sender import CANCELLED, TRITON_CODES, InFlight, ResponseSender
from tritium.serving.triton_request import ResponseBuilder, error_details_asked, parse_request

FINAL = 1


class TritonError:
    """pb_utils.TritonError's codes in the 2.51 stub (it has none for a deadline)."""
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int) -> None:
        self.message, self.code = message, code


CODES = TritonError


def test_a_request_error_is_its_message_with_a_kind_and_parameter():
    e = RequestError("top_p must be in (0, 1], got 1.5.", ErrorKind.INVALID_ARGUMENT, "top_p")
    assert e == "top_p must be in (0, 1], got 1.5." and e.message == str(e) and type(e.message) is str
    assert (e.kind, e.parameter) == (ErrorKind.INVALID_ARGUMENT, "top_p")
    back = pickle.loads(pickle.dumps(e))  # as it crosses the engine process's socket
    assert (type(back), back, back.kind, back.parameter) == (RequestError, e, e.kind, "top_p")
    assert json.loads(e.to_json()) == {"kind": "invalid_argument", "parameter": "top_p", "message": e.message}
    parsed = RequestError.from_json(e.to_json())
    assert (parsed, parsed.kind, parsed.parameter) == (e, e.kind, e.parameter)
    for text in ("The engine is shutting down.", "[1]", '"x"', '{"kind": "bogus", "message": "m"}', ""):
        assert RequestError.from_json(text) is None
    plain = RequestError.of("boom")
    assert (plain, plain.kind, plain.parameter) == ("boom", ErrorKind.INTERNAL, None)
    assert RequestError.of(e) is e


@pytest.mark.parametrize("exc, kind, parameter, message", [
    (ParameterError("top_k must be -1 (disable) or at least 1, got -2.", "top_k"), ErrorKind.INVALID_ARGUMENT,
     "top_k", "top_k must be -1 (disable) or at least 1, got -2."),
    (ValueError("The prompt is empty."), ErrorKind.INVALID_ARGUMENT, None, "The prompt is empty."),
    (EngineShutdownError("The engine is shut down."), ErrorKind.UNAVAILABLE, None, "The engine is shut down."),
    (EngineOverloadedError("The server is busy"), ErrorKind.UNAVAILABLE, None, "The server is busy"),
    (KeyError("x"), ErrorKind.INTERNAL, None, "internal error: 'x'"),
])
def test_refused_requests_get_the_kind_of_their_exception(exc, kind, parameter, message):
    e = request_error(exc)
    assert (e.kind, e.parameter, e.message) == (kind, parameter, message)


@pytest.mark.parametrize("values, parameter, message", [
    ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5."),
    ({"temperature": -1}, "temperature", "temperature must be non-negative, got -1.0."),
    ({"logprobs": 21}, "logprobs", "logprobs must be in [0, 20], got 21."),
    ({"n": "x"}, "n", "sampling parameter 'n' must be an integer, got 'x'."),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "stop_token_ids must contain only non-negative integers, got -1."),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs",
     "structured_outputs: regex must be a non-empty string, got ''."),
    ({"bogus": 1}, "bogus", None),
])
def test_sampling_parameter_errors_name_their_parameter(values, parameter, message):
    with pytest.raises(ParameterError) as info:
        SamplingParams.from_dict(values)
    assert info.value.parameter == parameter
    if message is not None:
        assert str(info.value) == message


def test_the_error_details_parameter_is_tritiums_not_a_sampling_parameter():
    text = {"text_input": np.array([b"Hi"], dtype=object)}
    assert parse_request(text, {ERROR_DETAILS: True, "max_tokens": 3}).sampling_params.max_tokens == 3
    with pytest.raises(ParameterError) as info:
        parse_request(text, {ERROR_DETAILS: "maybe"})
    assert (info.value.parameter, str(info.value)) == (
        ERROR_DETAILS, "request parameter 'return_error_details' must be a boolean, got 'maybe'.")
    assert [error_details_asked(p) for p in (None, "", "{bad", '{"return_error_details": true}',
                                              {ERROR_DETAILS: "true"}, {ERROR_DETAILS: False}, "[]")] == \
        [False, False, False, True, True, False, False]


def test_an_error_output_keeps_its_kind_on_the_wire():
    error = RequestError("Request timed out: its deadline passed while it was running (0.300 s after arrival).",
                         ErrorKind.TIMEOUT)
    out = RequestOutput("r", None, [1], [CompletionOutput(0, "", [], None, None, "abort")], True, error=error)
    packed = pickle.loads(pickle.dumps(pack_output(out)))
    assert isinstance(packed, PackedOutput)
    got = unpack_output(packed).error
    assert (type(got), got, got.kind) == (RequestError, error, ErrorKind.TIMEOUT)


class _Client:
    def __init__(self, cancelled: bool = False) -> None:
        self.sent: list[tuple[dict, int]] = []
        self.done = threading.Event()
        self._cancelled = cancelled

    def send(self, response, flags: int = 0) -> None:
        self.sent.append((response, flags))
        if flags & FINAL:
            self.done.set()

    def is_cancelled(self) -> bool:
        return self._cancelled


def _pb() -> SimpleNamespace:
    log = SimpleNamespace(log_info=lambda m: None, log_warn=lambda m: None, log_error=lambda m: None)
    return SimpleNamespace(
        InferenceResponse=lambda output_tensors=None, error=None: {"tensors": dict(output_tensors or []),
                                                                   "error": error},
        Tensor=lambda name, array: (name, array), TritonError=TritonError,
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL, Logger=log, is_model_ready=lambda **_: True)


def _final_error(error: RequestError | str, details: bool = False, cancelled: bool = False) -> tuple[str, int]:
    """The (message, code) of the FINAL response a request gets when the engine ends it with `error`."""
    pb = _pb()
    client = _Client(cancelled)
    sender = ResponseSender(pb, SimpleNamespace(abort=lambda rid: None), ("llm", "1"))
    builder = ResponseBuilder(parse_request({"text_input": np.array([b"Hi"], dtype=object)}))
    sender.track(InFlight("r", client, builder, error_details=details))
    try:
        if cancelled:
            assert not client.done.wait(0.2)  # it notices the cancellation, then the engine's abort
        sender.on_output("r", RequestOutput("r", "Hi", [1], [CompletionOutput(0, "", [], None, None, "abort")],
                                            True, error=error))
        assert client.done.wait(10)
    finally:
        sender.stop(timeout=10)
    (response, flags), = client.sent
    assert flags == FINAL and response["tensors"] == {}
    return response["error"].message, response["error"].code


@pytest.mark.parametrize("kind, code", [
    (ErrorKind.INVALID_ARGUMENT, CODES.INVALID_ARG), (ErrorKind.UNAVAILABLE, CODES.UNAVAILABLE),
    (ErrorKind.TIMEOUT, CODES.UNAVAILABLE), (ErrorKind.CANCELLED, CODES.CANCELLED),
    (ErrorKind.INTERNAL, CODES.INTERNAL),
])
def test_the_triton_adapter_maps_each_kind_to_its_code(kind, code):
    assert getattr(CODES, TRITON_CODES[kind]) == code
    assert _final_error(RequestError("it failed", kind)) == ("it failed", code)


def test_the_kind_decides_not_the_message():
    # Messages that start as the old prefix lists' did (the adapter and the frontend once
    # classified errors by them) are mapped by their kind alone.
    assert _final_error(RequestError("The engine is shutting down. (a parameter's words)",
                                     ErrorKind.INVALID_ARGUMENT, "stop")) == (
        "The engine is shutting down. (a parameter's words)", CODES.INVALID_ARG)
    assert _final_error(RequestError("Request timed out, says the grammar", ErrorKind.INTERNAL)) == (
        "Request timed out, says the grammar", CODES.INTERNAL)
    assert _final_error(RequestError("internal error: the queue is full", ErrorKind.UNAVAILABLE)) == (
        "internal error: the queue is full", CODES.UNAVAILABLE)
    assert _final_error("The engine process exited") == ("The engine process exited", CODES.INTERNAL)  # untyped


def test_a_client_that_asks_gets_the_error_as_json():
    error = RequestError("top_p must be in (0, 1], got 1.5.", ErrorKind.INVALID_ARGUMENT, "top_p")
    message, code = _final_error(error, details=True)
    assert code == CODES.INVALID_ARG
    assert json.loads(message) == {"kind": "invalid_argument", "parameter": "top_p",
                                   "message": "top_p must be in (0, 1], got 1.5."}
    assert _final_error(error) == ("top_p must be in (0, 1], got 1.5.", CODES.INVALID_ARG)


def test_a_cancelled_request_ends_cancelled():
    assert (CANCELLED.kind, CANCELLED) == (ErrorKind.CANCELLED, "Request was cancelled")
    assert _final_error(None, cancelled=True) == ("Request was cancelled", CODES.CANCELLED)
    message, code = _final_error(None, details=True, cancelled=True)
    assert (json.loads(message)["kind"], code) == ("cancelled", CODES.CANCELLED)
