"""What both servers (the router and the simulator) put on and read off HTTP, written once:
SSE framing, JSON bodies (orjson), and errors: an :class:`~agentkv.protocol.errors.APIError`
rendered by the exception handlers both apps register (:func:`exception_handlers`; any other
exception by :class:`UnexpectedErrors`) in the shape of the API the request came in on:
Anthropic's for ``/v1/messages`` and below, OpenAI's (as vLLM answers) everywhere else.

Needs the ``serve`` extra (Starlette, orjson), like :mod:`agentkv.protocol.kv_events` needs
msgspec; ``agentkv.protocol`` itself does not import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, ExceptionHandler, Message, Receive, Scope, Send

from agentkv.protocol import anthropic
from agentkv.protocol.errors import APIError, UpstreamError

__all__ = [
    "ErrorShape",
    "ORJSONResponse",
    "UnexpectedErrors",
    "api_error_response",
    "error_shape",
    "exception_handlers",
    "json_object",
    "sse",
]

ErrorShape = Literal["openai", "anthropic"]
OnError = Callable[[int], None]
"""Called with the status of every error answered (the router counts them)."""


def sse(data: dict[str, Any] | str) -> bytes:
    """One SSE event in vLLM's framing (``data: {...}`` and a blank line; ``sse("[DONE]")``)."""
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    return b"data: " + payload + b"\n\n"


class ORJSONResponse(Response):
    """A JSON response encoded by orjson (Starlette's ``JSONResponse`` uses stdlib json)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_shape(path: str) -> ErrorShape:
    """The error shape of the API ``path`` belongs to: Anthropic's for the Messages API
    (``/v1/messages``, ``/v1/messages/count_tokens``), else OpenAI's."""
    return "anthropic" if path == "/v1/messages" or path.startswith("/v1/messages/") else "openai"


def api_error_response(exc: APIError, shape: ErrorShape = "openai") -> Response:
    """``exc`` as a response in ``shape``: OpenAI's ``{"error": {...}}`` (an engine's own
    error body unchanged), or Anthropic's ``{"type": "error", "error": {...}}``."""
    if shape == "anthropic":
        body = anthropic.error_body(exc.status, exc.message)
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)
    if isinstance(exc, UpstreamError):
        return Response(
            exc.raw, status_code=exc.status, media_type="application/json", headers=exc.headers
        )
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def exception_handlers(on_error: OnError | None = None) -> dict[Any, ExceptionHandler]:
    """Starlette exception handlers answering an :class:`APIError` in the shape of the API the
    request came in on (``on_error`` sees its status). A server adds its own next to them."""

    async def handle(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        if on_error is not None:
            on_error(exc.status)
        return api_error_response(exc, error_shape(request.url.path))

    return {APIError: handle}


class UnexpectedErrors:
    """ASGI middleware (``Middleware(UnexpectedErrors, unexpected=...)``): an exception no
    exception handler took, answered as the :class:`APIError` that ``unexpected`` makes of it
    (and logs) in the request's API shape, never as a traceback; ``on_error`` sees its status.

    A middleware, not an ``Exception`` handler: Starlette gives that one to its outermost
    middleware, which answers and then re-raises (the server logs the traceback again and closes
    the connection; an in-process client gets the exception). An exception after the first byte
    of a response cannot be answered: it is re-raised, and the server cuts the connection."""

    def __init__(
        self,
        app: ASGIApp,
        unexpected: Callable[[Request, Exception], APIError],
        on_error: OnError | None = None,
    ) -> None:
        self.app, self.unexpected, self.on_error = app, unexpected, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if started:
                raise
            error = _client_fault(exc) or self.unexpected(Request(scope), exc)
            if self.on_error is not None:
                self.on_error(error.status)
            await api_error_response(error, error_shape(scope["path"]))(scope, receive, send)


def _client_fault(exc: Exception) -> APIError | None:
    """An exception that only a client's body can cause, as the 400 it deserves: JSON nested
    deeper than orjson writes (254 levels; it reads up to 1,024), met when a body is forwarded."""
    if type(exc) is TypeError and str(exc) == "Recursion limit reached":
        return APIError(400, "The request's JSON is nested more than 254 levels deep.")
    return None


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object; ``ValueError`` with the client's message."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"Invalid JSON body: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError("The request body must be a JSON object.")
    return data
