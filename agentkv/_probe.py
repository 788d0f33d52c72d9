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
or async. Two of an append's probes (the marker and the end of turn) depend only on the template,
the tools and the template kwargs, and decoding the end of turn only on the tokenizer: a
renderer keeps those answers in a :class:`FixedProbes`, so a turn asks only for what depends on
its new messages and the last answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson

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
    is_fixed,
    run_plan,
    run_plan_async,
)

__all__ = [
    "SENTINEL",
    "AsyncBackend",
    "Backend",
    "ChatCall",
    "DecodeCall",
    "FixedProbes",
    "Plan",
    "Request",
    "TextCall",
    "ask_backend",
    "render_ids",
    "render_plan",
    "run_plan",
    "run_plan_async",
]

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


class FixedProbes:
    """One renderer's answers to the requests that do not depend on the job: the probes
    :func:`~agentkv.protocol.exact.is_fixed` names, per rendering context (the job's tools
    and template kwargs; the renderer fixes the template and the model), and the decoding of
    a few ids (the end of turn, decoded on every turn whose answer did not end with it).
    Thread-safe (single dict operations); at :attr:`SIZE` answers it starts over."""

    SIZE = 64
    DECODED = 32
    """The longest id list whose text is kept."""

    def __init__(self) -> None:
        self._kept: dict[tuple[Any, ...], Any] = {}

    def _key(self, job: RenderJob, request: Request) -> tuple[Any, ...] | None:
        if isinstance(request, DecodeCall):
            return ("decode", *request.ids) if len(request.ids) <= self.DECODED else None
        if not isinstance(request, ChatCall) or not is_fixed(request):
            return None
        try:
            context = orjson.dumps(
                [job.tools, job.chat_template_kwargs], option=orjson.OPT_SORT_KEYS
            )
        except TypeError:  # not JSON: not kept
            return None
        return "chat", context, request.continue_final_message

    def _kept_answer(self, key: tuple[Any, ...] | None) -> Any:
        kept = None if key is None else self._kept.get(key)
        return list(kept) if isinstance(kept, list) else kept

    def _keep(self, key: tuple[Any, ...] | None, answer: Any) -> None:
        if key is None:
            return
        if len(self._kept) >= self.SIZE:
            self._kept.clear()
        self._kept[key] = list(answer) if isinstance(answer, list) else answer

    def run(self, job: RenderJob, answer: Callable[[Request], Any]) -> list[int]:
        """:func:`render_plan` for ``job``, driven by ``answer`` where no kept answer does."""

        def ask(request: Request) -> Any:
            key = self._key(job, request)
            kept = self._kept_answer(key)
            if kept is not None:
                return kept
            reply = answer(request)
            self._keep(key, reply)
            return reply

        return run_plan(render_plan(job), ask)

    async def run_async(
        self, job: RenderJob, answer: Callable[[Request], Awaitable[Any]]
    ) -> list[int]:
        """The async twin of :meth:`run`."""

        async def ask(request: Request) -> Any:
            key = self._key(job, request)
            kept = self._kept_answer(key)
            if kept is not None:
                return kept
            reply = await answer(request)
            self._keep(key, reply)
            return reply

        return await run_plan_async(render_plan(job), ask)


def ask_backend(backend: Backend | AsyncBackend, request: Request) -> Any:
    """The backend's answer to ``request`` (an awaitable for an :class:`AsyncBackend`)."""
    if isinstance(request, ChatCall):
        return backend.chat(request)
    if isinstance(request, TextCall):
        return backend.encode(request.text)
    return backend.decode(request.ids)


def render_ids(backend: Backend, job: RenderJob) -> list[int]:
    """Run :func:`render_plan` against a sync ``backend``."""
    return run_plan(render_plan(job), lambda request: ask_backend(backend, request))
