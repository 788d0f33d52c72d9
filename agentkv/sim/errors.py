"""The simulator's error handling, as vLLM 0.33's server answers: an
:class:`~agentkv.protocol.errors.APIError` in the shape of the API the request came in on
(:mod:`agentkv.protocol.http`: OpenAI's, Anthropic's for ``/v1/messages``), a raw exception as
vLLM's ``create_error_response`` maps it, an unknown path or method as FastAPI's default."""

from __future__ import annotations

import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ExceptionHandler

from agentkv.protocol.errors import APIError
from agentkv.protocol.http import (
    UnexpectedErrors,
    api_error_response,
    error_shape,
    exception_handlers,
)

__all__ = ["error_handling"]

_log = logging.getLogger("agentkv.sim.app")


def error_handling() -> dict[str, Any]:
    """``Starlette(...)``'s ``exception_handlers`` and ``middleware`` for a simulator app."""
    handlers: dict[Any, ExceptionHandler] = {
        **exception_handlers(),
        **dict.fromkeys((ValueError, TypeError, OverflowError), _bad_request),
        HTTPException: _http_error,
    }
    return {
        "exception_handlers": handlers,
        "middleware": [Middleware(UnexpectedErrors, unexpected=_unexpected)],
    }


async def _bad_request(request: Request, exc: Exception) -> Response:
    """``ValueError``, ``TypeError``, ``OverflowError``: 400 with the exception's text."""
    return api_error_response(APIError(400, str(exc)), error_shape(request.url.path))


def _unexpected(request: Request, exc: Exception) -> APIError:
    """Any other exception: 500 naming its type, logged."""
    _log.error("unexpected error in %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"Internal server error: {type(exc).__name__}")


async def _http_error(request: Request, exc: Exception) -> Response:
    """An unknown path (404) or method (405, with ``Allow``) as vLLM answers it: FastAPI's
    default, ``{"detail": "Not Found"}`` (vLLM's error-shape handler is registered for FastAPI's
    ``HTTPException``, a subclass of the Starlette one that routing raises)."""
    assert isinstance(exc, HTTPException)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
