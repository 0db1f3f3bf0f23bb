"""POST /v1/chat/completions: messages through the model's chat template, then one generation."""
from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from frontend.chat_output import ChatParsing, ChoiceOutput, delta_dict
from frontend.errors import OpenAIError
from frontend.logprobs import chat_logprobs
from frontend.model_registry import ModelRegistry, ServedModel
from frontend.protocol import ChatCompletionRequest, parse_body
from frontend.sampling import chat_sampling
from frontend.serving import SSE_DONE, collect, new_id, sse, until_disconnected, usage
from frontend.triton_gateway import Chunk, GenerationRequest, TritonGateway


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as chat templates take them: content as one string (text parts joined), and
    the arguments of earlier tool calls as objects (templates write them with `tojson`), as
    vLLM passes them."""
    messages = []
    for m in req.messages:
        message = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            message["content"] = "\n".join(part.text for part in m.content)
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass  # left as the client wrote it
        messages.append(message)
    return messages


def chat_text(model: ServedModel, req: ChatCompletionRequest) -> str:
    """The templated prompt's text."""
    tools = ([t.model_dump(exclude_none=True) for t in req.tools]
             if req.tools and req.tool_choice != "none" else None)
    return model.apply_chat_template(template_messages(req), tools, req.add_generation_prompt,
                                     req.continue_final_message, req.chat_template_kwargs or {})


def chat_prompt(model: ServedModel, text: str) -> str | list[int]:
    """The prompt sent: token ids when the model takes them (the template already holds any
    BOS, so none is added, as vLLM does), else its text."""
    return model.encode(text, add_special_tokens=False) if model.takes_input_ids else text


class ChatCompletions:
    """Serves chat completions, streamed or not."""

    def __init__(self, gateway: TritonGateway, registry: ModelRegistry,
                 parsing: ChatParsing | None = None) -> None:
        self.gateway, self.registry = gateway, registry
        self.parsing = parsing or ChatParsing()

    async def create(self, body: Any, request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, body)
        sampling = chat_sampling(req)
        model = await self.registry.get(req.model)
        text = chat_text(model, req)
        outputs = self.parsing.for_request(req, text)
        gen = GenerationRequest(req.model, new_id("chatcmpl"), chat_prompt(model, text), sampling,
                                stream=req.stream, logprobs=req.logprobs,
                                cached_tokens=model.reports_cached_tokens)
        reply = _Reply(req, gen.request_id, outputs, model.system_fingerprint)
        chunks = self.gateway.generate(gen)
        try:
            if not req.stream:
                totals = await until_disconnected(request, collect(chunks, req.n))
                return JSONResponse(reply.complete(totals))
            # The first response decides the status: a request the model rejects gets its 400.
            first = await until_disconnected(request, anext(chunks, None))
        except OpenAIError as e:  # the engine's parameter names -> the request's
            raise e.renamed(_field_names(req)) from None
        return StreamingResponse(reply.events(first, chunks), media_type="text/event-stream")


def _field_names(req: ChatCompletionRequest) -> dict[str, str]:
    """The request field behind each sampling parameter that chat names differently."""
    names = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    return names


class _Reply:
    """The response objects of one chat completion."""

    def __init__(self, req: ChatCompletionRequest, response_id: str,
                 outputs: Callable[[], ChoiceOutput], fingerprint: str | None = None) -> None:
        self.req, self.id, self.outputs, self.fingerprint = req, response_id, outputs, fingerprint
        self.created = int(time.time())
        self.k = req.top_logprobs or 0

    def complete(self, totals: Any) -> dict[str, Any]:
        choices = []
        for i in range(self.req.n):
            text = totals.text(i)
            logprobs = ({"content": chat_logprobs(totals.logprobs[i], self.k, text)}
                        if self.req.logprobs else None)
            output = self.outputs()
            output.start()
            output.feed(text)
            output.finish()
            choices.append({"index": i, "message": {**output.as_message(), "refusal": None},
                            "logprobs": logprobs,
                            "finish_reason": output.finish_reason(totals.finish_reasons[i])})
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.req.model, "system_fingerprint": self.fingerprint, "choices": choices,
                "usage": usage(totals.prompt_tokens, totals.completion_tokens, totals.cached_tokens)}

    def _chunk(self, choices: list[dict[str, Any]], with_usage: dict | None = None) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
               "model": self.req.model, "system_fingerprint": self.fingerprint, "choices": choices}
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            obj["usage"] = with_usage
        return sse(obj)

    async def events(self, first: Chunk | None, rest: AsyncIterator[Chunk]) -> AsyncIterator[str]:
        n, completion_tokens = self.req.n, 0
        # The first response already holds the prompt's counts: every chunk can carry them.
        prompt_tokens = first.num_input_tokens if first is not None else 0
        cached_tokens = first.num_cached_tokens if first is not None else None
        finished = [False] * n
        continuous = self.req.stream_options is not None and self.req.stream_options.continuous
        outputs = [self.outputs() for _ in range(n)]
        for i in range(n):
            opening = delta_dict(outputs[i].start())
            # A forced call opens with its id and name; any other reply with empty content.
            opening = {"role": "assistant", "content": None, **opening} if opening else \
                {"role": "assistant", "content": ""}
            yield self._chunk([{"index": i, "delta": opening, "logprobs": None, "finish_reason": None}],
                              usage(prompt_tokens, 0, cached_tokens) if continuous else None)
        try:
            chunk = first
            while chunk is not None:
                prompt_tokens = chunk.num_input_tokens or prompt_tokens
                cached_tokens = cached_tokens if chunk.num_cached_tokens is None else chunk.num_cached_tokens
                completion_tokens += sum(chunk.num_output_tokens)
                for i in range(n):
                    text, reason = chunk.texts[i], chunk.finish_reasons[i]
                    ends = reason is not None and not finished[i]
                    if not text and not ends:
                        continue
                    finished[i] = finished[i] or ends
                    logprobs = None
                    if self.req.logprobs and chunk.logprobs is not None and chunk.logprobs[i]:
                        logprobs = {"content": chat_logprobs(chunk.logprobs[i], self.k, text)}
                    delta = outputs[i].feed(text)
                    if ends:
                        delta.extend(outputs[i].finish())
                    reason = outputs[i].finish_reason(reason) if ends else None
                    if not delta and not ends and logprobs is None:
                        continue  # held back (a tag may be starting)
                    yield self._chunk([{"index": i, "delta": delta_dict(delta),
                                        "logprobs": logprobs, "finish_reason": reason}],
                                      usage(prompt_tokens, completion_tokens, cached_tokens)
                                      if continuous else None)
                chunk = await anext(rest, None)
        except OpenAIError as e:  # the status is sent already: the error goes as an event
            yield sse(e.body())
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            yield self._chunk([], usage(prompt_tokens, completion_tokens, cached_tokens))
        yield SSE_DONE
