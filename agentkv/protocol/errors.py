"""The one error type of both servers (the router and the simulator), and OpenAI's (and vLLM's)
error shape: ``{"error": {"message", "type", "param", "code"}}``.

Code anywhere in a request's path raises :class:`APIError`; the app's exception handlers
(:func:`agentkv.protocol.http.api_error_response`) render it in the shape of the API the
request came in on (OpenAI's, or Anthropic's for ``/v1/messages``).
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

import orjson
from pydantic import BaseModel

__all__ = [
    "APIError",
    "ErrorInfo",
    "ErrorResponse",
    "UpstreamError",
    "error_body",
    "error_type_for",
]

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "TimeoutError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ErrorInfo(BaseModel):
    """The ``error`` object (vLLM ``ErrorInfo``; OpenAI's own errors have a string ``code``)."""

    message: str
    type: str
    param: str | None = None
    code: int | str


class ErrorResponse(BaseModel):
    """A whole error body (vLLM ``ErrorResponse``)."""

    error: ErrorInfo


def error_type_for(status: int) -> str:
    """The ``type`` vLLM and OpenAI use for an HTTP status."""
    if status in _TYPES:
        return _TYPES[status]
    try:
        return HTTPStatus(status).phrase.replace(" ", "") + "Error"
    except ValueError:
        return "Error"


def error_body(
    status: int,
    message: str,
    *,
    param: str | None = None,
    type: str | None = None,
    code: int | str | None = None,
) -> dict[str, Any]:
    """The JSON body for an error response with ``status`` (``type`` and ``code`` default to
    vLLM's: the status's error type, the status)."""
    info = ErrorInfo(
        message=message,
        type=type or error_type_for(status),
        param=param,
        code=status if code is None else code,
    )
    return ErrorResponse(error=info).model_dump()


class APIError(Exception):
    """A request answered with an error: its HTTP ``status``, the client's ``message``, and in
    OpenAI's shape an optional ``param``, ``type`` and ``code`` (default: vLLM's for the status);
    ``headers`` go on the response (``Retry-After``; ``Connection: close`` when the request body
    was not read to its end)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        code: int | str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code = type, code
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The error in OpenAI's shape."""
        return error_body(
            self.status, self.message, param=self.param, type=self.type, code=self.code
        )


class UpstreamError(APIError):
    """An engine's own client error (4xx): its body goes to an OpenAI-shaped API's client
    unchanged (``raw``), its message to an Anthropic one."""

    def __init__(self, status: int, raw: bytes) -> None:
        super().__init__(status, _message_of(raw))
        self.raw = raw


def _message_of(raw: bytes) -> str:
    try:
        error = orjson.loads(raw).get("error") or {}
        return str(error.get("message") or "Upstream error.")
    except (orjson.JSONDecodeError, AttributeError):
        return "Upstream error."
