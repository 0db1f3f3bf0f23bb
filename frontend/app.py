"""The ASGI application: routes, the API key check, and errors in OpenAI's shape."""
from __future__ import annotations

import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from frontend.chat import ChatCompletions
from frontend.completions import Completions
from frontend.errors import OpenAIError, bad_request
from frontend.model_registry import ModelRegistry
from frontend.triton_gateway import TritonGateway


@dataclass
class FrontendConfig:
    """How the frontend reaches Triton and what it serves."""

    triton_grpc: str = "localhost:8001"
    models: tuple[str, ...] = ()  # served model names; empty: every ready model
    api_key: str | None = None
    chat_template: str | None = None  # a Jinja template's text, over the tokenizer's own
    tokenizer: str | None = None  # over the one named by the model's config


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


def create_app(config: FrontendConfig) -> FastAPI:
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # The gRPC channel belongs to the serving process's event loop, so it is made here.
        gateway = TritonGateway(config.triton_grpc)
        registry = ModelRegistry(gateway, list(config.models), config.tokenizer, config.chat_template)
        state.update(gateway=gateway, registry=registry, chat=ChatCompletions(gateway, registry),
                     completions=Completions(gateway, registry))
        yield
        await gateway.close()

    app = FastAPI(title="Tritium OpenAI-compatible frontend", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> Response:
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> Response:
        return OpenAIError(e.status_code, str(e.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> Response:
        return bad_request(str(e)).response()

    @app.middleware("http")
    async def _api_key(request: Request, call_next: Any) -> Response:
        if config.api_key and request.url.path.startswith("/v1/") and \
                request.headers.get("authorization") != f"Bearer {config.api_key}":
            return OpenAIError(401, "Incorrect or missing API key (Authorization: Bearer ...).",
                               code="invalid_api_key").response()
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        gateway, registry = state["gateway"], state["registry"]
        if not await gateway.is_live():
            raise OpenAIError(503, f"Triton at {config.triton_grpc} is not live")
        names = list(config.models) or await registry.ready_models()
        not_ready = [m for m in names if not await gateway.is_model_ready(m)]
        if not names or not_ready:
            raise OpenAIError(503, f"model(s) not ready: {', '.join(not_ready) or 'none loaded'}")
        return JSONResponse({"status": "ok", "models": names})

    @app.get("/v1/models")
    async def models() -> Response:
        created = int(time.time())
        return JSONResponse({"object": "list", "data": [
            {"id": m, "object": "model", "created": created, "owned_by": "tritium"}
            for m in await state["registry"].ready_models()]})

    @app.get("/v1/models/{name}")
    async def model(name: str) -> Response:
        if name not in await state["registry"].ready_models():
            raise OpenAIError(404, f"The model '{name}' does not exist.", "model", "model_not_found")
        return JSONResponse({"id": name, "object": "model", "created": int(time.time()),
                             "owned_by": "tritium"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await state["chat"].create(await _json_body(request), request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await state["completions"].create(await _json_body(request), request)

    return app
