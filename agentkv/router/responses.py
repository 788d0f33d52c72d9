"""``POST /v1/responses`` (and ``GET`` / ``DELETE /v1/responses/{id}``): the OpenAI Responses
API at the router's edge.

The request becomes one Chat Completions turn (:func:`agentkv.protocol.responses.responses_to_chat`,
vLLM 0.33's mapping) through the one turn core, and its answer, stream or error goes back in the
Responses format (:class:`~agentkv.protocol.responses.ResponsesEncoder` through
:func:`agentkv.router.edge.adapt`), receipt headers unchanged.

**Conversation id** (where the turn's KV is kept): the router's usual precedence
(``X-Conversation-Id``, ``conversation_id``, ``X-Session-ID``, ``session_id``, then
``prompt_cache_key``, which Codex sets to its session id). Without any, the turn continues a
stored response's chain: the one ``previous_response_id`` names, else the one the last output item
sent back in ``input`` came from (its id names its response: how the OpenAI Agents SDK and
LangChain continue, sending the whole input each turn), and uses the chain's id, its first
response's id; a stored response that continues nothing starts a chain under its own id. So every
later turn of a chain finds the KV its predecessor left. A ``store: false`` response with no id
and nothing to continue is anonymous, as a chat turn without one.

**Stored responses** (:mod:`agentkv.router.responses_store`): unless ``store`` is false, the
response is kept before its last event (or its body) reaches the client, so a client chaining at
once never misses it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from agentkv.protocol.errors import APIError
from agentkv.protocol.http import ORJSONResponse, json_object
from agentkv.protocol.responses import (
    history_items,
    input_items,
    last_response_of,
    new_response_id,
    not_found_error,
    responses_to_chat,
)
from agentkv.protocol.responses_stream import ResponsesEncoder
from agentkv.router.config import RouterConfig
from agentkv.router.edge import adapt
from agentkv.router.logs import safe
from agentkv.router.pd import Router
from agentkv.router.request import parse_body, read_body
from agentkv.router.responses_store import ResponseStore, StoredResponse
from agentkv.router.tenancy import Tenancy
from agentkv.router.tracing import extracted

__all__ = ["ResponsesAPI"]

log = logging.getLogger("agentkv.router")


class ResponsesAPI:
    """The Responses routes of one router."""

    def __init__(
        self, config: RouterConfig, router: Router, store: ResponseStore, tenancy: Tenancy
    ) -> None:
        self.config, self.router, self.store, self.tenancy = config, router, store, tenancy

    async def create(self, request: Request) -> Response:
        config = self.config
        caller = self.tenancy.tenant_for(request.headers.get("authorization"))
        tenant = caller.tenant
        raw = await read_body(request, config.http.max_body_bytes)
        try:
            body = json_object(raw)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        previous: StoredResponse | None = None
        previous_id = body.get("previous_response_id")
        if isinstance(previous_id, str) and previous_id:
            previous = await self._load(tenant, previous_id)
            if previous is None:
                raise not_found_error(previous_id)
        chat = responses_to_chat(body, previous.items if previous else None)
        headers = {k.lower(): v for k, v in request.headers.items()}
        req = parse_body(chat, headers, chat=True, caller=caller, session_body=body)
        response_id = new_response_id()
        keep = body.get("store") is not False
        if req.conversation_id is None:
            req.conversation_id = await self._chain(tenant, previous, body)
        if req.conversation_id is None and keep:
            req.conversation_id = response_id
        if req.conversation_source == "none" and req.conversation_id is not None:
            req.conversation_source = "response-chain"
        encoder = ResponsesEncoder(body, response_id=response_id)
        with extracted(headers):
            answer = await adapt(await self.router.turn(req), encoder)
        if not keep or answer.status_code != 200:
            return answer

        async def put(final: dict[str, Any]) -> None:
            items = history_items(previous.items if previous else None, body, final)
            stored = StoredResponse(items, req.conversation_id, final)
            try:
                await self.store.put(tenant, response_id, stored)
            except Exception as exc:  # the answer stands; only its successor misses it
                log.warning("could not store response %s: %s", response_id, safe(repr(exc)))

        if isinstance(answer, StreamingResponse):
            answer.body_iterator = _storing(answer.body_iterator, encoder, put)
        elif encoder.final is not None:
            await put(encoder.final)
        return answer

    async def retrieve(self, request: Request) -> Response:
        tenant = self.tenancy.tenant_for(request.headers.get("authorization")).tenant
        response_id = request.path_params["response_id"]
        stored = await self._load(tenant, response_id)
        if stored is None:
            raise not_found_error(response_id, previous=False)
        return ORJSONResponse(stored.response)

    async def delete(self, request: Request) -> Response:
        tenant = self.tenancy.tenant_for(request.headers.get("authorization")).tenant
        response_id = request.path_params["response_id"]
        try:
            deleted = await self.store.delete(tenant, response_id)
        except Exception as exc:
            raise APIError(503, "The response store is unavailable.") from exc
        if not deleted:
            raise not_found_error(response_id, previous=False)
        return ORJSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def _chain(
        self, tenant: str, previous: StoredResponse | None, body: dict[str, Any]
    ) -> str | None:
        """The conversation id of the chain this request continues (None: none)."""
        if previous is not None:
            return previous.conversation_id
        origin = last_response_of(input_items(body))
        if origin is None:
            return None
        try:
            found = await self.store.get(tenant, origin)
        except Exception as exc:  # costs reuse, never the answer
            log.warning("response store failed: %s", safe(repr(exc)))
            return None
        return found.conversation_id if found is not None else None

    async def _load(self, tenant: str, response_id: str) -> StoredResponse | None:
        try:
            return await self.store.get(tenant, response_id)
        except Exception as exc:
            log.warning("response store failed: %s", safe(repr(exc)))
            raise APIError(503, "The response store is unavailable.") from exc


async def _storing(
    source: AsyncIterable[Any],
    encoder: ResponsesEncoder,
    put: Callable[[dict[str, Any]], Awaitable[None]],
) -> AsyncIterator[Any]:
    """The stream, with the response stored as soon as the encoder has finished it: before its
    closing events are passed on."""
    stored = False
    async for part in source:
        if not stored and encoder.final is not None:
            stored = True
            await put(encoder.final)
        yield part
