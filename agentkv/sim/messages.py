"""The Anthropic Messages API on the simulator, as vLLM 0.33 serves it: the request becomes a
chat request (:mod:`agentkv.protocol.anthropic`), runs on the simulator's own chat path, and its
answer is converted back (``vllm/entrypoints/anthropic/serving.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.responses import JSONResponse, Response, StreamingResponse

from agentkv.protocol import anthropic
from agentkv.protocol.errors import APIError
from agentkv.sim.serving import SimRenderer

__all__ = ["TemplateTraits", "convert", "count_tokens", "to_chat"]

_HOP = ("content-length", "content-type", "transfer-encoding", "connection")


@dataclass
class TemplateTraits:
    """What vLLM's Messages path probes its chat template for, once."""

    renderer: SimRenderer
    _merge: bool | None = None
    _effort: str | None = None

    def _render(self, body: dict[str, Any]) -> str | None:
        try:
            return self.renderer.render_chat(body)
        except APIError:
            return None

    @property
    def merge_inline_system(self) -> bool:
        """vLLM's ``_detect_merge_inline_system``: the template refuses a later system message."""
        if self._merge is None:
            roles = ("system", "user", "system", "user")
            probe = [{"role": role, "content": "t"} for role in roles]
            self._merge = self._render({"messages": probe, "add_generation_prompt": False}) is None
        return self._merge

    @property
    def disabled_effort(self) -> str:
        """vLLM's ``DisabledThinkingEffortResolver._probe``."""
        if self._effort is None:
            none = self._effort_prompt("none")
            same = none is None or any(self._effort_prompt(e) == none for e in anthropic.EFFORTS)
            self._effort = "low" if same else "none"
        return self._effort

    def _effort_prompt(self, effort: str) -> str | None:
        kwargs = {"reasoning_effort": effort, "enable_thinking": effort != "none"}
        messages = [{"role": "user", "content": "Hi"}]
        return self._render({"messages": messages, "chat_template_kwargs": kwargs})


def to_chat(
    body: dict[str, Any], traits: TemplateTraits, *, count_tokens: bool = False
) -> dict[str, Any]:
    """The chat body vLLM runs for a Messages request (400 :class:`APIError`)."""
    try:
        request = anthropic.parse_request(body, count_tokens=count_tokens)
        merge = any(m.role == "system" for m in request.messages) and traits.merge_inline_system
        effort = traits.disabled_effort if request.thinking_disabled else "none"
        return anthropic.to_chat(
            request, body, merge_inline_system=merge, disabled_thinking_effort=effort
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


def count_tokens(r: SimRenderer, chat: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``count_tokens``: the length of the prompt its chat path renders."""
    text = r.render_chat(anthropic.count_tokens_body(chat))
    n = len(r.tokenizer.encode(text, add_special_tokens=False))
    return {"input_tokens": n, "context_management": {"original_input_tokens": n}}


async def convert(response: Response) -> Response:
    """The chat path's answer as the Messages API's: a message, or the stream's events."""
    headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP}
    if not isinstance(response, StreamingResponse):
        message = anthropic.chat_to_message(orjson.loads(bytes(response.body)))
        return JSONResponse(message, headers=headers)
    return StreamingResponse(
        _events(response.body_iterator), media_type="text/event-stream", headers=headers
    )


async def _events(source: AsyncIterable[Any]) -> AsyncIterator[bytes]:
    stream = anthropic.MessageStream()
    buffer = b""
    async for part in source:
        buffer += part if isinstance(part, bytes) else str(part).encode()
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if not event.startswith(b"data: "):
                continue
            data = event[6:]
            out = stream.done() if data == b"[DONE]" else stream.chunk(orjson.loads(data))
            if out:
                yield b"".join(out)
