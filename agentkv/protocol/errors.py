"""OpenAI's (and vLLM's) error shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from pydantic import BaseModel

__all__ = ["ErrorInfo", "ErrorResponse", "error_body", "error_type_for"]

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
    """The ``error`` object (vLLM ``ErrorInfo``)."""

    message: str
    type: str
    param: str | None = None
    code: int


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
    status: int, message: str, *, param: str | None = None, type: str | None = None
) -> dict[str, Any]:
    """The JSON body for an error response with ``status``."""
    info = ErrorInfo(message=message, type=type or error_type_for(status), param=param, code=status)
    return ErrorResponse(error=info).model_dump()
