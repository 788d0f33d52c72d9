"""The error a request gets when the router answers it itself (OpenAI's error shape), and an
engine's own client error passed on unchanged."""

from __future__ import annotations

__all__ = ["RouterError", "UpstreamError"]


class RouterError(Exception):
    """A request the router answers itself, in OpenAI's error shape.

    ``close``: the request body was not read to its end, so the connection is closed after the
    answer (``Connection: close``) instead of reading the rest."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, close: bool = False
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.close = status, message, param, close


class UpstreamError(Exception):
    """An engine's own client error (4xx), passed to the client unchanged."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status, self.body = status, body
