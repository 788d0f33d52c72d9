"""The Anthropic Messages API at the router's edge (``POST /v1/messages``,
``POST /v1/messages/count_tokens``): the codec of :mod:`agentkv.protocol.anthropic` around the
one turn core.

A request becomes the Chat Completions body vLLM 0.33 would run for it, and goes through
:meth:`~agentkv.router.pd.Router.turn` like any chat request; :class:`MessagesEncoder` turns the
answer (JSON, SSE stream or error) into Anthropic's. Two of vLLM's choices depend on the chat
template, which only the engines know: :class:`TemplateTraits` asks a P's ``/tokenize`` once, as
vLLM probes its template at start-up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from agentkv.protocol import anthropic
from agentkv.protocol.errors import APIError, UpstreamError
from agentkv.protocol.http import json_object
from agentkv.router.edge import adapt
from agentkv.router.pd import Router
from agentkv.router.request import ClientRequest

__all__ = [
    "MessagesEncoder",
    "TemplateTraits",
    "chat_body",
    "messages_api",
    "with_api_key",
]

log = logging.getLogger("agentkv.router")
Handler = Callable[[Request], Awaitable[Response]]


class MessagesEncoder:
    """One turn's answer as Anthropic's (an :class:`~agentkv.router.edge.Encoder`)."""

    def __init__(self) -> None:
        self.stream = anthropic.MessageStream()

    def response(self, chat: dict[str, Any]) -> dict[str, Any]:
        return anthropic.chat_to_message(chat)

    def chunk(self, chat: dict[str, Any]) -> Iterable[bytes]:
        return self.stream.chunk(chat)

    def done(self) -> Iterable[bytes]:
        return self.stream.done()

    def stream_error(self, error: dict[str, Any]) -> Iterable[bytes]:
        code = error.get("code")
        status = code if isinstance(code, int) and 400 <= code <= 599 else 500
        return self.stream.error(status, str(error.get("message") or "Upstream error."))


def with_api_key(headers: Mapping[str, str]) -> dict[str, str]:
    """The request's headers (lower-case names), with Anthropic's ``x-api-key`` as the
    ``Authorization: Bearer`` key when the client sent no ``Authorization``: how Anthropic
    clients (Claude Code, the SDKs) send theirs."""
    out = {k.lower(): v for k, v in headers.items()}
    key = out.get("x-api-key")
    if key and not out.get("authorization"):
        out["authorization"] = f"Bearer {key}"
    return out


def _probe_request(body: dict[str, Any]) -> ClientRequest:
    return ClientRequest(
        chat=True,
        body=body,
        tenant="",
        cache_salt=None,
        conversation_id=None,
        epoch=0,
        prompt_ids=None,
    )


@dataclass
class TemplateTraits:
    """What vLLM's Messages path learns from its chat template (``AnthropicServingMessages``),
    learnt here from P's ``/tokenize`` and kept for the router's life."""

    merge_inline_system: bool | None = None
    """Whether the template refuses a ``system`` message after the first (Qwen's templates):
    then inline system messages join the leading one."""
    disabled_effort: str | None = None
    """The ``reasoning_effort`` of ``thinking: disabled``: ``none``, or ``low`` when the
    template renders ``none`` like an effort (it cannot turn thinking off)."""
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def merge(self, router: Router) -> bool:
        """vLLM's ``_detect_merge_inline_system``: render [system, user, system, user]."""
        if self.merge_inline_system is not None:
            return self.merge_inline_system
        async with self._lock:
            if self.merge_inline_system is None:
                messages = [
                    {"role": role, "content": "t"} for role in ("system", "user", "system", "user")
                ]
                probe = {"messages": messages, "add_generation_prompt": False}
                try:
                    await router.prompt_ids(_probe_request(probe))
                    self.merge_inline_system = False
                except UpstreamError:
                    self.merge_inline_system = True
                except APIError:
                    return True  # no P answered: the turn fails anyway; ask again next time
                log.info("messages: inline system messages merged: %s", self.merge_inline_system)
            return self.merge_inline_system

    async def effort(self, router: Router) -> str:
        """vLLM's ``DisabledThinkingEffortResolver._probe``: ``low`` when the template fails on
        ``none`` or renders it like one of the efforts, else ``none``."""
        if self.disabled_effort is not None:
            return self.disabled_effort
        async with self._lock:
            if self.disabled_effort is None:
                none = await self._render(router, "none")
                if none is None:
                    self.disabled_effort = "low"
                else:
                    same = [e for e in anthropic.EFFORTS if await self._render(router, e) == none]
                    self.disabled_effort = "low" if same else "none"
                log.info("messages: thinking disabled as reasoning_effort=%s", self.disabled_effort)
            return self.disabled_effort

    @staticmethod
    async def _render(router: Router, effort: str) -> list[int] | None:
        kwargs = {"reasoning_effort": effort, "enable_thinking": effort != "none"}
        probe = {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": kwargs}
        try:
            return (await router.prompt_ids(_probe_request(probe))).tolist()
        except UpstreamError:
            return None


def json_body(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object (400 :class:`APIError`)."""
    try:
        return json_object(raw)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


async def chat_body(
    body: dict[str, Any], router: Router, traits: TemplateTraits, *, count_tokens: bool = False
) -> dict[str, Any]:
    """The Chat Completions body for an Anthropic request body (400 :class:`APIError`)."""
    try:
        request = anthropic.parse_request(body, count_tokens=count_tokens)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    has_inline_system = any(m.role == "system" for m in request.messages)
    merge = await traits.merge(router) if has_inline_system else False
    effort = await traits.effort(router) if request.thinking_disabled else "none"
    try:
        return anthropic.to_chat(
            request, body, merge_inline_system=merge, disabled_thinking_effort=effort
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


def messages_api(handler: Handler) -> Handler:
    """``handler``'s Chat Completions answer (or an error it returned) as the Messages API's
    (an error it raises is rendered in Anthropic's shape by the app's exception handlers)."""

    async def wrapped(request: Request) -> Response:
        response = await handler(request)
        try:
            return await adapt(response, MessagesEncoder())
        except ValueError as exc:  # an answer with no Anthropic form (a tool call's bad JSON)
            log.warning("messages: answer not converted: %s", exc)
            raise APIError(500, f"The model's answer could not be converted: {exc}") from exc

    return wrapped
