"""POST /v1/chat/completions: messages through the model's chat template, then one generation."""
from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tritium.frontend.chat_output import ChatParsing, ChoiceOutput, delta_dict
from tritium.frontend.errors import OpenAIError
from tritium.frontend.limits import check_prompt_text
from tritium.frontend.logprobs import chat_logprobs
from tritium.frontend.model_registry import ModelRegistry, ServedModel
from tritium.frontend.protocol import ChatCompletionRequest, parse_body
from tritium.frontend.sampling import chat_sampling
from tritium.frontend.serving import (SSE_DONE, TokenCounts, collect, new_id, resolve_model, sse,
                              until_disconnected)
from tritium.frontend.triton_gateway import Chunk, GenerationRequest, TritonGateway


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


def chat_text(model: ServedModel, req: ChatCompletionRequest, parsing: ChatParsing | None = None) -> str:
    """The templated prompt's text, with the tools `parsing`'s flags give the template."""
    tools = (parsing or ChatParsing()).template_tools(req)
    return model.apply_chat_template(template_messages(req), tools, req.add_generation_prompt,
                                     req.continue_final_message, template_kwargs(req))


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """chat_template_kwargs, plus vLLM's `documents` and `reasoning_effort` (which, as in vLLM,
    also sets a template's enable_thinking, false for "none", unless the request sets it)."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.documents is not None:
        kwargs["documents"] = req.documents
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
        kwargs.setdefault("enable_thinking", req.reasoning_effort != "none")
    return kwargs


def chat_prompt(model: ServedModel, text: str, add_special_tokens: bool = False) -> str | list[int]:
    """The prompt sent: token ids when the model takes them (the template already holds any
    BOS, so none is added unless asked, as vLLM does), else its text."""
    return model.encode(text, add_special_tokens=add_special_tokens) if model.takes_input_ids else text


def echo_prefix(req: ChatCompletionRequest) -> str | None:
    """vLLM's chat echo: what the reply's content starts with. The last message's content when
    its role is the reply's (the assistant's after a generation prompt, else the last message's
    own role, as vLLM names it), else nothing; None without echo."""
    if not req.echo:
        return None
    last = req.messages[-1]
    generation_prompt = req.add_generation_prompt and not req.continue_final_message
    if last.role != ("assistant" if generation_prompt else last.role):
        return ""
    if isinstance(last.content, list):
        return "\n".join(part.text for part in last.content)
    return last.content or ""


class ChatCompletions:
    """Serves chat completions, streamed or not."""

    def __init__(self, gateway: TritonGateway, registry: ModelRegistry,
                 parsing: ChatParsing | None = None) -> None:
        self.gateway, self.registry = gateway, registry
        self.parsing = parsing or ChatParsing()

    async def create(self, body: Any, request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, body)
        gen, outputs, model = await self.generation(req)
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

    async def generation(self, req: ChatCompletionRequest, response_id: str | None = None
                         ) -> tuple[GenerationRequest, Callable[[], ChoiceOutput], ServedModel]:
        """The model's request for `req`, a maker of each choice's output parser, and the model.
        /v1/responses, a chat completion underneath, is prepared here too."""
        model, sampling = await resolve_model(self.registry, req, chat_sampling(req))
        text = chat_text(model, req, self.parsing)
        check_prompt_text(text)  # before tokenizing
        outputs = self.parsing.for_request(req, text)
        self.parsing.adjust_sampling(req, sampling)
        if response_id is None:
            response_id = f"chatcmpl-{req.request_id}" if req.request_id else new_id("chatcmpl")
        gen = GenerationRequest(model.name, response_id, chat_prompt(model, text, req.add_special_tokens),
                                sampling, stream=req.stream, logprobs=req.logprobs,
                                cached_tokens=model.reports_cached_tokens,
                                stop_reason=model.reports_stop_reason)
        return gen, outputs, model


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
        self.as_ids = bool(req.return_tokens_as_token_ids)
        self.echo = echo_prefix(req)

    def complete(self, totals: Any) -> dict[str, Any]:
        choices = []
        for i in range(self.req.n):
            text = totals.text(i)
            logprobs = ({"content": chat_logprobs(totals.logprobs[i], self.k, text, self.as_ids)}
                        if self.req.logprobs else None)
            output = self.outputs()
            output.start()
            output.feed(text)
            output.finish()
            message = {**output.as_message(), "refusal": None}
            if self.echo is not None:  # as vLLM: after the parsers, and content "" rather than null
                message["content"] = self.echo + (message["content"] or "")
            choices.append({"index": i, "message": message, "logprobs": logprobs,
                            "finish_reason": output.finish_reason(totals.finish_reasons[i]),
                            "stop_reason": totals.stop_reasons[i]})
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.req.model, "system_fingerprint": self.fingerprint, "choices": choices,
                "usage": totals.usage(),
                "prompt_logprobs": totals.prompt_logprobs,
                "kv_transfer_params": totals.kv_transfer_params}

    def _chunk(self, choices: list[dict[str, Any]], with_usage: dict | None = None) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
               "model": self.req.model, "system_fingerprint": self.fingerprint, "choices": choices}
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            obj["usage"] = with_usage
        return sse(obj)

    async def events(self, first: Chunk | None, rest: AsyncIterator[Chunk]) -> AsyncIterator[str]:
        n, counts = self.req.n, TokenCounts()
        counts.add_prompt(first)  # every chunk can carry the prompt's counts
        finished = [False] * n
        continuous = self.req.stream_options is not None and self.req.stream_options.continuous
        outputs = [self.outputs() for _ in range(n)]
        for i in range(n):
            opening = delta_dict(outputs[i].start())
            # A forced call opens with its id and name; any other reply with empty content.
            opening = {"role": "assistant", "content": None, **opening} if opening else \
                {"role": "assistant", "content": ""}
            yield self._chunk([{"index": i, "delta": opening, "logprobs": None, "finish_reason": None}],
                              counts.usage() if continuous else None)
        for i in range(n if self.echo else 0):  # vLLM's echo: its own chunk, after the openings
            yield self._chunk([{"index": i, "delta": {"content": self.echo}, "logprobs": None,
                                "finish_reason": None}],
                              counts.usage() if continuous else None)
        try:
            chunk = first
            while chunk is not None:
                counts.add(chunk)
                for i in range(n):
                    text, reason = chunk.texts[i], chunk.finish_reasons[i]
                    ends = reason is not None and not finished[i]
                    if not text and not ends:
                        continue
                    finished[i] = finished[i] or ends
                    logprobs = None
                    if self.req.logprobs and chunk.logprobs is not None and chunk.logprobs[i]:
                        logprobs = {"content": chat_logprobs(chunk.logprobs[i], self.k, text, self.as_ids)}
                    delta = outputs[i].feed(text)
                    if ends:
                        delta.extend(outputs[i].finish())
                    reason = outputs[i].finish_reason(reason) if ends else None
                    if not delta and not ends and logprobs is None:
                        continue  # held back (a tag may be starting)
                    choice = {"index": i, "delta": delta_dict(delta), "logprobs": logprobs,
                              "finish_reason": reason}
                    if ends:  # as vLLM: in the choice's last chunk only
                        choice["stop_reason"] = chunk.stop_reasons[i] if chunk.stop_reasons else None
                    yield self._chunk([choice], counts.usage() if continuous else None)
                chunk = await anext(rest, None)
        except OpenAIError as e:  # the status is sent already: the error goes as an event
            yield sse(e.body())
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            yield self._chunk([], counts.usage())
        yield SSE_DONE
