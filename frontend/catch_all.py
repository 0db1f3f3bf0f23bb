"""The last line of defence: an unexpected exception becomes a 500 in OpenAI's error shape."""
from __future__ import annotations

import logging
from typing import Any

from frontend.errors import OpenAIError

logger = logging.getLogger("frontend")


class CatchAll:
    """A plain ASGI middleware around the whole app. Starlette's own last handler re-raises after
    answering, and uvicorn then closes the connection, so a keep-alive client's next request
    would fail; here the error is logged with its traceback, answered in OpenAI's shape, and the
    connection stays usable. An error after the response has started cannot be answered any more:
    it is raised on, and the server ends the half-sent response."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as e:  # noqa: BLE001 - every error gets an answer
            if started:
                raise
            logger.exception("unexpected error serving %s %s", scope.get("method"), scope.get("path"))
            error = OpenAIError(500, f"internal error: {type(e).__name__}: {e}")
            await error.response()(scope, receive, send)
