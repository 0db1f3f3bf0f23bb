"""POST /v1/completions: one generation per prompt (a string, token ids, or a list of either)."""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tritium.frontend.errors import OpenAIError, bad_request
from tritium.frontend.logprobs import CompletionLogprobs
from tritium.frontend.model_registry import ModelRegistry, ServedModel
from tritium.frontend.protocol import CompletionRequest, parse_body
from tritium.frontend.sampling import completion_sampling
from tritium.frontend.serving import (SSE_DONE, TokenCounts, Totals, collect, merge, new_id, resolve_model,
                              sse, until_disconnected)
from tritium.frontend.triton_gateway import GenerationRequest, TritonGateway


def prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        prompts: list = [p]
    elif p and all(isinstance(t, int) for t in p):
        prompts = [p]
    else:
        prompts = list(p)
    if not prompts or any(len(x) == 0 for x in prompts):
        raise bad_request("prompt must not be empty", "prompt")
    for ids in prompts:  # they travel as an INT32 tensor; the engine checks the vocabulary
        if not isinstance(ids, str) and (max(ids) >= 2**31 or min(ids) < -2**31):
            bad = max(ids) if max(ids) >= 2**31 else min(ids)
            raise bad_request(f"prompt: token id {bad} is out of range (token ids are 32-bit)", "prompt")
    return prompts


class _Prompt:
    """One prompt of the request: what is sent, and what echo and prompt logprobs need."""

    def __init__(self, model: ServedModel, prompt: str | list[int], req: CompletionRequest) -> None:
        self.model, self.prompt, self.req = model, prompt, req
        # A model without an input_ids input (Triton's vLLM backend) gets the ids as text.
        self.sent = prompt if isinstance(prompt, str) or model.takes_input_ids else model.decode(prompt)
        if isinstance(prompt, str) and not req.add_special_tokens:  # vLLM's: no BOS before the text
            if not model.takes_input_ids:
                raise bad_request("add_special_tokens=false needs a model that takes input_ids: this "
                                  "one tokenizes a text prompt itself", "add_special_tokens")
            self.sent = model.encode(prompt, False)

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.model.decode(self.prompt, skip_special_tokens=True)

    def echo_logprobs(self, entries: list | None, k: int) -> CompletionLogprobs:
        lp = CompletionLogprobs(as_ids=bool(self.req.return_tokens_as_token_ids))
        # The engine's tokenization of a text prompt is the tokenizer's, with special tokens.
        ids = self.prompt if isinstance(self.prompt, list) else \
            self.model.encode(self.prompt, self.req.add_special_tokens)
        # Special tokens decode to nothing, as in the echoed text, so that text_offset matches it.
        lp.add_prompt(ids, [self.model.decode([t], skip_special_tokens=True) for t in ids], entries or [None] * len(ids), k)
        return lp


class Completions:
    """Serves completions, streamed or not; choice i * n + j is prompt i's sample j."""

    def __init__(self, gateway: TritonGateway, registry: ModelRegistry) -> None:
        self.gateway, self.registry = gateway, registry

    async def create(self, body: Any, request: Request) -> Response:
        req = parse_body(CompletionRequest, body)
        sampling = completion_sampling(req)
        prompts = prompts_of(req)
        if req.kv_transfer_params and len(prompts) > 1:
            # The response has one kv_transfer_params, and the proxy sends one prompt's.
            raise bad_request(f"kv_transfer_params is for one prompt, got {len(prompts)} prompts: send "
                              "each in a request of its own", "kv_transfer_params")
        model, sampling = await resolve_model(self.registry, req, sampling)
        parts = [_Prompt(model, p, req) for p in prompts]
        response_id = f"cmpl-{req.request_id}" if req.request_id else new_id("cmpl")
        streams = [self.gateway.generate(GenerationRequest(
            model.name, f"{response_id}-{i}", part.sent, sampling, stream=req.stream,
            logprobs=req.logprobs is not None, cached_tokens=model.reports_cached_tokens,
            stop_reason=model.reports_stop_reason))
            for i, part in enumerate(parts)]
        reply = _Reply(req, response_id, parts, model.system_fingerprint)
        if not req.stream:
            totals = await until_disconnected(request, _collect_all(streams, req.n))
            return JSONResponse(reply.complete(totals))
        events = merge(streams)
        first = await until_disconnected(request, anext(events, None))
        return StreamingResponse(reply.events(first, events), media_type="text/event-stream")


async def _collect_all(streams: list, n: int) -> list[Totals]:
    """Every prompt's totals; one failing (a 400) cancels the others' generations."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(collect(s, n)) for s in streams]
    except ExceptionGroup as eg:  # the first failure is the client's answer
        raise eg.exceptions[0] from None
    return [t.result() for t in tasks]


class _Reply:
    def __init__(self, req: CompletionRequest, response_id: str, parts: list[_Prompt],
                 fingerprint: str | None) -> None:
        self.req, self.id, self.parts, self.fingerprint = req, response_id, parts, fingerprint
        self.created = int(time.time())
        self.k = req.logprobs or 0
        self.as_ids = bool(req.return_tokens_as_token_ids)

    def _obj(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.req.model, "system_fingerprint": self.fingerprint, "choices": choices,
                **extra}

    def complete(self, all_totals: list[Totals]) -> dict[str, Any]:
        choices = []
        for p, (part, totals) in enumerate(zip(self.parts, all_totals)):
            for j in range(self.req.n):
                text = totals.text(j)
                logprobs = None
                if self.req.logprobs is not None:
                    lp = (part.echo_logprobs(totals.prompt_logprobs, self.k) if self.req.echo
                          else CompletionLogprobs(as_ids=self.as_ids))
                    lp.add_output(totals.logprobs[j], self.k, text)
                    logprobs = lp.as_dict()
                choices.append({"index": p * self.req.n + j,
                                "text": (part.text() if self.req.echo else "") + text,
                                "logprobs": logprobs, "finish_reason": totals.finish_reasons[j],
                                "stop_reason": totals.stop_reasons[j],
                                "prompt_logprobs": totals.prompt_logprobs})
        # As vLLM: the first prompt's (there is one where the request had kv_transfer_params).
        return self._obj(choices, usage=TokenCounts.total(all_totals).usage(),
                         kv_transfer_params=all_totals[0].kv_transfer_params)

    async def events(self, first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[str]:
        n = self.req.n
        with_usage = self.req.stream_options is not None and self.req.stream_options.include_usage
        continuous = with_usage and self.req.stream_options.continuous
        extra = {"usage": None} if with_usage else {}
        counts = [TokenCounts() for _ in self.parts]
        finished = [[False] * n for _ in self.parts]
        logprobs = [[CompletionLogprobs(as_ids=self.as_ids) for _ in range(n)] for _ in self.parts]
        echoed = [[not self.req.echo] * n for _ in self.parts]
        try:
            item = first
            while item is not None:
                p, chunk = item
                counts[p].add(chunk)
                for j in range(n):
                    text, reason = chunk.texts[j], chunk.finish_reasons[j]
                    lp, start = logprobs[p][j], len(logprobs[p][j].tokens)
                    if not echoed[p][j]:  # the prompt goes first, with the first tokens
                        echoed[p][j] = True
                        if self.req.logprobs is not None:
                            lp = logprobs[p][j] = self.parts[p].echo_logprobs(chunk.prompt_logprobs, self.k)
                        text = self.parts[p].text() + text
                    ends = reason is not None and not finished[p][j]
                    if not text and not ends:
                        continue
                    finished[p][j] = finished[p][j] or ends
                    choice_lp = None
                    if self.req.logprobs is not None:
                        if chunk.logprobs is not None and chunk.logprobs[j]:
                            lp.add_output(chunk.logprobs[j], self.k, chunk.texts[j])
                        choice_lp = lp.as_dict(start)
                    if continuous:
                        extra = {"usage": TokenCounts.total(counts).usage()}
                    stop_reason = chunk.stop_reasons[j] if ends and chunk.stop_reasons else None
                    yield sse(self._obj([{"index": p * n + j, "text": text, "logprobs": choice_lp,
                                          "finish_reason": reason if ends else None,
                                          "stop_reason": stop_reason}], **extra))
                item = await anext(rest, None)
        except OpenAIError as e:  # the status is sent already: the error goes as an event
            yield sse(e.body())
        if with_usage:
            yield sse(self._obj([], usage=TokenCounts.total(counts).usage()))
        yield SSE_DONE
