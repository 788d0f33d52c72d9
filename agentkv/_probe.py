"""How new messages become token ids in exact mode (the SDK's side).

The algorithm is :mod:`agentkv.protocol.exact`, shared with the router (which keeps token
identity for clients that send messages): the conversation never re-renders what it already
sent; the next prompt is the previous prompt + the generated ids + the tokens of the *new*
messages, found with small probe conversations so any template works (read that module for how).

This module adapts it to the SDK: :func:`render_plan` takes a :class:`~agentkv._ledger.RenderJob`
(a ``full`` job is one render of the whole history) and raises :class:`~agentkv.RenderError`,
worded for the SDK's user. The probes are rendered by the server's ``/tokenize``
(:class:`~agentkv.RemoteRenderer`, exactly what the server would render) or in-process with a
Hugging Face tokenizer and chat template (:class:`~agentkv.LocalRenderer`, extra
``vllm-agentkv[tokenizers]``), in :mod:`agentkv._rendering`; both drive the sans-IO plan, sync
or async.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from agentkv._exceptions import RenderError
from agentkv._ledger import RenderJob
from agentkv.protocol.exact import (
    SENTINEL,
    ChatCall,
    DecodeCall,
    ExactError,
    Plan,
    Request,
    TextCall,
    append_plan,
    chat_plan,
    run_plan,
    run_plan_async,
)

__all__ = [
    "SENTINEL",
    "AsyncBackend",
    "Backend",
    "ChatCall",
    "DecodeCall",
    "Plan",
    "Request",
    "TextCall",
    "append_ids",
    "render_ids",
    "render_ids_async",
    "render_plan",
    "run_plan",
    "run_plan_async",
]

Tokenize = Callable[[list[dict[str, Any]], bool, bool], list[int]]
"""``(messages, add_generation_prompt, continue_final_message) -> ids``."""

_ADVICE = {
    "no-marker": (
        "The chat template did not render the probe assistant message verbatim; exact mode "
        "cannot find where new messages start. Use mode='messages' for this template."
    ),
    "look-ahead": (
        "The chat template renders the assistant's tool calls differently once their results "
        "follow, so exact mode cannot tell where the results start. Use mode='messages' for "
        "this template."
    ),
    "tool-names": (
        "This chat template renders a tool result with the name of the function "
        "called, and the new tool messages do not say it: add them with their "
        "'name' (conversation.add({'role': 'tool', 'tool_call_id': ..., "
        "'name': ..., 'content': ...}))."
    ),
}
"""The shared core's failures, worded for the SDK's user."""


class Backend(Protocol):
    """What :func:`render_ids` needs to answer a :data:`Plan`'s requests (sync)."""

    def chat(self, call: ChatCall) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class AsyncBackend(Protocol):
    """The async twin of :class:`Backend`."""

    async def chat(self, call: ChatCall) -> list[int]: ...

    async def encode(self, text: str) -> list[int]: ...

    async def decode(self, ids: list[int]) -> str: ...


def render_plan(job: RenderJob) -> Plan:
    """The ids for ``job`` (sans-IO): all of them for a ``full`` job, the ones to append after
    the previous answer for an ``append`` job. Drive it with :func:`render_ids`."""
    if job.kind == "full":
        return (yield from chat_plan(list(job.messages)))
    try:
        return (yield from append_plan(job))
    except ExactError as exc:
        raise RenderError(_ADVICE[exc.kind]) from exc


def _ask(backend: Backend | AsyncBackend, request: Request) -> Any:
    """The backend's answer to ``request`` (an awaitable for an :class:`AsyncBackend`)."""
    if isinstance(request, ChatCall):
        return backend.chat(request)
    if isinstance(request, TextCall):
        return backend.encode(request.text)
    return backend.decode(request.ids)


def render_ids(backend: Backend, job: RenderJob) -> list[int]:
    """Run :func:`render_plan` against a sync ``backend``."""
    return run_plan(render_plan(job), lambda request: _ask(backend, request))


async def render_ids_async(backend: AsyncBackend, job: RenderJob) -> list[int]:
    """Run :func:`render_plan` against an async ``backend``."""
    return await run_plan_async(render_plan(job), lambda request: _ask(backend, request))


class _Tokenizing:
    """A :class:`Backend` from a bare chat ``tokenize`` function (no text requests)."""

    def __init__(self, tokenize: Tokenize) -> None:
        self._tokenize = tokenize

    def chat(self, call: ChatCall) -> list[int]:
        return self._tokenize(
            call.messages, call.add_generation_prompt, call.continue_final_message
        )

    def encode(self, text: str) -> list[int]:
        raise RenderError("This renderer cannot tokenize plain text.")

    def decode(self, ids: list[int]) -> str:
        raise RenderError("This renderer cannot decode ids.")


def append_ids(tokenize: Tokenize, job: RenderJob) -> list[int]:
    """The ids to append after the previous answer for an ``append`` job, from a bare chat
    ``tokenize(messages, add_generation_prompt, continue_final_message)``."""
    if job.kind != "append":
        raise ValueError("append_ids() takes an 'append' job")
    return render_ids(_Tokenizing(tokenize), job)
