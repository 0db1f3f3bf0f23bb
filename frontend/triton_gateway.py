"""Talks to tritonserver over gRPC: model discovery, and one bidirectional stream per generation
in the vLLM backend's request interface."""
from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE
from tritonclient.utils import InferenceServerException

from tritium.frontend.errors import ERROR_DETAILS, OpenAIError, from_triton

# The request parameter that asks a Tritium model to describe itself instead of generating
# (backend/serving/triton_request.py's MODEL_INFO, a wire contract that tests/test_frontend_units.py checks).
MODEL_INFO = "model_info"


@dataclass
class GenerationRequest:
    """One request to the model: a prompt (text or token ids) and its sampling parameters."""

    model: str
    request_id: str
    prompt: str | list[int]
    sampling: dict[str, Any]
    stream: bool
    logprobs: bool = False  # ask for the logprobs (and prompt_logprobs) outputs
    cached_tokens: bool = False  # ask for num_cached_tokens (a model whose config declares it)
    stop_reason: bool = False  # ask for stop_reason (likewise)


@dataclass
class Chunk:
    """One response of the model: per sample, the new text, its token count, its finish reason
    (None while running) and its new tokens' logprobs (the vLLM backend's JSON, decoded)."""

    texts: list[str]
    num_output_tokens: list[int]
    finish_reasons: list[str | None]
    num_input_tokens: int
    logprobs: list[list[dict[str, Any]] | None] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    num_cached_tokens: int | None = None  # prompt tokens from the prefix cache; None: not reported
    # Per sample, the stop string or stop token id that ended it (None for EOS, length, or a
    # model that does not report it).
    stop_reasons: list[int | str | None] | None = None
    # A prefill instance's kv_transfer_params (for the decode instance), in its final response.
    kv_transfer_params: dict[str, Any] | None = None


def _tensor(name: str, value: np.ndarray, dtype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def build_inputs(req: GenerationRequest) -> list[grpcclient.InferInput]:
    if isinstance(req.prompt, str):
        inputs = [_tensor("text_input", np.array([req.prompt.encode("utf-8")], dtype=np.object_), "BYTES")]
    else:
        inputs = [_tensor("input_ids", np.asarray(req.prompt, dtype=np.int32), "INT32")]
    flags = {"stream": req.stream, "exclude_input_in_output": True, "return_finish_reason": True,
             "return_num_input_tokens": True, "return_num_output_tokens": True}
    if req.logprobs:
        flags["return_logprobs"] = True
    if req.cached_tokens:
        flags["return_num_cached_tokens"] = True
    if req.stop_reason:
        flags["return_stop_reason"] = True
    inputs.append(_tensor("sampling_parameters",
                          np.array([json.dumps(req.sampling).encode("utf-8")], dtype=np.object_), "BYTES"))
    inputs += [_tensor(k, np.array([v], dtype=bool), "BOOL") for k, v in flags.items()]
    return inputs


_LENGTH = struct.Struct("<I")
_NUMERIC = {"UINT32": "<I", "INT32": "<i", "UINT64": "<Q", "INT64": "<q", "FP32": "<f"}


def _values(datatype: str, raw: bytes) -> list[Any]:
    """A tensor's elements from its raw_output_contents: BYTES elements are each a 4-byte
    little-endian length and the bytes; numbers are little-endian."""
    if datatype == "BYTES":
        out, i, end = [], 0, len(raw)
        while i < end:
            (size,) = _LENGTH.unpack_from(raw, i)
            out.append(raw[i + 4:i + 4 + size])
            i += 4 + size
        return out
    return [v for (v,) in struct.iter_unpack(_NUMERIC[datatype], raw)]


def parse_chunk(response: Any) -> Chunk:
    """A ModelInferResponse -> Chunk, read straight from the raw output contents (one response
    per streamed event: InferResult.as_numpy's NumPy arrays cost more than the event's other work)."""
    raw = response.raw_output_contents
    outputs = {o.name: _values(o.datatype, raw[i]) for i, o in enumerate(response.outputs)}
    texts = [b.decode("utf-8") for b in outputs["text_output"]]
    n = len(texts)
    counts = outputs.get("num_output_tokens") or [0] * n
    reasons: list[str | None] = ([None if r in (b"None", b"") else r.decode("utf-8")
                                  for r in outputs["finish_reason"]]
                                 if "finish_reason" in outputs else [None] * n)
    num_input = outputs["num_input_tokens"][0] if "num_input_tokens" in outputs else 0
    logprobs = [json.loads(s) for s in outputs["logprobs"]] if "logprobs" in outputs else None
    prompt_logprobs = json.loads(outputs["prompt_logprobs"][0]) if "prompt_logprobs" in outputs else None
    cached = outputs["num_cached_tokens"][0] if "num_cached_tokens" in outputs else None
    stop_reasons = [json.loads(s) for s in outputs["stop_reason"]] if "stop_reason" in outputs else None
    kv = json.loads(outputs["kv_transfer_params"][0]) if "kv_transfer_params" in outputs else None
    return Chunk(texts, counts, reasons, num_input, logprobs, prompt_logprobs, cached, stop_reasons, kv)


# gRPC waits ever longer (up to two minutes) between attempts to reach a server that is down, and
# fails calls at once meanwhile: a frontend started beside a tritonserver that is still loading its
# model would answer 503 long after Triton came up. Retrying every second at most keeps that short.
RECONNECT_BACKOFF_MS = 1000


def _channel_args() -> list[tuple[str, Any]]:
    """tritonclient's default channel arguments, a reconnect backoff of at most
    RECONNECT_BACKOFF_MS, and a subchannel pool of the channel's own: gRPC otherwise lets
    channels of the same target and arguments share one TCP connection."""
    keepalive = grpcclient.KeepAliveOptions()
    return [("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS // 4),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
            ("grpc.use_local_subchannel_pool", 1)]


class TritonGateway:
    """gRPC channels to tritonserver (each its own TCP connection), shared by every request of
    this process: a generation takes the channel with the fewest streams open."""

    def __init__(self, url: str, channels: int = 1) -> None:
        if channels < 1:
            raise ValueError(f"channels must be at least 1, got {channels}")
        self.url = url
        self.clients = [aioclient.InferenceServerClient(url=url, channel_args=_channel_args())
                        for _ in range(channels)]
        self.client = self.clients[0]  # for the unary calls
        self.open_streams = [0] * channels

    def _pick(self) -> int:
        counts = self.open_streams
        return counts.index(min(counts))

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    async def is_live(self) -> bool:
        try:
            return await self.client.is_server_live()
        except InferenceServerException:
            return False

    async def is_model_ready(self, model: str) -> bool:
        try:
            return await self.client.is_model_ready(model)
        except InferenceServerException:
            return False

    async def repository_index(self) -> list[dict[str, Any]]:
        """The models of Triton's repository: [{"name", "version", "state"}, ...]."""
        try:
            index = await self.client.get_model_repository_index(as_json=True)
        except InferenceServerException as e:
            raise OpenAIError(503, f"Triton at {self.url} is not reachable: {e.message()}") from None
        return index.get("models", [])

    async def model_config(self, model: str) -> dict[str, Any]:
        return (await self.client.get_model_config(model, as_json=True))["config"]

    async def model_info(self, model: str) -> dict[str, Any]:
        """A Tritium model's description, its one answer to a MODEL_INFO request: {"model": its
        path, "max_model_len", "lora_modules": {adapter name: directory}}. A 503 when it gives none."""
        finished = asyncio.Event()

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": model, "inputs": [_tensor("stream", np.array([False]), "BOOL")],
                   "request_id": "model-info", "parameters": {MODEL_INFO: True}}
            await finished.wait()

        responses = self.client.stream_infer(requests())
        try:
            async for result, error in responses:
                if error is not None:
                    raise OpenAIError(503, f"model '{model}' did not describe itself: "
                                      f"{error.message() if hasattr(error, 'message') else error}")
                response = result.get_response()
                outputs = {o.name: _values(o.datatype, response.raw_output_contents[i])
                           for i, o in enumerate(response.outputs)}
                return json.loads(outputs["text_output"][0])
            raise OpenAIError(503, f"model '{model}' did not describe itself: the stream ended")
        except (InferenceServerException, grpc.RpcError, KeyError, IndexError, ValueError) as e:
            raise OpenAIError(503, f"model '{model}' did not describe itself: {e}") from None
        finally:
            finished.set()
            responses.cancel()

    async def refused(self, model: str, message: str) -> OpenAIError:
        """The OpenAI error for a stream error that is not the model's JSON: tritonserver's own
        (the model was unloaded after the frontend looked it up; a request Triton refused), or
        a model that does not send kinds (Triton's vLLM backend). Its text is not parsed: a
        model that is not ready now is unavailable (503); a ready one, or Triton for it,
        refused the request (Triton's own refusals are INVALID_ARG), so 400 without a param."""
        if not await self.is_model_ready(model):
            return OpenAIError(503, message)
        return OpenAIError(400, message)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Chunk]:
        """The model's responses, until its final one. A per-request error is raised as an
        OpenAIError; leaving the loop early (a client that went away) cancels the gRPC stream,
        which makes the model abort the request and free its KV blocks."""
        finished = asyncio.Event()
        inputs = build_inputs(req)

        async def requests() -> AsyncIterator[dict[str, Any]]:
            # An error comes as JSON with its kind and parameter (a model that does not read
            # ERROR_DETAILS, e.g. Triton's vLLM backend, ignores it and sends the message).
            yield {"model_name": req.model, "inputs": inputs, "request_id": req.request_id,
                   "parameters": {"triton_enable_empty_final_response": True, ERROR_DETAILS: True}}
            # Our half of the stream stays open until the final response: closing it is a
            # cancellation to some servers.
            await finished.wait()

        channel = self._pick()
        self.open_streams[channel] += 1
        responses = self.clients[channel].stream_infer(requests())
        done = False
        try:
            async for result, error in responses:
                if error is not None:
                    done = True
                    message = error.message() if hasattr(error, "message") else str(error)
                    raise from_triton(message) or await self.refused(req.model, message)
                response = result.get_response()
                final = response.parameters.get("triton_final_response")
                done = final is not None and final.bool_param
                if response.outputs:
                    yield parse_chunk(response)
                if done:
                    return
            raise OpenAIError(503, "the stream to Triton ended without a final response")
        except (InferenceServerException, grpc.RpcError) as e:
            done = True
            detail = e.message() if isinstance(e, InferenceServerException) else str(e)
            raise OpenAIError(503, f"the stream to Triton at {self.url} failed: {detail}") from None
        finally:
            self.open_streams[channel] -= 1
            finished.set()
            if not done:
                responses.cancel()
