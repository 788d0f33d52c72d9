"""What the simulated model says, and how vLLM 0.33 parses it back into a chat message.

Parsing follows vLLM 0.33's non-streaming chat path (``DelegatingParser.parse`` in
``vllm/parser/abstract_parser.py``): a reasoning parser splits the raw output into reasoning and
content, then a tool parser takes the tool calls out of the content.

Reasoning parsers (``reasoning_parser``):

* ``qwen3`` (``vllm/parser/qwen3.py``, the ``ParserEngine`` of
  ``vllm/parser/engine/parser_engine.py`` behind ``Qwen3ParserReasoningAdapter``): output starts
  in reasoning, whether or not the prompt ended with ``<think>``; ``<think>`` inside reasoning is
  dropped, the first ``</think>`` ends reasoning and later ones are dropped, ``<tool_call>``
  ends reasoning implicitly and stays in the content. Output with no ``</think>`` (truncated,
  or a model that never thinks) is all reasoning. ``enable_thinking=False``
  (``thinking=False`` here) returns the whole output as content. Nothing is stripped.
* ``deepseek_r1`` (``vllm/reasoning/deepseek_r1_reasoning_parser.py`` and its base
  ``BaseThinkingReasoningParser.extract_reasoning`` in ``vllm/reasoning/basic_parsers.py``):
  text up to and including the first ``<think>`` is dropped, reasoning runs to the first
  ``</think>`` (all of the rest when there is none; it may be ``""``), content is what follows.

Tool parsers (``tool_format``):

* ``hermes`` (``vllm/tool_parsers/hermes_tool_parser.py``): every ``<tool_call>{json}</tool_call>``
  (or an unclosed ``<tool_call>{json}`` at the end) must hold a JSON object with a string
  ``name`` and an ``arguments`` value, returned as ``json.dumps(arguments, ensure_ascii=False)``.
  Content is the text before the first ``<tool_call>``; text after a call is lost. If any call
  fails to parse, vLLM returns no tool calls and the content untouched, markup included.
* ``qwen3_coder`` (``vllm/parser/qwen3.py`` through ``Qwen3ParserToolAdapter``): XML calls
  ``<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>``; each value
  loses one leading and one trailing newline and is a string unless the request's tool schema
  types it (``ParserEngine._fix_arg_types`` with ``coerce_to_schema_type`` of
  ``vllm/tool_parsers/utils.py``). An unclosed last parameter is dropped. With tool calls,
  content is the text before the first call, stripped; text between and after calls is lost.
  Without any, content is the output minus the tool-call markup.
* ``auto``: ``qwen3_coder`` if the output contains ``<function=``, else ``hermes``.

Tool-call ids look like vLLM's (``make_tool_call_id`` in
``vllm/renderers/chat_utils/tool_call.py``: ``chatcmpl-tool-`` and 16 hex digits) but come
from ``random.Random(seed)`` so that a simulator response is reproducible.

vLLM 0.33 names the reasoning field ``reasoning`` in both the message and the stream delta
(``ChatMessage`` and ``DeltaMessage``); ``reasoning_content`` is only accepted on input.
"""

from __future__ import annotations

import random
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Literal, TypedDict

from typing_extensions import Unpack

from agentkv.protocol.deltas import DeltaFold, ToolCall
from agentkv.sim.markup import (
    EMPTY,
    FUNC_PREFIX,
    THINK_END,
    THINK_START,
    TOOL_CALL_START,
    Call,
    Text,
    lex,
)
from agentkv.sim.tool_parsers import hermes_calls, qwen3_coder_calls

__all__ = [
    "OutputOptions",
    "ParsedOutput",
    "ReasoningParser",
    "ToolChoice",
    "ToolFormat",
    "join_deltas",
    "parse_output",
    "stream_deltas",
]

ToolFormat = Literal["auto", "hermes", "qwen3_coder", "none"]
ReasoningParser = Literal["qwen3", "deepseek_r1"]
ToolChoice = Literal["auto", "none"]


@dataclass(frozen=True)
class ParsedOutput:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class _Parsed:
    reasoning: Text | None
    content: Text | None
    calls: list[Call]


# -- reasoning -------------------------------------------------------------------------------
def _qwen3_reasoning(out: Text) -> tuple[Text | None, Text | None]:
    """``Qwen3Parser.extract_reasoning`` with tool parsing skipped, as its adapter runs it."""
    reasoning: list[tuple[int, int]] = []
    content: list[tuple[int, int]] = []
    in_reasoning = True
    for term, start, end in lex(out.text):
        if term == THINK_END:
            in_reasoning = False
            continue
        if term == THINK_START and in_reasoning:
            continue
        if term == TOOL_CALL_START:
            in_reasoning = False
        (reasoning if in_reasoning else content).append((start, end))
    r, c = out.pick(reasoning), out.pick(content)
    return (r if r.text else None), (c if c.text else None)


def _r1_reasoning(out: Text) -> tuple[Text | None, Text | None]:
    """``BaseThinkingReasoningParser.extract_reasoning``."""
    start = out.text.find(THINK_START)
    body = start + len(THINK_START) if start >= 0 else 0
    end = out.text.find(THINK_END, body)
    if end < 0:
        return out.cut(body, len(out.text)), None
    content = out.cut(end + len(THINK_END), len(out.text))
    return out.cut(body, end), (content if content.text else None)


# -- parsing ---------------------------------------------------------------------------------
class OutputOptions(TypedDict, total=False):
    """How the engine parses an output: what :func:`parse_output` and :func:`stream_deltas`
    take besides the text and ``seed`` (each is said at :func:`parse_output`)."""

    reasoning: bool
    reasoning_parser: ReasoningParser
    thinking: bool
    tool_format: ToolFormat
    tool_choice: ToolChoice
    tools: Sequence[Mapping[str, Any]] | None


def _parse(
    text: str,
    *,
    reasoning: bool = True,
    reasoning_parser: ReasoningParser = "qwen3",
    thinking: bool = True,
    tool_format: ToolFormat = "auto",
    tool_choice: ToolChoice = "auto",
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> _Parsed:
    out = Text.whole(text)
    r: Text | None
    c: Text | None
    if not reasoning:
        r, c = None, out
    elif reasoning_parser == "deepseek_r1":
        r, c = _r1_reasoning(out)
    elif not thinking:
        r, c = None, out
    else:
        r, c = _qwen3_reasoning(out)

    fmt = tool_format
    if fmt == "auto":
        fmt = "qwen3_coder" if FUNC_PREFIX in text else "hermes"
    calls: list[Call] = []
    if fmt == "hermes" and tool_choice == "auto":
        found = hermes_calls(c or EMPTY)
        if found is not None:
            calls, c = found
            if c is not None and not c.text.strip():
                c = None
    elif fmt == "qwen3_coder":
        # DelegatingParser._extract_tool_calls: with a legacy reasoning parser (deepseek_r1)
        # the composed parser is not engine-based and keeps the content it was given.
        engine_based = not reasoning or reasoning_parser == "qwen3"
        suppress = tool_choice == "none" and bool(tools)
        found_calls, found_content = qwen3_coder_calls(
            c or EMPTY, skip_reasoning=not reasoning, suppress=suppress, tools=tools
        )
        if tool_choice == "auto" and found_calls:
            calls, c = found_calls, found_content
        elif engine_based:
            c = found_content
    return _Parsed(r, c, calls)


def _tool_call_ids(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [f"chatcmpl-tool-{rng.getrandbits(64):016x}" for _ in range(count)]


def _output(parsed: _Parsed, seed: int) -> ParsedOutput:
    ids = _tool_call_ids(seed, len(parsed.calls))
    return ParsedOutput(
        reasoning=None if parsed.reasoning is None else parsed.reasoning.text,
        content=None if parsed.content is None else parsed.content.text,
        tool_calls=[
            ToolCall(id=i, name=call.name, arguments=call.arguments)
            for i, call in zip(ids, parsed.calls, strict=True)
        ],
    )


def parse_output(text: str, *, seed: int = 0, **options: Unpack[OutputOptions]) -> ParsedOutput:
    """The message vLLM 0.33 returns for raw output ``text``.

    ``reasoning``: a reasoning parser is configured (``--reasoning-parser``), namely
    ``reasoning_parser``. ``thinking``: the request's ``enable_thinking`` (only ``qwen3``
    reads it). ``tool_format``: the ``--tool-call-parser`` (``none``: no tool parsing).
    ``tool_choice``: the request's; ``none`` keeps tool calls out of the message (``tools``
    given) or only drops them (no ``tools``), as vLLM does. ``tools``: the request's tools,
    used to type ``qwen3_coder`` parameters. ``seed``: where tool-call ids come from. The
    defaults: ``reasoning`` on with ``qwen3``, ``thinking`` on, ``auto`` tool format and
    choice, no ``tools``.
    """
    return _output(_parse(text, **options), seed)


# -- streaming -------------------------------------------------------------------------------
def stream_deltas(
    pieces: Sequence[str], *, seed: int = 0, **options: Unpack[OutputOptions]
) -> list[dict[str, Any] | None]:
    """The chat-completion ``delta`` vLLM streams after each generated token, or None where
    it sends nothing (a ``</think>`` token, tool-call markup).

    ``pieces`` are the tokens' texts as the detokenizer releases them; the options are
    :func:`parse_output`'s. Deltas carry ``reasoning`` and ``content`` text as it is
    generated. A tool call is announced (``index``, ``id``, ``type``, ``function.name``) at the
    token that completes its name and gets its whole ``function.arguments`` at the token that
    completes the call (vLLM streams the arguments in pieces; the joined text is what matters).
    Joining the deltas (:func:`join_deltas`) gives exactly ``parse_output("".join(pieces))``;
    where vLLM's own streaming differs from its non-streaming result (it does for some broken
    outputs) this follows the non-streaming one. The opening ``{"role": "assistant",
    "content": ""}`` delta and the final one with ``finish_reason`` are the caller's.
    """
    parsed = _parse("".join(pieces), **options)
    if not pieces:
        return []
    ends = list(accumulate(len(p) for p in pieces))
    deltas: list[dict[str, Any]] = [{} for _ in pieces]
    for key, part in (("content", parsed.content), ("reasoning", parsed.reasoning)):
        if part is None:
            continue
        if not part.text:  # "" rather than None: say so once, at the end
            deltas[-1][key] = ""
            continue
        start = 0
        for k, end in enumerate(ends):
            lo, hi = bisect_left(part.at, start), bisect_left(part.at, end)
            if hi > lo:
                deltas[k][key] = part.text[lo:hi]
            start = end
    ids = _tool_call_ids(seed, len(parsed.calls))
    for index, (call_id, call) in enumerate(zip(ids, parsed.calls, strict=True)):
        named, done = bisect_right(ends, call.name_at), bisect_right(ends, call.end_at)
        head: dict[str, Any] = {
            "index": index,
            "id": call_id,
            "type": "function",
            "function": {"name": call.name},
        }
        if named == done:
            head["function"]["arguments"] = call.arguments
            deltas[named].setdefault("tool_calls", []).append(head)
        else:
            deltas[named].setdefault("tool_calls", []).append(head)
            tail = {"index": index, "function": {"arguments": call.arguments}}
            deltas[done].setdefault("tool_calls", []).append(tail)
    return [d or None for d in deltas]


def join_deltas(deltas: Iterable[Mapping[str, Any] | None]) -> ParsedOutput:
    """What a client accumulates from chat-completion deltas."""
    folded = DeltaFold()
    for delta in deltas:
        if delta is not None:
            folded.feed(delta)
    return ParsedOutput(
        reasoning=folded.reasoning,
        content=folded.content,
        tool_calls=folded.calls(),
    )
