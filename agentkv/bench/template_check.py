"""``agentkv check-template`` (:mod:`agentkv.cli.check`): how a chat template behaves over a
multi-turn agent conversation.

A scripted conversation (system prompt, tools, reasoning, tool calls and their results, final
answers, new user messages) is rendered turn by turn, in-process, with the template and a real
tokenizer, as vLLM would render it (:mod:`agentkv.chat`). The model's output at turn ``k`` is
taken to be what the template itself renders for that assistant message (the method of
``../shared/reference/chat-templates.md``), so every difference found is the template's doing.
For each turn the check reports:

* **messages mode**: whether the server's re-rendered prompt ``k+1`` still starts with prompt
  ``k`` + output ``k`` (prefix-stable), and when it does not, the hazard of the catalogue, the
  token position and the message where the two first differ (what ``mode="messages"``
  receipts report);
* **exact mode**: whether ``agentkv``'s exact mode keeps the prompt token-identical (prompt
  ``k+1`` = prompt ``k`` + output ``k`` + the new messages rendered by
  :class:`~agentkv.LocalRenderer`), and whether that equals a fresh render of the whole
  history (it does exactly when the template is stable).

No server is involved. Only templates that render the whole conversation can be checked; a
template that fails is reported with its own error (what vLLM would answer with a 400).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentkv._drift import classify_drift
from agentkv._exceptions import RenderError
from agentkv._ledger import RenderJob
from agentkv._rendering import LocalRenderer
from agentkv.protocol.prefix import common_prefix

__all__ = [
    "SYSTEM",
    "TOOLS",
    "CheckError",
    "TemplateReport",
    "TurnCheck",
    "check_template",
    "generated_part",
    "scripted_turns",
]

SYSTEM = "You are a helpful assistant. Use the tools when you need live data."
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    },
]
_TEXT_BEFORE, _TEXT_AFTER = 120, 240


def _call(n: int, name: str, **arguments: Any) -> dict[str, Any]:
    # Nine alphanumeric characters: what Mistral's templates demand of a tool-call id.
    return {
        "id": f"call{n:05d}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def scripted_turns() -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """The conversation: per turn, the messages added before it and the assistant's answer
    (reasoning, content, tool calls as an OpenAI client sends them back). Ten turns: tool
    calls with reasoning, a two-call tool loop, tool results, final answers (one without
    reasoning), new user messages."""
    weather_paris = _call(1, "get_weather", city="Paris")
    weather_berlin = _call(2, "get_weather", city="Berlin")
    time_berlin = _call(3, "get_time", city="Berlin")
    time_tokyo = _call(4, "get_time", city="Tokyo")
    weather_oslo = _call(5, "get_weather", city="Oslo")

    def user(text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": text}]

    def tool(call: dict[str, Any], content: str) -> list[dict[str, Any]]:
        return [{"role": "tool", "tool_call_id": call["id"], "content": content}]

    def said(content: str, reasoning: str | None = None, *calls: dict[str, Any]) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            msg["reasoning"] = reasoning
        if calls:
            msg["tool_calls"] = list(calls)
        return msg

    return [
        (
            user("What's the weather in Paris?"),
            said("", "The user wants the weather in Paris: call get_weather.", weather_paris),
        ),
        (
            tool(weather_paris, '{"temp_c": 18, "sky": "cloudy"}'),
            said("It is 18 °C and cloudy in Paris.", "The tool says 18 °C, cloudy."),
        ),
        (
            user("And in Berlin? Also the local time there."),
            said("", "Weather first, then the time.", weather_berlin),
        ),
        (
            tool(weather_berlin, '{"temp_c": 12, "sky": "rain"}'),
            said("", "Now the time in Berlin.", time_berlin),
        ),
        (
            tool(time_berlin, '{"time": "21:04"}'),
            said("Berlin: 12 °C with rain, and it is 21:04.", "Both results are in."),
        ),
        (
            user("What time is it in Tokyo?"),
            said("", "Call get_time for Tokyo.", time_tokyo),
        ),
        (
            tool(time_tokyo, '{"time": "04:04"}'),
            said("It is 04:04 in Tokyo.", "Answer with the time."),
        ),
        (
            user("Thanks! Summarize everything in one line."),
            said("Paris 18 °C cloudy; Berlin 12 °C rain at 21:04; Tokyo 04:04."),
        ),
        (
            user("One more: the weather in Oslo?"),
            said("", "Call get_weather for Oslo.", weather_oslo),
        ),
        (
            tool(weather_oslo, '{"temp_c": 3, "sky": "snow"}'),
            said("Oslo: 3 °C and snowing.", "Cold and snowy."),
        ),
    ]


_CLOSING_MESSAGE = {"role": "user", "content": "Thanks, that is all."}


class CheckError(Exception):
    """The check could not run: a missing file, or a template that cannot render the
    conversation (``str(error)`` says which turn and why)."""


@dataclass(frozen=True)
class TurnCheck:
    """One turn of the check: from prompt ``turn`` + output ``turn`` to prompt ``turn + 1``."""

    turn: int
    stable: bool
    """Messages mode: the re-rendered next prompt starts with this prompt + this output."""
    hazard: str | None = None
    position: int | None = None
    """Token index of the first difference (in prompt + output)."""
    message_index: int | None = None
    """Index of the message where the difference starts (0 = the system prompt)."""
    detail: str = ""
    exact: bool = True
    """Exact mode: the next prompt is this prompt + this output + the new messages' ids."""
    exact_is_fresh: bool = False
    """The exact prompt equals a fresh render of the whole history (a stable template)."""


@dataclass
class TemplateReport:
    template: str
    tokenizer: str
    turns: list[TurnCheck] = field(default_factory=list)

    @property
    def stable(self) -> bool:
        return all(t.stable for t in self.turns)


def generated_part(prompt: str, history: str, final: str) -> str:
    """What the model generated: the final rendering of its message after the prompt; when the
    template renders the history differently once the message follows (look-ahead), after the
    generation prompt's last occurrence; else after what both renderings share."""
    if final.startswith(prompt):
        return final[len(prompt) :]
    header = prompt[len(history) :] if prompt.startswith(history) else ""
    at = final.rfind(header) if header else -1
    if at >= 0 and at >= common_prefix(prompt, final) - len(header):
        return final[at + len(header) :]
    # The generation prompt disagrees with history: keep what both share, up to a whole tag.
    common = common_prefix(prompt, final)
    tag = max(final.rfind("<", 0, common), final.rfind("[", 0, common))
    if tag >= 0 and max(final.rfind(">", 0, common), final.rfind("]", 0, common)) < tag:
        common = tag
    return final[common:]


def _token_at(tok: Any, text: str, char: int) -> int:
    """The index of the token of ``tok.encode(text)`` that holds character ``char``."""
    offsets = tok.backend.encode(text, add_special_tokens=False).offsets
    for i, (_start, end) in enumerate(offsets):
        if end > char:
            return i
    return len(offsets)


def _named(
    messages: Sequence[Mapping[str, Any]], answer: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """``messages`` with each tool result naming the function it answers (some templates,
    gpt-oss's, render that name; the SDK takes it from the message)."""
    names = {
        c.get("id"): (c.get("function") or {}).get("name") for c in answer.get("tool_calls") or []
    }
    out: list[dict[str, Any]] = []
    for message in messages:
        m = copy.deepcopy(dict(message))
        if m.get("role") == "tool" and names.get(m.get("tool_call_id")):
            m["name"] = names[m["tool_call_id"]]
        out.append(m)
    return out


def _message_at(
    renderer: LocalRenderer,
    history: Sequence[Mapping[str, Any]],
    ids: Sequence[int],
    position: int,
    kwargs: Mapping[str, Any],
) -> int | None:
    """The index of the message whose rendering holds token ``position`` of ``ids``: the
    number of leading messages that, rendered on their own, end before it."""
    index = None
    for i in range(1, len(history) + 1):
        try:
            text = renderer.template.render_request(
                list(history[:i]), tools=TOOLS, add_generation_prompt=False, **kwargs
            )
        except Exception:  # a prefix some templates refuse (e.g. ends with a tool call)
            continue
        head = renderer.tokenizer.encode(text)
        common = 0
        while common < min(len(head), len(ids)) and head[common] == ids[common]:
            common += 1
        if common > position:
            return index if index is not None else i - 1
        if common == len(head):
            index = i
    return index


def check_template(
    template: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | None = None,
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> TemplateReport:
    """Run the scripted conversation through ``template`` (see the module docstring).

    Raises:
        CheckError: a file is missing, or the template cannot render the conversation.
    """
    for path in (template, tokenizer):
        if path is not None and not Path(path).exists():
            raise CheckError(f"No such file: {os.fspath(path)}")
    try:
        renderer = LocalRenderer(tokenizer=tokenizer, template=template)
    except Exception as exc:  # unreadable JSON, a Jinja syntax error, ...
        raise CheckError(f"Cannot load {os.fspath(template)}: {exc}") from exc
    kwargs = dict(chat_template_kwargs or {})
    tok = renderer.tokenizer
    report = TemplateReport(renderer.template.name, str(tokenizer or "qwen3 (default)"))

    def render(messages: list[dict[str, Any]], gen: bool, turn: int) -> str:
        try:
            return renderer.template.render_request(
                messages, tools=TOOLS, add_generation_prompt=gen, **kwargs
            )
        except Exception as exc:
            raise CheckError(
                f"{renderer.template.name} cannot render turn {turn} of the conversation: {exc}"
            ) from exc

    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    turns = scripted_turns()
    exact: list[int] | None = None
    for k, (added, answer) in enumerate(turns, start=1):
        history += copy.deepcopy(added)
        prompt_text = render(history, True, k)
        prompt = tok.encode(prompt_text)
        try:  # the history alone, to tell the generation prompt (some templates refuse it)
            before = renderer.template.render_request(
                history, tools=TOOLS, add_generation_prompt=False, **kwargs
            )
        except Exception:
            before = ""
        generated = generated_part(prompt_text, before, render([*history, answer], False, k))
        output = tok.encode(generated)
        if exact is None:
            exact = list(prompt)
        history.append(copy.deepcopy(answer))
        following = turns[k][0] if k < len(turns) else [dict(_CLOSING_MESSAGE)]
        next_history = [*history, *copy.deepcopy(following)]
        next_text = render(next_history, True, k + 1)
        next_prompt = tok.encode(next_text)
        expected = [*prompt, *output]
        at = common_prefix(expected, next_prompt)
        # Exact mode on its own prompts: append the new messages' ids after the output.
        detail = ""
        job = RenderJob("append", _named(following, answer), TOOLS, kwargs or None, output)
        try:
            exact = [*exact, *output, *renderer.render(job)]
        except RenderError as exc:
            detail, exact = f"exact mode: {exc}", None
        exact_ok = exact is not None
        fresh = exact is not None and exact == next_prompt
        if at == len(expected):
            report.turns.append(
                TurnCheck(k, True, detail=detail, exact=exact_ok, exact_is_fresh=fresh)
            )
            continue
        expected_text = prompt_text + generated
        text_at = common_prefix(expected_text, next_text)
        if text_at == len(expected_text):  # the same text, other ids
            hazard, why = classify_drift(
                expected_text=tok.decode(expected[max(0, at - 8) : at + 8]),
                actual_text=tok.decode(next_prompt[max(0, at - 8) : at + 8]),
                in_output=at >= len(prompt),
                messages=history,
            )
            if hazard != "retokenized":
                hazard, why = "retokenized", "the same text, tokenized differently"
            position = at
        else:
            lo = max(0, text_at - _TEXT_BEFORE)
            hazard, why = classify_drift(
                expected_text=expected_text[lo : text_at + _TEXT_AFTER],
                actual_text=next_text[lo : text_at + _TEXT_AFTER],
                in_output=text_at >= len(prompt_text),
                messages=history,
            )
            if text_at < len(prompt_text):
                position = _token_at(tok, prompt_text, text_at)
            else:
                position = len(prompt) + _token_at(tok, generated, text_at - len(prompt_text))
        report.turns.append(
            TurnCheck(
                k,
                False,
                hazard=hazard,
                position=position,
                message_index=_message_at(renderer, history, expected, position, kwargs),
                detail="; ".join(d for d in (why, detail) if d),
                exact=exact_ok,
                exact_is_fresh=fresh,
            )
        )
    return report
