"""vLLM 0.33's tool parsers over the content a reasoning parser left (see
:mod:`agentkv.sim.outputs` for what each does): ``hermes``
(``vllm/tool_parsers/hermes_tool_parser.py``) and ``qwen3_coder`` (the qwen3 parser engine of
``vllm/parser/engine/parser_engine.py`` run from its content state)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv.sim.arg_types import fix_arg_types
from agentkv.sim.markup import (
    CLOSE_ANGLE,
    EMPTY,
    FUNC_END,
    FUNC_PREFIX,
    THINK_END,
    TOOL_CALL_END,
    TOOL_CALL_START,
    Call,
    Text,
    lex,
)

__all__ = ["hermes_calls", "qwen3_coder_calls"]


# -- hermes ----------------------------------------------------------------------------------
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_HERMES_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')


def hermes_calls(content: Text) -> tuple[list[Call], Text | None] | None:
    """``Hermes2ProToolParser.extract_tool_calls``; None when it reports no tool call."""
    text = content.text
    if TOOL_CALL_START not in text:
        return None
    calls: list[Call] = []
    for m in _HERMES_CALL.finditer(text):
        closed = m.group(1)
        body, body_start = (closed, m.start(1)) if closed else (m.group(2) or "", m.start(2))
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict) or "arguments" not in obj:
            return None
        name = obj.get("name")
        if not isinstance(name, str):
            return None
        end_at = content.at[m.end() - 1]
        named = _HERMES_NAME.search(body)
        name_at = content.at[body_start + named.end() - 1] if named else end_at
        arguments = json.dumps(obj["arguments"], ensure_ascii=False)
        calls.append(Call(name, arguments, name_at, end_at))
    before = content.cut(0, text.find(TOOL_CALL_START))
    return calls, (before if before.text else None)


# -- qwen3_coder -----------------------------------------------------------------------------
_PARAM = re.compile(
    r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))",
    re.DOTALL,
)
_JSON_NAME = re.compile(r'"name"\s*:\s*"([^"]*)"')


def _trim_wrapping_newlines(value: str) -> str:
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def _qwen3_arguments(raw: str) -> str:
    """``_qwen3_arg_converter(raw, partial=False)``."""
    params: dict[str, object] = {}
    for m in _PARAM.finditer(raw):
        params[m.group(1)] = _trim_wrapping_newlines(m.group(2))
    return json.dumps(params, ensure_ascii=False)


@dataclass
class _Slot:
    name: str = ""
    args: str = ""
    name_sent: bool = False
    name_at: int = -1
    end_at: int = -1


@dataclass
class _Qwen3ToolPass:
    """The qwen3 parser engine run from the content state over reasoning-free text
    (``ParserEngine.extract_tool_calls_from_content``), reduced to what it returns."""

    skip_reasoning: bool
    suppress: bool
    slots: list[_Slot] = field(default_factory=list)
    before: list[tuple[int, int]] = field(default_factory=list)
    deferred: list[tuple[int, int]] = field(default_factory=list)
    seen_tool: bool = False

    def text(self, start: int, end: int) -> None:
        (self.deferred if self.seen_tool else self.before).append((start, end))

    def call_start(self) -> None:
        if not self.suppress:
            self.slots.append(_Slot())
            self.seen_tool = True

    def name(self, value: str) -> None:
        if not self.suppress and self.slots:
            self.slots[-1].name += value
            self.seen_tool = True

    def arg(self, value: str, end: int) -> None:
        if self.suppress or not self.slots:
            return
        self.seen_tool = True
        slot = self.slots[-1]
        slot.args += value
        if slot.name_sent:
            return
        if not slot.name:
            found = _JSON_NAME.search(slot.args)
            if found is None or not found.group(1):
                return
            slot.name = found.group(1)
        slot.name_sent, slot.name_at = True, end

    def call_end(self, end: int) -> None:
        if self.suppress or not self.slots:
            return
        self.seen_tool = True
        slot = self.slots[-1]
        if slot.end_at < 0:  # finishing after ``</function>`` ends the same call again
            slot.end_at = end
        if not slot.name_sent:
            found = _JSON_NAME.search(slot.args)
            name = slot.name or (found.group(1) if found else "")
            if name:
                slot.name, slot.name_sent, slot.name_at = name, True, end

    def run(self, text: str) -> None:
        state = "content"
        for term, start, end in lex(text):
            value = text[start:end]
            if state == "content":
                if term == THINK_END and not self.skip_reasoning:
                    continue
                if term == TOOL_CALL_START:
                    state = "preamble"
                    self.call_start()
                elif term == FUNC_PREFIX:
                    state = "name"
                    self.call_start()
                else:
                    self.text(start, end)
            elif state == "preamble":
                if term == TOOL_CALL_END:
                    state = "content"
                    self.call_end(end)
                elif term == FUNC_PREFIX:
                    state = "name"
            elif state == "name":
                if term == CLOSE_ANGLE:
                    state = "args"
                elif term in (FUNC_END, TOOL_CALL_END, TOOL_CALL_START, FUNC_PREFIX):
                    self.call_end(end)
                    state = {
                        FUNC_END: "between",
                        TOOL_CALL_END: "content",
                        TOOL_CALL_START: "preamble",
                        FUNC_PREFIX: "name",
                    }[term]
                    if term in (TOOL_CALL_START, FUNC_PREFIX):
                        self.call_start()
                else:
                    self.name(value)
            elif state == "args":
                if term == FUNC_END:
                    self.call_end(end)
                    state = "between"
                elif term == FUNC_PREFIX:
                    self.call_end(end)
                    self.call_start()
                    state = "name"
                else:
                    self.arg(value, end)
            elif term == TOOL_CALL_END:  # between calls
                state = "content"
            elif term in (TOOL_CALL_START, FUNC_PREFIX):
                self.call_start()
                state = "preamble" if term == TOOL_CALL_START else "name"
        if state != "content":
            self.call_end(len(text))


def qwen3_coder_calls(
    content: Text,
    *,
    skip_reasoning: bool,
    suppress: bool,
    tools: Sequence[Mapping[str, Any]] | None,
) -> tuple[list[Call], Text | None]:
    run = _Qwen3ToolPass(skip_reasoning=skip_reasoning, suppress=suppress)
    run.run(content.text)
    calls: list[Call] = []
    for slot in run.slots:
        # vLLM would try a JSON body here when the name is empty; XML bodies never hold one.
        name = slot.name.strip()
        if not name:
            continue
        arguments = _qwen3_arguments(slot.args) if slot.args.strip() else "{}"
        arguments = fix_arg_types(arguments, name, tools)
        calls.append(
            Call(name, arguments, content.at[slot.name_at - 1], content.at[slot.end_at - 1])
        )
    announced = any(slot.name_sent for slot in run.slots)
    spans = run.before
    if run.deferred and (not run.seen_tool or not announced):
        spans = run.before + run.deferred
    text = content.pick(spans)
    if not text.text.strip() and run.slots:
        text = EMPTY
    if calls:
        text = text.strip()
    return calls, (text if text.text else None)
