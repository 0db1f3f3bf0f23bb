"""The ASGI application: routes, the API key check, and errors in OpenAI's shape."""
from __future__ import annotations

import gc
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from tritium.frontend.catch_all import CatchAll
from tritium.frontend.chat import ChatCompletions
from tritium.frontend.chat_output import ChatParsing
from tritium.frontend.completions import Completions
from tritium.frontend.errors import OpenAIError, bad_request
from tritium.frontend.json_body import decode_json_body, read_body
from tritium.frontend import __version__
from tritium.frontend.metrics import CONTENT_TYPE, FrontendMetrics, default_triton_metrics_url
from tritium.frontend.model_cards import model_cards, one_model_card
from tritium.frontend.model_registry import ModelRegistry
from tritium.frontend.responses import Responses
from tritium.frontend.tokenization import Tokenization
from tritium.frontend.triton_gateway import TritonGateway


@dataclass
class FrontendConfig:
    """How the frontend reaches Triton and what it serves."""

    triton_grpc: str = "localhost:8001"
    models: tuple[str, ...] = ()  # the Triton models served (--model); empty: every ready model
    api_key: str | None = None
    chat_template: str | None = None  # a Jinja template's text, over the tokenizer's own
    tokenizer: str | None = None  # over the one named by the model's config
    grpc_channels: int | None = None  # per process; None: TritonGateway's default
    parsing: ChatParsing = field(default_factory=ChatParsing)  # tool-call and reasoning parsers
    # Triton's metrics endpoint, whose vllm: families /metrics passes on; None: on the gRPC
    # address's host at port 8002; "": none.
    triton_metrics: str | None = None
    # vLLM's --served-model-name: the names of the one --model, the first reported in responses.
    served_model_names: tuple[str, ...] = ()


async def _json_body(request: Request) -> Any:
    return decode_json_body(await read_body(request.stream(), request.headers.get("content-length")))


def create_app(config: FrontendConfig, on_started: Callable[[], None] | None = None,
               all_started: Callable[[], bool] | None = None) -> FastAPI:
    """`on_started`: called once this process is ready to serve; `all_started`: whether every
    worker process is (until then /health answers 503), where the frontend runs several."""
    state: dict[str, Any] = {}
    metrics = FrontendMetrics(default_triton_metrics_url(config.triton_grpc)
                              if config.triton_metrics is None else config.triton_metrics or None,
                              {config.models[0]: config.served_model_names[0]} if config.served_model_names else {})

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # The gRPC channels belong to the serving process's event loop, so they are made here.
        gateway = (TritonGateway(config.triton_grpc) if config.grpc_channels is None
                   else TritonGateway(config.triton_grpc, config.grpc_channels))
        registry = ModelRegistry(gateway, list(config.models), config.tokenizer, config.chat_template,
                                 list(config.served_model_names))
        chat = ChatCompletions(gateway, registry, config.parsing)
        state.update(gateway=gateway, registry=registry, chat=chat,
                     completions=Completions(gateway, registry),
                     responses=Responses(chat), tokenization=Tokenization(registry))
        # Before the server takes connections: loading a tokenizer imports transformers, which
        # holds the GIL for seconds and would stall every stream this process serves meanwhile.
        await registry.warm()
        # What start-up made (transformers, the tokenizers: hundreds of thousands of objects)
        # lives as long as the process: out of the collector's view, so that a full collection
        # while serving, which holds the GIL and so every stream, walks only what serving made.
        gc.collect()
        gc.freeze()
        if on_started is not None:
            on_started()
        yield
        await gateway.close()
        await metrics.close()

    app = FastAPI(title="Tritium OpenAI-compatible frontend", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> Response:
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> Response:
        # OpenAI's words for a URL or method it does not serve.
        where = f"({request.method} {request.url.path})"
        message = {404: f"Invalid URL {where}", 405: f"Invalid method for URL {where}"}.get(
            e.status_code, str(e.detail))
        response = OpenAIError(e.status_code, message).response()
        response.headers.update(e.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> Response:
        return bad_request(str(e)).response()

    # The last added is the outermost: every request is measured, errors included.
    if config.api_key:
        app.add_middleware(_ApiKey, key=config.api_key)
    app.add_middleware(CatchAll)
    app.add_middleware(metrics.middleware)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(await metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/health")
    async def health() -> Response:
        gateway, registry = state["gateway"], state["registry"]
        if all_started is not None and not all_started():
            raise OpenAIError(503, "the frontend's worker processes are still starting")
        if not await gateway.is_live():
            raise OpenAIError(503, f"Triton at {config.triton_grpc} is not live")
        names = list(config.models) or await registry.ready_models()
        not_ready = [m for m in names if not await gateway.is_model_ready(m)]
        if not names or not_ready:
            raise OpenAIError(503, f"model(s) not ready: {', '.join(not_ready) or 'none loaded'}")
        return JSONResponse({"status": "ok", "models": names})

    # vLLM's (SageMaker's health check): /health's answer, to GET and POST.
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": await model_cards(state["registry"])})

    @app.get("/v1/models/{name:path}")  # (served names are often Hub ids, org/model)
    async def model(name: str) -> Response:
        return JSONResponse(await one_model_card(state["registry"], name))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await state["tokenization"].tokenize(await _json_body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await state["tokenization"].detokenize(await _json_body(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await state["chat"].create(await _json_body(request), request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await state["completions"].create(await _json_body(request), request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await state["responses"].create(await _json_body(request), request)

    return app


class _ApiKey:
    """Requires 'Authorization: Bearer KEY' on /v1/. A plain ASGI middleware: FastAPI's
    @app.middleware("http") (Starlette's BaseHTTPMiddleware) would pass every streamed event
    through a memory stream and a task of its own."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode("utf-8")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and \
                dict(scope["headers"]).get(b"authorization") != self.expected:
            response = OpenAIError(401, "Incorrect or missing API key (Authorization: Bearer ...).",
                                   code="invalid_api_key").response()
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
