"""The simulator's stand-in for NIXL: reads, notifications and handshakes over HTTP.

A reader (P on the next turn, or D reading P's prompt) calls the owner's internal endpoints at
the handle's ``remote_host``/``remote_port``:

* ``GET  /_sim/nixl/handshake`` → ``{"engine_id", "now"}`` (the owner's private clock, from
  which the reader derives the clock offset it applies to ``remote_blocks_expiry_time``);
* ``POST /_sim/nixl/read`` ``{"request_id", "block_ids"}`` → ``{"blocks": [content | null]}``;
  a completed read notifies the owner, which frees the blocks (single use);
* ``POST /_sim/nixl/notify`` ``{"request_id"}``: nothing to read, free the blocks now.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

__all__ = [
    "HANDSHAKE_PATH",
    "NOTIFY_PATH",
    "READ_PATH",
    "TransferClient",
    "TransferError",
]

HANDSHAKE_PATH = "/_sim/nixl/handshake"
READ_PATH = "/_sim/nixl/read"
NOTIFY_PATH = "/_sim/nixl/notify"


class TransferError(Exception):
    """A read, notification or handshake did not complete."""


class TransferClient:
    """Talks to other simulator instances (``client`` is injectable for in-process tests)."""

    def __init__(self, client: httpx.AsyncClient | None = None, *, timeout_s: float = 30.0) -> None:
        self._client = client or httpx.AsyncClient(timeout=timeout_s, trust_env=False)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _call(self, method: str, url: str, body: dict[str, Any] | None) -> dict[str, Any]:
        try:
            response = await self._client.request(method, url, json=body)
        except httpx.HTTPError as exc:
            raise TransferError(f"{method} {url}: {exc!r}") from exc
        if response.status_code != 200:
            raise TransferError(f"{method} {url}: HTTP {response.status_code} {response.text}")
        data = response.json()
        if not isinstance(data, dict):
            raise TransferError(f"{method} {url}: malformed answer")
        return data

    @staticmethod
    def _url(host: str, port: int, path: str) -> str:
        return f"http://{host}:{port}{path}"

    async def handshake(self, host: str, port: int) -> dict[str, Any]:
        return await self._call("GET", self._url(host, port, HANDSHAKE_PATH), None)

    async def read(
        self, host: str, port: int, request_id: str, block_ids: Sequence[int]
    ) -> list[dict[str, Any] | None]:
        body = {"request_id": request_id, "block_ids": list(block_ids)}
        data = await self._call("POST", self._url(host, port, READ_PATH), body)
        blocks = data.get("blocks")
        if not isinstance(blocks, list) or len(blocks) != len(block_ids):
            raise TransferError("malformed read answer")
        return blocks

    async def notify(self, host: str, port: int, request_id: str) -> None:
        await self._call("POST", self._url(host, port, NOTIFY_PATH), {"request_id": request_id})
