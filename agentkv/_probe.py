"""How new messages become token ids in exact mode.

The conversation never re-renders what it already sent: the next prompt is the previous
prompt + the generated ids + the tokens of the *new* messages. Those tokens are what the chat
template renders after the end of an assistant turn, up to and including the next generation
prompt. They are found with small probe conversations, so any template works. A probe's
assistant message carries a *marker*: the word :data:`SENTINEL`, whose last tokens are taken
from the probe rendered with ``continue_final_message``. What the template renders after the
marker is, in order:

* the rest of the assistant message the model generated itself: the end of its last tool call
  when the new messages are tool results (the marker then sits in that call's arguments, so
  templates that render only the calls of a tool-call message work too; a template that does
  not render the arguments gets the marker in the content instead);
* the template's end of an assistant turn (``close``: ``<|im_end|>\n``, ``<|eot_id|>``, ...),
  found from ``[user, assistant SENTINEL]`` rendered as a finished history;
* the new messages and the generation prompt.

The ids to append are the last two, minus the part of ``close`` the model emitted itself (its
stop token, or the whole end-of-turn when its output ends with it). A model stopped by
``max_tokens`` or by a stop string emitted none of it, so all of it is appended. Where no token
boundary separates the model's part from the template's (a vocabulary in which the template's
tags are plain text, so ``</tool_call><|im_end|>`` tokenizes across the seam), the split is
made in the decoded text and the new part is tokenized on its own, as it will be appended.

The marker is searched for rather than a common prefix taken, because many templates render
earlier turns differently once a new message follows (reasoning pruning, look-ahead, blocks
that move to the last user message). A template that renders a tool result with the name of the
function called (gpt-oss) needs the real names: they come from the tool message's ``name`` or
from the job's ``previous`` assistant message when it carries one; without them such a template
is a :class:`~agentkv.RenderError` rather than a prompt that names the wrong tool.

The probes are rendered by the server's ``/tokenize`` (:class:`~agentkv.RemoteRenderer`, exactly
what the server would render) or in-process with a Hugging Face tokenizer and chat template
(:class:`~agentkv.LocalRenderer`, extra ``vllm-agentkv[tokenizers]``), in
:mod:`agentkv._rendering`. The algorithm itself is sans-IO
(:func:`render_plan`, a generator of tokenize calls) so both drive it, sync or async.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentkv._exceptions import RenderError
from agentkv._ledger import RenderJob

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

SENTINEL = "AGENTKVSENTINEL"
"""The probe's marker word (plain capitals: a stable token boundary after it in byte-level
BPE vocabularies, whatever punctuation a template puts around it)."""
_MARKER_TOKENS = 3
_ARGUMENT = "agentkv_probe"
_PLACEHOLDER_NAMES = ("f", "g")

Tokenize = Callable[[list[dict[str, Any]], bool, bool], list[int]]
"""``(messages, add_generation_prompt, continue_final_message) -> ids``."""


@dataclass(frozen=True)
class ChatCall:
    """Render ``messages`` with the chat template and tokenize the text (→ ids)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    continue_final_message: bool = False


@dataclass(frozen=True)
class TextCall:
    """Tokenize plain ``text`` on its own, no special tokens added (→ ids)."""

    text: str


@dataclass(frozen=True)
class DecodeCall:
    """Decode ``ids`` to text, special tokens included (→ str)."""

    ids: list[int]


Request = ChatCall | TextCall | DecodeCall
Plan = Generator[Request, Any, list[int]]
"""A sans-IO rendering: yields requests, is sent their answers, returns the ids to use."""


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


# -- the probe algorithm (sans-IO) ---------------------------------------------------------------
class _NoMarker(RenderError):
    """The probe's marker is not in a rendering (internal: some probes have a fallback)."""


def _after(seq: Sequence[int], marker: Sequence[int]) -> list[int]:
    """``seq`` after the first occurrence of ``marker`` (the probe's assistant message comes
    before anything a new message could render)."""
    m = len(marker)
    want = list(marker)
    for i in range(len(seq) - m + 1):
        if list(seq[i : i + m]) == want:
            return list(seq[i + m :])
    raise _NoMarker(
        "The chat template did not render the probe assistant message verbatim; exact mode "
        "cannot find where new messages start. Use mode='messages' for this template."
    )


def _answered(job: RenderJob) -> list[tuple[str, str | None]]:
    """``(tool_call_id, function name or None)`` of the calls the new messages answer, in the
    order the assistant made them when the job knows that message."""
    previous = getattr(job, "previous", None)  # the assistant message, when the job has it
    made: list[tuple[str, str | None]] = []
    if isinstance(previous, Mapping):
        for call in previous.get("tool_calls") or []:
            if not isinstance(call, Mapping):
                continue
            fn = call.get("function")
            name = fn.get("name") if isinstance(fn, Mapping) else None
            made.append((str(call.get("id")), name if isinstance(name, str) else None))
    results = [m for m in job.messages if m.get("role") == "tool"]
    if not results:
        return []
    named = {
        str(m.get("tool_call_id")): m["name"] for m in results if isinstance(m.get("name"), str)
    }
    ids = [str(m.get("tool_call_id")) for m in results]
    if made and set(ids) <= {tid for tid, _ in made}:
        return [(tid, named.get(tid, name)) for tid, name in made]
    known = dict(made)
    return [(tid, named.get(tid, known.get(tid))) for tid in ids]


def _plain() -> list[dict[str, Any]]:
    return [{"role": "user", "content": "x"}, {"role": "assistant", "content": SENTINEL}]


def _with_calls(
    calls: Sequence[tuple[str, str | None]], placeholder: str, in_arguments: bool
) -> list[dict[str, Any]]:
    """The probe for tool results: the marker in the last call's arguments, or (for templates
    that do not render arguments) in the content."""
    tool_calls = []
    for i, (tid, name) in enumerate(calls):
        marked = in_arguments and i == len(calls) - 1
        arguments = json.dumps({_ARGUMENT: SENTINEL} if marked else {})
        tool_calls.append(
            {
                "id": tid,
                "type": "function",
                "function": {"name": name or placeholder, "arguments": arguments},
            }
        )
    content = "" if in_arguments else SENTINEL
    return [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": content, "tool_calls": tool_calls},
    ]


def _without_emitted(
    rest: list[int], close: list[int], output: Sequence[int]
) -> Generator[Request, Any, list[int]]:
    """``rest`` without the part of the end of turn ``close`` that the model's ``output``
    already ends with: its stop token (the usual case: a token-level overlap), or the whole
    end of turn written as text whose tokens merged with the answer's last characters (a
    vocabulary in which the template's tags are plain text). A model stopped by
    ``max_tokens`` or a stop string emitted none of it."""
    # A template with no end-of-turn text (GLM) has the model stop on the next role's tag.
    for j in range(min(max(len(close), 1), len(output), len(rest)), 0, -1):
        if list(output[-j:]) == rest[:j]:
            return rest[j:]
    if not close or not output:
        return rest
    close_text = yield from _decode(close)
    output_text = yield from _decode(list(output[-(len(close) + 2) :]))
    if not close_text.strip() or not output_text.endswith(close_text):
        return rest
    if rest[: len(close)] == close:
        return rest[len(close) :]
    rest_text = yield from _decode(rest)
    if not rest_text.startswith(close_text):
        return rest  # the turn ends differently once more follows (gpt-oss <|return|>)
    return (yield from _encode(rest_text[len(close_text) :]))


def _chat(
    messages: list[dict[str, Any]], gen: bool, cont: bool = False
) -> Generator[Request, Any, list[int]]:
    ids = yield ChatCall(messages, gen, cont)
    return list(ids)


def _encode(text: str) -> Generator[Request, Any, list[int]]:
    ids = yield TextCall(text)
    return list(ids)


def _decode(ids: list[int]) -> Generator[Request, Any, str]:
    text = yield DecodeCall(ids)
    return str(text)


def _look_ahead() -> RenderError:
    return RenderError(
        "The chat template renders the assistant's tool calls differently once their results "
        "follow, so exact mode cannot tell where the results start. Use mode='messages' for "
        "this template."
    )


def render_plan(job: RenderJob) -> Plan:
    """The ids for ``job`` (sans-IO): all of them for a ``full`` job, the ones to append after
    the previous answer for an ``append`` job. Drive it with :func:`render_ids`."""
    if job.kind == "full":
        return (yield from _chat(list(job.messages), True))
    plain = _plain()
    marker = (yield from _chat(plain, False, True))[-_MARKER_TOKENS:]
    close = _after((yield from _chat(plain, False)), marker)
    new = list(job.messages)
    calls = _answered(job)
    if not calls:
        rest = _after((yield from _chat([*plain, *new], True)), marker)
        return (yield from _without_emitted(rest, close, job.last_output_ids))
    named = all(name for _, name in calls)
    for in_arguments in (True, False):
        base = _with_calls(calls, _PLACEHOLDER_NAMES[0], in_arguments)
        try:
            ended = _after((yield from _chat(base, False)), marker)
            rest = _after((yield from _chat([*base, *new], True)), marker)
        except _NoMarker:
            if in_arguments:
                continue
            raise
        if not named:
            other = _with_calls(calls, _PLACEHOLDER_NAMES[1], in_arguments)
            if _after((yield from _chat([*other, *new], True)), marker) != rest:
                raise RenderError(
                    "This chat template renders a tool result with the name of the function "
                    "called, and the new tool messages do not say it: add them with their "
                    "'name' (conversation.add({'role': 'tool', 'tool_call_id': ..., "
                    "'name': ..., 'content': ...}))."
                )
        # ``ended`` = the rest of the last call (the model generated it) + the end of turn.
        if not close or ended[-len(close) :] == close:
            tail = ended[: len(ended) - len(close)]
            if rest[: len(tail)] == tail:
                return (yield from _without_emitted(rest[len(tail) :], close, job.last_output_ids))
        # No token boundary where the call ends: the call ends the turn by itself (gpt-oss's
        # ``<|call|>``), or its last tokens merged with what follows (a vocabulary in which
        # the template's tags are plain text). Split the text there instead, and tokenize the
        # new part on its own, as it will be appended.
        ended_text = yield from _decode(ended)
        close_text = yield from _decode(close)
        rest_text = yield from _decode(rest)
        end_text = close_text if close_text and ended_text.endswith(close_text) else ""
        tail_text = ended_text[: len(ended_text) - len(end_text)]
        if not rest_text.startswith(tail_text):
            raise _look_ahead()
        appended = yield from _encode(rest_text[len(tail_text) :])
        end_ids = (yield from _encode(end_text)) if end_text else []
        return (yield from _without_emitted(appended, end_ids, job.last_output_ids))
    raise AssertionError("unreachable")  # pragma: no cover


def run_plan(plan: Plan, answer: Callable[[Request], Any]) -> list[int]:
    """Drive a :data:`Plan`: every request it yields is sent ``answer(request)``."""
    reply: Any = None
    try:
        while True:
            reply = answer(plan.send(reply))
    except StopIteration as done:
        result: list[int] = done.value
        return result


async def run_plan_async(plan: Plan, answer: Callable[[Request], Awaitable[Any]]) -> list[int]:
    """Drive a :data:`Plan` with an async ``answer``."""
    reply: Any = None
    try:
        while True:
            reply = await answer(plan.send(reply))
    except StopIteration as done:
        result: list[int] = done.value
        return result


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
