"""What both servers (the router and the simulator) put on and read off HTTP, written once:
SSE framing, JSON bodies (orjson), errors in OpenAI's shape (:mod:`agentkv.protocol.errors`).

Needs the ``serve`` extra (Starlette, orjson), like :mod:`agentkv.protocol.kv_events` needs
msgspec; ``agentkv.protocol`` itself does not import it.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import JSONResponse, Response

from agentkv.protocol.errors import error_body

__all__ = ["ORJSONResponse", "error_response", "json_object", "sse"]


def sse(data: dict[str, Any] | str) -> bytes:
    """One SSE event in vLLM's framing (``data: {...}`` and a blank line; ``sse("[DONE]")``)."""
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    return b"data: " + payload + b"\n\n"


class ORJSONResponse(Response):
    """A JSON response encoded by orjson (Starlette's ``JSONResponse`` uses stdlib json)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(
    status: int, message: str, param: str | None = None, *, close: bool = False
) -> JSONResponse:
    """An error in OpenAI's shape; ``close`` asks the client to close the connection."""
    headers = {"connection": "close"} if close else None
    return JSONResponse(
        error_body(status, message, param=param), status_code=status, headers=headers
    )


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object; ``ValueError`` with the client's message."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"Invalid JSON body: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError("The request body must be a JSON object.")
    return data
