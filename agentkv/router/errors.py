"""The router's error handling: every error a route raises (an
:class:`~agentkv.protocol.errors.APIError`, or anything unexpected: 500, logged) is answered in
the shape of the API the request came in on (:mod:`agentkv.protocol.http`) and counted by
status; a client that hung up during its upload gets nothing (499, counted as an abort);
Starlette's own 404 and 405 in OpenAI's shape and wording."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import Counter
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ExceptionHandler

from agentkv.protocol.errors import APIError
from agentkv.protocol.http import UnexpectedErrors, api_error_response, exception_handlers
from agentkv.router.logs import safe
from agentkv.router.metrics import RouterMetrics

__all__ = ["router_error_handling"]

log = logging.getLogger("agentkv.router")


def router_error_handling(metrics: RouterMetrics, aborts: Counter) -> dict[str, Any]:
    """``Starlette(...)``'s ``exception_handlers`` and ``middleware`` for one router app
    (``metrics``: its failures by status; ``aborts``: the client aborts by stage)."""

    def failed(status: int) -> None:
        metrics.failed.labels(str(status)).inc()

    def unexpected(request: Request, exc: Exception) -> APIError:
        log.error("router failure", exc_info=exc)
        return APIError(500, "Internal router error.")

    async def disconnected(request: Request, exc: Exception) -> Response:
        # the client hung up before its request was in: nothing to answer, nothing failed
        aborts.labels("upload").inc()
        log.info("client hung up during upload path=%s", safe(request.url.path))
        return Response(status_code=499)

    handlers: dict[Any, ExceptionHandler] = {
        **exception_handlers(failed),
        ClientDisconnect: disconnected,
        HTTPException: _http_error,
    }
    return {
        "exception_handlers": handlers,
        "middleware": [Middleware(UnexpectedErrors, unexpected=unexpected, on_error=failed)],
    }


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own answers (an unknown path: 404, a method a path does not take: 405 with
    ``Allow``) in OpenAI's error shape, as OpenAI words them."""
    assert isinstance(exc, HTTPException)
    path = request.url.path if len(request.url.path) <= 200 else request.url.path[:200] + "..."
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {path})"
    elif exc.status_code == 405:
        message = f"Method {request.method} not allowed for {path}."
    else:
        message = exc.detail
    return api_error_response(APIError(exc.status_code, message, headers=exc.headers))
