"""Name the hazard behind a drift (``../shared/reference/chat-templates.md``, hazard catalogue).

In messages mode the server renders the whole history each turn; the SDK compares the prompt
ids it returns with the previous prompt + the generated ids and, where they stop agreeing,
decodes a window of each (from a few tokens before that point). :func:`classify_drift` reads
those two texts and names the most specific hazard of the catalogue:

====================  ============================================================================
hazard                what the two texts show at the divergence
====================  ============================================================================
retokenized           the same text, tokenized into other ids (BPE seams, normalisation)
end-of-turn-rewritten the model's stop token rendered as another one (gpt-oss ``<|return|>`` →
                      ``<|end|>``, an EOS the template never writes)
generation-prompt-    the generation prompt differs from how history renders the same turn
mismatch              (QwQ's pre-filled ``<think>``, DeepSeek-V3.1 ``<think>`` vs ``</think>``,
                      indentation leaking out of vLLM's DeepSeek templates)
reasoning-pruned      a reasoning block (``<think>``, gpt-oss's analysis channel) that the
                      history no longer renders
moved-block           a system prompt or tools block that moved (Mistral: to the last user turn)
time-dependent        a date that changed (``strftime_now``)
tool-call-            a tool call rendered from the parsed arguments in another syntax or spacing
reserialized
look-ahead            an earlier message renders differently once another follows it (Hermes:
                      the newline inside a tool result depends on ``loop.last``)
whitespace-normalized the model's text trimmed or re-spaced (Llama ``trim``, GLM ``strip``)
output-rerendered     the answer renders differently from what was generated (anything else)
history-rerendered    an earlier message renders differently (anything else)
====================  ============================================================================
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["HAZARDS", "classify_drift"]

HAZARDS = {
    "retokenized": "the same text re-tokenized into different ids",
    "end-of-turn-rewritten": "the end-of-turn token of the answer was rendered as another one",
    "generation-prompt-mismatch": (
        "the generation prompt differs from how the template renders the turn in history"
    ),
    "reasoning-pruned": "the template dropped earlier reasoning",
    "moved-block": "the template moved a block (system prompt, tools) to a later message",
    "time-dependent": "the template inserts a date or time that changed",
    "tool-call-reserialized": "tool calls were re-serialized from the parsed arguments",
    "look-ahead": "an earlier message renders differently once another message follows it",
    "whitespace-normalized": "the template trimmed or changed the whitespace of the answer",
    "output-rerendered": "the model's answer re-renders differently from what it generated",
    "history-rerendered": "an earlier message renders differently once more messages follow",
}

# A chat template's special-looking token: <|x|>, <｜x｜>, </s>, [/INST]-style tags.
_SPECIAL = r"(?:<\|[^|<>\s]{1,40}\|>|<｜[^｜\s]{1,40}｜>|</s>|<eos>|\[/?[A-Z_]{2,30}\])"
_END_OF_TURN = re.compile(rf"\s*{_SPECIAL}\s*")
_RETURN_END = re.compile(r"\s*<\|return\|>")
_ASSISTANT_HEADER = re.compile(
    r"(?:<\|im_start\|>assistant|<｜Assistant｜>|<\|assistant\|>|"
    r"<\|start_header_id\|>assistant<\|end_header_id\|>|<\|start\|>assistant|\]~b\]ai|"
    r"<\|im_assistant\|>assistant<\|im_middle\|>|\[/INST\])\s*$"
)
_HEADER = re.compile(_ASSISTANT_HEADER.pattern.removesuffix(r"\s*$"))
_FILLED_THINK = re.compile(r"<think>\s*[^<\s][^<]*</think>")
_GLUE = re.compile(rf"{_SPECIAL}|<think>|</think>|\s+")
_EMPTY_THINK = re.compile(r"<think>\s*</think>")
_REASONING = re.compile(r"<think>|</think>|<\|channel\|>analysis|<seed:think>|◁think▷")
_BLOCK = re.compile(
    r"\s*(?:\[AVAILABLE_TOOLS\]|\[SYSTEM_PROMPT\]|<tools>|# Tools|<\|im_system\|>|"
    r"<\|start\|>system|<\|start\|>developer|<\|system\|>)"
)
_TOOL_CALL = re.compile(
    r"<tool_call>|<function=|\{\"name\":|to=functions\.|\[TOOL_CALLS\]|<｜tool▁call▁begin｜>|"
    r"<\|tool_call_begin\|>|<invoke |<minimax:tool_call>|<\|tool_calls_section_begin\|>"
)
_TOOL_CALL_END = re.compile(
    r"</tool_call>|<\|call\|>|<｜tool▁call▁end｜>|<\|tool_call_end\|>|</invoke>|</function>|"
    r"\[/TOOL_CALLS\]|</minimax:tool_call>"
)
_DATE = re.compile(
    r"\d{4}-\d{2}-\d{2}|\d{1,2} (?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* \d{4}"
)
_AROUND = 40


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _reasoning_texts(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    for m in messages:
        if m.get("role") != "assistant":
            continue
        for key in ("reasoning", "reasoning_content", "thinking"):
            value = m.get(key)
            if isinstance(value, str) and value.strip():
                out.append(value.strip())
                break
    return out


def _starts_with_any(text: str, pieces: Sequence[str], at_least: int = 8) -> bool:
    """Whether ``text`` (leading whitespace aside) starts with the first characters of one of
    ``pieces`` (at least ``at_least`` of them, or the whole piece when shorter)."""
    head = text.lstrip()
    for piece in pieces:
        probe = piece[: max(at_least, 1)]
        if probe and head.startswith(probe):
            return True
    return False


def _lost_reasoning(e: str, a: str, reasoning: Sequence[str]) -> bool:
    """Whether ``e`` holds reasoning text (a filled think block, or a message's reasoning)
    right at the divergence that ``a`` no longer has."""
    e_s, a_s = e.lstrip(), a.lstrip()
    if _FILLED_THINK.match(e_s) and not _FILLED_THINK.match(a_s):
        return True
    head = e[: _AROUND * 2]
    return any(r[:16] in head and r[:16] not in a[: _AROUND * 4] for r in reasoning if r[:16])


def _pruned(e: str, a: str, reasoning: Sequence[str]) -> bool:
    """Whether ``a`` lacks the reasoning that ``e`` has at the divergence (or renders an
    emptied reasoning block where the model wrote none)."""
    e_s, a_s = e.lstrip(), a.lstrip()
    if _EMPTY_THINK.match(a_s) and not _EMPTY_THINK.match(e_s):
        return True
    texted = _starts_with_any(e, reasoning)
    if not texted and not _REASONING.match(e_s):
        return False
    if any(r[:16] in a[: _AROUND * 2] for r in reasoning if r[:16]):
        return False  # the reasoning is still there, in other markup
    if texted or _FILLED_THINK.match(e_s) or not _REASONING.match(a_s):
        return True
    return len(_REASONING.findall(e[:_AROUND])) > len(_REASONING.findall(a[:_AROUND]))


def _inside_call(before: str) -> bool:
    """Whether the text before the divergence ends inside a rendered tool call."""
    tail = before[-_AROUND * 4 :]
    starts = [m.end() for m in _TOOL_CALL.finditer(tail)]
    ends = [m.end() for m in _TOOL_CALL_END.finditer(tail)]
    return bool(starts) and (not ends or starts[-1] > ends[-1])


def _just_before_answer(e: str, messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether only tags and whitespace separate the divergence from the last answer's text
    (then the difference is in the generation prompt, whatever its tags are)."""
    answer = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    if answer is None:
        return False
    texts = [answer.get(k) for k in ("reasoning", "reasoning_content", "content")]
    for text in texts:
        if isinstance(text, str) and text.strip():
            at = e.find(text.strip()[:12])
            if at >= 0:
                return not _GLUE.sub("", e[:at])
    return False


def _whitespace_only(e: str, a: str) -> bool:
    """Whether the texts differ first by whitespace and agree on what follows it."""
    if not (e[:1].isspace() or a[:1].isspace()):
        return False
    se, sa = _squash(e), _squash(a)
    n = min(len(se), len(sa), _AROUND)
    return n > 0 and se[:n] == sa[:n]


def _system_texts(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    for m in messages:
        content = m.get("content")
        if m.get("role") in ("system", "developer") and isinstance(content, str) and content:
            out.append(content.strip())
    return out


def classify_drift(
    *,
    expected_text: str,
    actual_text: str,
    in_output: bool,
    messages: Sequence[Mapping[str, Any]] = (),
) -> tuple[str, str]:
    """``(hazard, detail)`` for a drift whose decoded windows are given.

    Args:
        expected_text: the previous prompt + generated ids, decoded from a little before the
            first differing token.
        actual_text: the server's new prompt, decoded over the same token positions.
        in_output: whether the first differing token belongs to the generated ids (else it is
            in the previous prompt).
        messages: the conversation's messages (reasoning, tool calls and system prompts help
            name the hazard).
    """
    exp, act = expected_text, actual_text
    prefix = 0
    while prefix < min(len(exp), len(act)) and exp[prefix] == act[prefix]:
        prefix += 1
    before, e, a = exp[:prefix], exp[prefix:], act[prefix:]
    shown = f"expected {e[:_AROUND]!r}, got {a[:_AROUND]!r}"
    if not e or not a:
        near = exp[max(0, prefix - 20) : prefix + 20]
        return "retokenized", f"same text, different token ids near {near!r}"
    # Where a character differs inside a special token, compare from its start.
    cut = max(before.rfind("<"), before.rfind("["))
    if cut >= 0 and not re.search(r"[>\]\s]", before[cut:]):
        before, e, a = before[:cut], exp[cut:], act[cut:]
        shown = f"expected {e[:_AROUND]!r}, got {a[:_AROUND]!r}"
    if in_output and (_END_OF_TURN.fullmatch(e) or _RETURN_END.match(e)):
        return "end-of-turn-rewritten", shown
    reasoning = _reasoning_texts(messages)
    e_s, a_s = e.lstrip(), a.lstrip()
    if not in_output and (
        _ASSISTANT_HEADER.search(before)
        or _HEADER.match(e_s)
        or _HEADER.match(a_s)
        or _just_before_answer(e, messages)
    ):
        # At the generation prompt: a pre-filled reasoning block that history drops is
        # pruning; anything else there is the prompt disagreeing with history.
        if _lost_reasoning(e, a, reasoning):
            return "reasoning-pruned", shown
        return "generation-prompt-mismatch", shown
    if _pruned(e, a, reasoning):
        return "reasoning-pruned", shown
    systems = _system_texts(messages)
    if _BLOCK.match(e) or _BLOCK.match(a) or _starts_with_any(e, systems, 12):
        return "moved-block", shown
    if _DATE.search(e[:_AROUND]) and _DATE.search(a[:_AROUND]):
        return "time-dependent", shown
    if any(m.get("tool_calls") for m in messages) and (
        _inside_call(before) or _TOOL_CALL.match(e_s) or _TOOL_CALL.match(a_s)
    ):
        return "tool-call-reserialized", shown
    if _whitespace_only(e, a):
        return ("whitespace-normalized" if in_output else "look-ahead"), shown
    if in_output:
        return "output-rerendered", shown
    return "history-rerendered", shown
