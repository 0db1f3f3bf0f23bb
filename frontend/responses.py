"""POST /v1/responses (OpenAI's Responses API, as the OpenAI Agents SDK calls it): the request is
served as a chat completion (frontend/responses_request.py), and its reply given as a `response`
object, or streamed as the Responses API's server-sent events."""
from __future__ import annotations

import json
import time
from itertools import count
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tritium.frontend.chat import ChatCompletions
from tritium.frontend.chat_output import ChoiceOutput
from tritium.frontend.errors import OpenAIError
from tritium.frontend.responses_output import Event, OutputItems
from tritium.frontend.responses_request import ResponsesRequest, parse_responses_request
from tritium.frontend.serving import TokenCounts, collect, new_id, until_disconnected
from tritium.frontend.tool_parsers import DeltaMessage
from tritium.frontend.triton_gateway import Chunk

# The chat request's field (or the engine's parameter) behind each Responses field named otherwise.
_FIELD_NAMES = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                "response_format": "text.format", "messages": "input"}


class Responses:
    """Serves responses, streamed or not, through the chat path's preparation."""

    def __init__(self, chat: ChatCompletions) -> None:
        self.chat = chat

    async def create(self, body: Any, request: Request) -> Response:
        try:
            req, chat = parse_responses_request(body)
            gen, outputs, _ = await self.chat.generation(chat, new_id("resp", "_"))
            reply = _Reply(req, gen.request_id, outputs(), chat.model)
            chunks = self.chat.gateway.generate(gen)
            if not req.stream:
                totals = await until_disconnected(request, collect(chunks, 1))
                return JSONResponse(reply.complete(totals.text(0), totals.finish_reasons[0], totals))
            # The first response decides the status: a request the model rejects gets its 400.
            first = await until_disconnected(request, anext(chunks, None))
        except OpenAIError as e:
            raise e.renamed(_FIELD_NAMES) from None
        return StreamingResponse(reply.events(first, chunks), media_type="text/event-stream")


def _usage(counts: TokenCounts) -> dict[str, Any]:
    """The Responses API's usage object."""
    return {"input_tokens": counts.prompt_tokens,
            "input_tokens_details": {"cached_tokens": counts.cached_tokens or 0},
            "output_tokens": counts.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts.prompt_tokens + counts.completion_tokens}


class _Reply:
    """The response object of one request, and its stream of events."""

    def __init__(self, req: ResponsesRequest, response_id: str, output: ChoiceOutput, model: str) -> None:
        self.req, self.id, self.output, self.model = req, response_id, output, model
        self.created_at = int(time.time())
        self.items = OutputItems()

    def response(self, status: str, usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "model": self.model, "output": self.items.items, "usage": usage,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "metadata": req.metadata, "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": None, "temperature": req.temperature,
                "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
                "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": req.top_p,
                "truncation": "disabled", "background": False}

    def _add(self, delta: DeltaMessage) -> list[Event]:
        tools = self.output.tools
        return self.items.add(delta, tools.abandoned if tools is not None else frozenset())

    def _finish(self, reason: str | None) -> tuple[str, list[Event]]:
        events = self._add(self.output.finish())
        status = "incomplete" if reason == "length" else "completed"
        return status, events + self.items.finish(status)

    def complete(self, text: str, reason: str | None, counts: TokenCounts) -> dict[str, Any]:
        self._add(self.output.start())
        self._add(self.output.feed(text))
        status, _ = self._finish(reason)
        return self.response(status, _usage(counts))

    async def events(self, first: Chunk | None, rest: AsyncIterator[Chunk]) -> AsyncIterator[str]:
        sequence = count()

        def sse(event: Event) -> str:
            data = json.dumps({**event, "sequence_number": next(sequence)}, separators=(",", ":"),
                              ensure_ascii=False)
            return f"event: {event['type']}\ndata: {data}\n\n"

        yield sse({"type": "response.created", "response": self.response("in_progress")})
        yield sse({"type": "response.in_progress", "response": self.response("in_progress")})
        for event in self._add(self.output.start()):
            yield sse(event)
        counts, reason = TokenCounts(), None
        try:
            chunk = first
            while chunk is not None:
                counts.add(chunk)
                reason = chunk.finish_reasons[0] or reason
                for event in self._add(self.output.feed(chunk.texts[0])) if chunk.texts[0] else ():
                    yield sse(event)
                chunk = await anext(rest, None)
        except OpenAIError as e:  # the status is sent already: the error goes as events
            error = e.body()["error"]
            yield sse({"type": "error", "code": str(error["code"]), "message": e.message, "param": e.param})
            yield sse({"type": "response.failed", "response": self.response(
                "failed", error={"code": str(error["code"]), "message": e.message})})
            return
        status, events = self._finish(reason)
        for event in events:
            yield sse(event)
        yield sse({"type": f"response.{status}", "response": self.response(status, _usage(counts))})
