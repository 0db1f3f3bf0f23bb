"""The last line of defence: an unexpected exception becomes a 500 in OpenAI's error shape, or,
in a stream already under way, an error event that ends it."""
from __future__ import annotations

import json
import logging
from typing import Any

from tritium.frontend.errors import OpenAIError

logger = logging.getLogger("frontend")


class CatchAll:
    """A plain ASGI middleware around the whole app. Starlette's own last handler re-raises after
    answering, and uvicorn then closes the connection, so a keep-alive client's next request
    would fail; here the error is logged with its traceback, answered in OpenAI's shape, and the
    connection stays usable. A server-sent event stream that fails midway gets the error as its
    last event (as the handlers send an engine's error); any other response that has started
    cannot be answered any more: the error is raised on, and the server drops the connection."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = event_stream = False

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started, finished, event_stream
            if message["type"] == "http.response.start":
                started = True
                event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                   for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as e:  # noqa: BLE001 - every error gets an answer
            if finished or (started and not event_stream):
                raise
            logger.exception("unexpected error serving %s %s", scope.get("method"), scope.get("path"))
            error = OpenAIError(500, f"internal error: {type(e).__name__}: {e}")
            if not started:
                await error.response()(scope, receive, send)
                return
            event = f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode("utf-8")
            await send({"type": "http.response.body", "body": event, "more_body": False})
