"""Talks to tritonserver over gRPC: model discovery, and one bidirectional stream per generation
in the vLLM backend's request interface."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from frontend.errors import OpenAIError, from_triton


@dataclass
class GenerationRequest:
    """One request to the model: a prompt (text or token ids) and its sampling parameters."""

    model: str
    request_id: str
    prompt: str | list[int]
    sampling: dict[str, Any]
    stream: bool
    logprobs: bool = False  # ask for the logprobs (and prompt_logprobs) outputs


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
    inputs.append(_tensor("sampling_parameters",
                          np.array([json.dumps(req.sampling).encode("utf-8")], dtype=np.object_), "BYTES"))
    inputs += [_tensor(k, np.array([v], dtype=bool), "BOOL") for k, v in flags.items()]
    return inputs


def parse_chunk(result: Any) -> Chunk:
    outputs = {o.name for o in result.get_response().outputs}

    def strings(name: str) -> list[str]:
        return [b.decode("utf-8") for b in result.as_numpy(name).reshape(-1)]

    texts = strings("text_output")
    n = len(texts)
    counts = ([int(c) for c in result.as_numpy("num_output_tokens").reshape(-1)]
              if "num_output_tokens" in outputs else [0] * n)
    reasons: list[str | None] = ([None if r in ("None", "") else r for r in strings("finish_reason")]
                                 if "finish_reason" in outputs else [None] * n)
    num_input = int(result.as_numpy("num_input_tokens").reshape(-1)[0]) if "num_input_tokens" in outputs else 0
    logprobs = [json.loads(s) for s in strings("logprobs")] if "logprobs" in outputs else None
    prompt_logprobs = json.loads(strings("prompt_logprobs")[0]) if "prompt_logprobs" in outputs else None
    return Chunk(texts, counts, reasons, num_input, logprobs, prompt_logprobs)


class TritonGateway:
    """One gRPC channel to tritonserver, shared by every request of this process."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = aioclient.InferenceServerClient(url=url)

    async def close(self) -> None:
        await self.client.close()

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

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Chunk]:
        """The model's responses, until its final one. A per-request error is raised as an
        OpenAIError; leaving the loop early (a client that went away) cancels the gRPC stream,
        which makes the model abort the request and free its KV blocks."""
        finished = asyncio.Event()
        inputs = build_inputs(req)

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": req.model, "inputs": inputs, "request_id": req.request_id,
                   "parameters": {"triton_enable_empty_final_response": True}}
            # Our half of the stream stays open until the final response: closing it is a
            # cancellation to some servers.
            await finished.wait()

        responses = self.client.stream_infer(requests())
        done = False
        try:
            async for result, error in responses:
                if error is not None:
                    done = True
                    raise from_triton(error.message() if hasattr(error, "message") else str(error))
                response = result.get_response()
                final = response.parameters.get("triton_final_response")
                done = final is not None and final.bool_param
                if response.outputs:
                    yield parse_chunk(result)
                if done:
                    return
            raise OpenAIError(503, "the stream to Triton ended without a final response")
        except (InferenceServerException, grpc.RpcError) as e:
            done = True
            detail = e.message() if isinstance(e, InferenceServerException) else str(e)
            raise OpenAIError(503, f"the stream to Triton at {self.url} failed: {detail}") from None
        finally:
            finished.set()
            if not done:
                responses.cancel()
