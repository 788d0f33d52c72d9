"""What the simulated model emits: generated filler text, or a request's script
(``agentkv_sim``) rendered in the chat template's native syntax (:mod:`agentkv.sim.outputs`
parses it back as vLLM does)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentkv.sim.markup import (
    FUNC_END,
    FUNC_PREFIX,
    PARAM_END,
    PARAM_START,
    THINK_END,
    THINK_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
)

__all__ = [
    "HERMES",
    "QWEN3_CODER",
    "NativeSyntax",
    "ScriptToolCall",
    "SimScript",
    "generate_text",
    "native_syntax_for",
    "render_script",
]


# -- generated text --------------------------------------------------------------------------
_WORDS = (
    "the", "a", "model", "agent", "cache", "token", "turn", "prompt", "answer", "question",
    "reads", "writes", "keeps", "moves", "checks", "finds", "returns", "sends", "needs", "uses",
    "quickly", "again", "later", "often", "here", "there", "now", "then", "only", "still",
    "small", "large", "next", "last", "first", "whole", "same", "new", "old", "warm",
    "block", "prefix", "server", "request", "reply", "tool", "result", "file", "plan", "step",
    "of", "to", "in", "on", "with", "from", "and", "but", "so", "for",
)  # fmt: skip


def generate_text(seed: int, max_chars: int) -> str:
    """Plausible English-ish sentences from ``random.Random(seed)``, at most ``max_chars``
    characters; the same seed always gives the same text, and a longer limit extends it."""
    rng = random.Random(seed)
    out = ""
    while True:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
        words[0] = words[0].capitalize()
        words[-1] += rng.choice((".", ".", ".", "!", "?"))
        for word in words:
            candidate = f"{out} {word}" if out else word
            if len(candidate) > max_chars:
                return out
            out = candidate


# -- scripted output -------------------------------------------------------------------------
class ScriptToolCall(BaseModel):
    """One tool call of a :class:`SimScript`."""

    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    """An object, or the raw argument text inserted verbatim (may be broken on purpose):
    the JSON after ``"arguments": `` for hermes, the body inside ``<function=NAME>\\n`` …
    ``</function>`` for qwen3_coder."""


class SimScript(BaseModel):
    """Exactly what the simulated model emits (request field ``agentkv_sim``).

    Either ``text`` (raw output in the template's native syntax) or the structured fields,
    which :func:`render_script` turns into raw text. The output is the same whatever
    ``max_tokens`` says; ``finish_reason`` (default: the engine's) is what the engine reports.
    """

    model_config = ConfigDict(extra="forbid")

    text: str | None = None
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ScriptToolCall] | None = None
    finish_reason: Literal["stop", "length"] | None = None

    @model_validator(mode="after")
    def _text_or_fields(self) -> SimScript:
        if self.text is not None and (
            self.reasoning is not None or self.content is not None or self.tool_calls
        ):
            raise ValueError("give either `text` or `reasoning`/`content`/`tool_calls`")
        return self


@dataclass(frozen=True)
class NativeSyntax:
    """How a model family writes reasoning and tool calls."""

    tool_format: Literal["hermes", "qwen3_coder"]
    think_start: str = THINK_START
    think_end: str = THINK_END


HERMES = NativeSyntax("hermes")
"""Qwen3 and QwQ: ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``."""
QWEN3_CODER = NativeSyntax("qwen3_coder")
"""Qwen3-Coder: ``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n…``."""


def native_syntax_for(template_text: str) -> NativeSyntax:
    """The family a chat template (its name or source) writes: qwen3_coder XML if it mentions
    ``<function=`` or ``<parameter=``, else hermes JSON."""
    if FUNC_PREFIX in template_text or PARAM_START in template_text:
        return QWEN3_CODER
    return HERMES


def _render_call(call: ScriptToolCall, native: NativeSyntax) -> str:
    if native.tool_format == "hermes":
        if isinstance(call.arguments, str):
            body = f'{{"name": {json.dumps(call.name, ensure_ascii=False)}, '
            body += f'"arguments": {call.arguments}}}'
        else:
            body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"
    if isinstance(call.arguments, str):
        params = call.arguments
    else:
        params = "".join(
            f"{PARAM_START}{key}>\n"
            f"{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}"
            f"\n{PARAM_END}\n"
            for key, value in call.arguments.items()
        )
    return f"{TOOL_CALL_START}\n{FUNC_PREFIX}{call.name}>\n{params}{FUNC_END}\n{TOOL_CALL_END}"


def render_script(
    script: SimScript,
    *,
    native: NativeSyntax,
    thinking: bool = True,
    prompt_ends_in_think: bool = False,
) -> str:
    """The raw text the model emits for ``script``.

    ``text`` is returned as is. Otherwise: the reasoning block when ``thinking`` (empty when
    ``reasoning`` is None, so that vLLM's qwen3 parser does not read the content as
    reasoning; without its ``<think>`` when the prompt already ends with one), then
    ``content``, then the tool calls, one per line. No whitespace is added around reasoning
    or content, so ``parse_output`` gives them back exactly. With ``thinking`` off, a
    ``reasoning`` is still written as a think block, which vLLM then returns as content.
    """
    if script.text is not None:
        return script.text
    out = ""
    if thinking or script.reasoning is not None:
        start = "" if thinking and prompt_ends_in_think else native.think_start
        out = f"{start}{script.reasoning or ''}{native.think_end}"
    out += script.content or ""
    out += "\n".join(_render_call(call, native) for call in script.tool_calls or [])
    return out
