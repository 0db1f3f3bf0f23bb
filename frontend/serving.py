"""What the chat, completions and responses handlers share: request ids, the model a request
names, server-sent events, watching for a client that went away, merging several generations, a
generation's token counts as it streams, and the totals of a finished one."""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, TypeVar

from starlette.requests import Request

from tritium.frontend.errors import OpenAIError
from tritium.frontend.limits import check_max_tokens
from tritium.frontend.model_registry import ModelRegistry, ServedModel
from tritium.frontend.triton_gateway import Chunk

T = TypeVar("T")


def new_id(prefix: str, sep: str = "-") -> str:
    return f"{prefix}{sep}{uuid.uuid4().hex}"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def resolve_model(registry: ModelRegistry, req: Any,
                        sampling: dict[str, Any]) -> tuple[ServedModel, dict[str, Any]]:
    """The model a request's `model` names (a served name, or a LoRA adapter's: vLLM's way to
    select it) and `sampling` with that adapter. `req.model` becomes the name the responses
    report; max_tokens is checked against the model's max_model_len."""
    target = await registry.resolve(req.model)
    sampling = target.with_lora(sampling)
    req.model = target.name
    check_max_tokens(req, target.model.max_model_len)
    return target.model, sampling


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` (prompt tokens served from the prefix cache) is
    None where the model does not report it, and then prompt_tokens_details is null."""
    details = None if cached_tokens is None else {"cached_tokens": cached_tokens}
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": details}


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; cancelled when the client disconnects first (its Triton request then
    ends: the gRPC stream is cancelled, the model aborts it and frees its KV blocks)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise OpenAIError(499, "the client disconnected")
    return task.result()


async def merge(streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """(stream index, chunk) from several generations as they come; a failure in one ends all."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in stream:
                await queue.put((i, chunk, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, e))
            return
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                running -= 1
            else:
                yield i, chunk
    finally:
        for t in tasks:
            t.cancel()


@dataclass
class TokenCounts:
    """A generation's token counts, from its chunks as they come (each may repeat the prompt's)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # None where the model does not report it

    def add(self, chunk: Chunk) -> None:
        self.add_prompt(chunk)
        self.completion_tokens += sum(chunk.num_output_tokens)

    def add_prompt(self, chunk: Chunk | None) -> None:
        """The prompt's counts alone: the first response holds them, so that what is sent
        before its text can carry them."""
        if chunk is None:
            return
        self.prompt_tokens = chunk.num_input_tokens or self.prompt_tokens
        if chunk.num_cached_tokens is not None:
            self.cached_tokens = chunk.num_cached_tokens

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    @staticmethod
    def total(counts: list[TokenCounts]) -> TokenCounts:
        """Several generations' counts together (cached tokens: None where none reports them)."""
        cached = [c.cached_tokens for c in counts if c.cached_tokens is not None]
        return TokenCounts(sum(c.prompt_tokens for c in counts), sum(c.completion_tokens for c in counts),
                           sum(cached) if cached else None)


@dataclass
class Totals(TokenCounts):
    """One generation's samples, accumulated from its chunks."""

    n: int = 1
    texts: list[list[str]] = field(default_factory=list)
    logprobs: list[list[dict]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    stop_reasons: list[int | str | None] = field(default_factory=list)
    prompt_logprobs: list | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.texts = [[] for _ in range(self.n)]
        self.logprobs = [[] for _ in range(self.n)]
        self.finish_reasons = [None] * self.n
        self.stop_reasons = [None] * self.n

    def add(self, chunk: Chunk) -> None:
        super().add(chunk)
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if chunk.kv_transfer_params is not None:
            self.kv_transfer_params = chunk.kv_transfer_params
        for i, text in enumerate(chunk.texts):
            self.texts[i].append(text)
            if chunk.logprobs is not None and chunk.logprobs[i]:
                self.logprobs[i] += chunk.logprobs[i]
            if chunk.finish_reasons[i] is not None:
                self.finish_reasons[i] = chunk.finish_reasons[i]
                self.stop_reasons[i] = chunk.stop_reasons[i] if chunk.stop_reasons else None

    def text(self, i: int) -> str:
        return "".join(self.texts[i])


async def collect(stream: AsyncIterator[Chunk], n: int) -> Totals:
    totals = Totals(n=n)
    async for chunk in stream:
        totals.add(chunk)
    return totals
