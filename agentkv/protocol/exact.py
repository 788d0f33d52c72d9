"""Exact token ids for new messages: the one algorithm the SDK and the router share.

A conversation never re-renders what it already sent: the next prompt is the previous
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
* the template's end of an assistant turn (``close``: ``<|im_end|>\\n``, ``<|eot_id|>``, ...),
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
is an :class:`ExactError` rather than a prompt that names the wrong tool.

The algorithm is sans-IO: :func:`append_plan` is a generator of :data:`Request` (render a chat,
tokenize a text, decode ids) that is sent the answers and returns the ids; :func:`run_plan` and
:func:`run_plan_async` drive it. The SDK answers with the server's ``/tokenize`` or an
in-process template (``agentkv._probe``, ``agentkv._rendering``); the router with its prefill
instance's ``/tokenize`` (``agentkv.router.identity``). Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

__all__ = [
    "SENTINEL",
    "AppendJob",
    "ChatCall",
    "DecodeCall",
    "ExactError",
    "Job",
    "Plan",
    "Request",
    "TextCall",
    "append_plan",
    "chat_plan",
    "is_fixed",
    "run_plan",
    "run_plan_async",
]

SENTINEL = "AGENTKVSENTINEL"
"""The probe's marker word (plain capitals: a stable token boundary after it in byte-level
BPE vocabularies, whatever punctuation a template puts around it)."""
_MARKER_TOKENS = 3
_ARGUMENT = "agentkv_probe"
_PLACEHOLDER_NAMES = ("f", "g")

Failure = Literal["no-marker", "look-ahead", "tool-names"]


class ExactError(Exception):
    """The template does not let new messages be rendered on their own (``kind`` says why:
    ``no-marker``, ``look-ahead``, ``tool-names``)."""

    def __init__(self, message: str, kind: Failure) -> None:
        super().__init__(message)
        self.kind: Failure = kind


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


class Job(Protocol):
    """What :func:`append_plan` reads of a job."""

    @property
    def messages(self) -> Sequence[Mapping[str, Any]]:
        """The messages added since the previous answer."""
        ...

    @property
    def last_output_ids(self) -> Sequence[int]:
        """The previous answer's ids (the end of turn it emitted is not appended twice)."""
        ...

    @property
    def previous(self) -> Mapping[str, Any] | None:
        """The previous assistant message (its tool calls name the functions that new tool
        results answer; some templates render those names), or None."""
        ...


@dataclass(frozen=True)
class AppendJob:
    """The minimal :class:`Job`."""

    messages: list[dict[str, Any]]
    last_output_ids: list[int]
    previous: dict[str, Any] | None = None


# -- the probe algorithm (sans-IO) ---------------------------------------------------------------
def _no_marker() -> ExactError:
    return ExactError(
        "The chat template did not render the probe assistant message verbatim; the new "
        "messages' ids cannot be found on their own.",
        "no-marker",
    )


def _after(seq: Sequence[int], marker: Sequence[int]) -> list[int]:
    """``seq`` after the first occurrence of ``marker`` (the probe's assistant message comes
    before anything a new message could render)."""
    m = len(marker)
    want = list(marker)
    for i in range(len(seq) - m + 1):
        if list(seq[i : i + m]) == want:
            return list(seq[i + m :])
    raise _no_marker()


def _answered(job: Job) -> list[tuple[str, str | None]]:
    """``(tool_call_id, function name or None)`` of the calls the new messages answer, in the
    order the assistant made them when the job knows that message."""
    previous = job.previous
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


def is_fixed(call: ChatCall) -> bool:
    """Whether ``call`` is one of the probes that do not depend on the job (the marker and
    the end of turn): its answer depends only on the template, tools and kwargs, so a caller
    may cache it per rendering context."""
    return call.messages == _plain() and not call.add_generation_prompt


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


def _look_ahead() -> ExactError:
    return ExactError(
        "The chat template renders the assistant's tool calls differently once their results "
        "follow, so where the results start cannot be told.",
        "look-ahead",
    )


def _unnamed() -> ExactError:
    return ExactError(
        "This chat template renders a tool result with the name of the function called, and "
        "the new tool messages do not say it.",
        "tool-names",
    )


def chat_plan(messages: list[dict[str, Any]]) -> Plan:
    """All the ids of ``messages`` with the generation prompt (one render)."""
    return (yield from _chat(messages, True))


def append_plan(job: Job) -> Plan:
    """The ids to append after the previous answer for ``job`` (sans-IO): drive it with
    :func:`run_plan` or :func:`run_plan_async`. Raises :class:`ExactError`."""
    plain = _plain()
    marker = (yield from _chat(plain, False, True))[-_MARKER_TOKENS:]
    close = _after((yield from _chat(plain, False)), marker)
    new = [dict(m) for m in job.messages]
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
        except ExactError:
            if in_arguments:
                continue
            raise
        if not named:
            other = _with_calls(calls, _PLACEHOLDER_NAMES[1], in_arguments)
            if _after((yield from _chat([*other, *new], True)), marker) != rest:
                raise _unnamed()
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
