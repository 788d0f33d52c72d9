"""The hazard classifier of messages mode, on the text windows real templates produce.

Each case is what the SDK decodes around the first differing token (the previous prompt +
output, and the server's new prompt), taken from the templates of
``../shared/reference/chat-templates.md``.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentkv._drift import HAZARDS, classify_drift

ASSISTANT_CALL = {
    "role": "assistant",
    "content": "",
    "reasoning": "Need the tool.",
    "tool_calls": [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
        }
    ],
}
CHAT = [
    {"role": "system", "content": "Be brief and kind to everyone."},
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Hello, how can I help you", "reasoning": "Greet back."},
    {"role": "user", "content": "Tell me a joke."},
]
TOOLED = [{"role": "user", "content": "Weather in Paris?"}, ASSISTANT_CALL]

CASES: list[tuple[str, str, str, bool, list[dict[str, Any]], str]] = [
    # (name, expected window, actual window, in_output, messages, hazard)
    (
        "same text, other ids (BPE seam)",
        '{"city": "Paris"}}\n</tool_call>',
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n<|im_start|>user',
        True,
        TOOLED,
        "retokenized",
    ),
    (
        "gpt-oss: the final answer's <|return|> becomes <|end|>",
        "<|channel|>final<|message|>Paris 18 °C.<|return|>",
        "<|channel|>final<|message|>Paris 18 °C.<|end|><|start|>user<|message|>More?",
        True,
        CHAT,
        "end-of-turn-rewritten",
    ),
    (
        "an EOS the template never renders",
        "It is 18 C in Paris<｜end▁of▁sentence｜>",
        "It is 18 C in Paris<|im_end|>\n<|im_start|>user\nAnd Oslo?",
        True,
        CHAT,
        "end-of-turn-rewritten",
    ),
    (
        "Qwen3: reasoning dropped at the next user message",
        "<|im_start|>assistant\n<think>\nGreet back.\n</think>\n\nHello, how can I help you",
        "<|im_start|>assistant\nHello, how can I help you<|im_end|>\n<|im_start|>user",
        True,
        CHAT,
        "reasoning-pruned",
    ),
    (
        "Qwen3, the seam token merged so the difference starts in the prompt",
        "<|im_start|>assistant\n<think>\nGreet back.\n</think>\n\nHello, how can I help you",
        "<|im_start|>assistant\n\n\nHello, how can I help you<|im_end|>\n<|im_start|>user",
        False,
        CHAT,
        "reasoning-pruned",
    ),
    (
        "GLM-4.6: earlier reasoning becomes <think></think>",
        "<|assistant|>\n<think>Greet back.</think>\nHello, how can I help you<|user|>",
        "<|assistant|>\n<think></think>\nHello, how can I help you<|user|>\nTell me",
        True,
        CHAT,
        "reasoning-pruned",
    ),
    (
        "gpt-oss: the analysis channel is dropped once a final answer follows",
        "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant",
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>",
        False,
        TOOLED,
        "reasoning-pruned",
    ),
    (
        "Kimi-K2-Thinking: an emptied think block appears in history",
        "<|im_assistant|>assistant<|im_middle|>Hello, how can I help you<|im_end|>",
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello, how can I help you",
        True,
        CHAT,
        "reasoning-pruned",
    ),
    (
        "QwQ: the generation prompt pre-fills <think> that history never renders",
        "<|im_start|>assistant\n<think>\nHello, how can I help you<|im_end|>",
        "<|im_start|>assistant\nHello, how can I help you<|im_end|>\n<|im_start|>user",
        False,
        [m for m in CHAT if m["role"] != "assistant"],
        "generation-prompt-mismatch",
    ),
    (
        "DeepSeek-V3.2 non-thinking: <think></think> in the prompt, </think> in history",
        "Hi there!<｜Assistant｜><think></think>Hello, how can I help you",
        "Hi there!<｜Assistant｜></think>Hello, how can I help you<｜end▁of▁sentence｜>",
        False,
        CHAT,
        "generation-prompt-mismatch",
    ),
    (
        "vLLM DeepSeek-V3.1: indentation leaks around the assistant tag",
        "Hi there!  <｜Assistant｜>    </think>Hello",
        "Hi there!      <｜Assistant｜></think>      Hello",
        False,
        CHAT,
        "generation-prompt-mismatch",
    ),
    (
        "DeepSeek-R1 distill: the prompt's newline after tool outputs is not in history",
        "<｜tool▁outputs▁end｜>\nHello, how can I help you<｜end▁of▁sentence｜>",
        "<｜tool▁outputs▁end｜>Hello, how can I help you<｜end▁of▁sentence｜><｜User｜>",
        False,
        CHAT,
        "generation-prompt-mismatch",
    ),
    (
        "Mistral: the tools block moves to the last user message",
        '<s>[AVAILABLE_TOOLS] [{"type": "function"}][/AVAILABLE_TOOLS][INST] Hi there![/INST]',
        "<s>[INST] Hi there![/INST] Hello, how can I help you</s>[AVAILABLE_TOOLS]",
        False,
        CHAT,
        "moved-block",
    ),
    (
        "Mistral: the system prompt moves to the last user message",
        "<s>[INST] Be brief and kind to everyone.\n\nHi there![/INST]",
        "<s>[INST] Hi there![/INST] Hello, how can I help you</s>[INST] Be brief",
        False,
        CHAT,
        "moved-block",
    ),
    (
        "Hermes: a tool result gains a newline once another message follows",
        "RESULT\n</tool_response><|im_end|><|im_start|>assistant\nIt is 18",
        "RESULT\n</tool_response>\n<|im_end|><|im_start|>assistant\nIt is 18",
        False,
        TOOLED,
        "look-ahead",
    ),
    (
        "Llama: the answer is trimmed",
        "<|end_header_id|>\n\n  Hello, how can I help you  <|eot_id|>",
        "<|end_header_id|>\n\nHello, how can I help you<|eot_id|><|start_header_id|>user",
        True,
        CHAT,
        "whitespace-normalized",
    ),
    (
        "strftime_now: the date in the system header changed",
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n",
        "Cutting Knowledge Date: December 2023\nToday Date: 27 Jul 2024\n\n",
        False,
        CHAT,
        "time-dependent",
    ),
    (
        "compact JSON arguments re-serialized with json.dumps spacing",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        True,
        TOOLED,
        "tool-call-reserialized",
    ),
    (
        "a tool call written in another syntax than the template's",
        '<think>Need the tool.</think><tool_call>\n{"name": "get_weather"}</tool_call>',
        '<think>Need the tool.</think>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        True,
        TOOLED,
        "tool-call-reserialized",
    ),
    (
        "anything else in the answer",
        "<|im_start|>assistant\nHello, how can I help you",
        "<|im_start|>assistant\nHELLO, HOW CAN I HELP YOU",
        True,
        CHAT,
        "output-rerendered",
    ),
    (
        "anything else in history",
        "<|im_start|>user\nHi there!<|im_end|>",
        "<|im_start|>user\nHi you!<|im_end|>",
        False,
        CHAT,
        "history-rerendered",
    ),
]


@pytest.mark.parametrize(
    ("expected", "actual", "in_output", "messages", "hazard"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_hazard_names(
    expected: str, actual: str, in_output: bool, messages: list[dict[str, Any]], hazard: str
) -> None:
    got, detail = classify_drift(
        expected_text=expected, actual_text=actual, in_output=in_output, messages=messages
    )
    assert got == hazard, detail
    assert got in HAZARDS and detail


def test_every_hazard_has_a_case_and_a_description() -> None:
    assert {case[-1] for case in CASES} == set(HAZARDS)
    assert all(HAZARDS.values())


def test_detail_quotes_both_sides() -> None:
    _, detail = classify_drift(
        expected_text="<|channel|>final<|message|>ok<|return|>",
        actual_text="<|channel|>final<|message|>ok<|end|><|start|>user",
        in_output=True,
    )
    assert "<|return|>" in detail and "<|end|>" in detail


def test_empty_or_identical_windows_do_not_crash() -> None:
    assert classify_drift(expected_text="", actual_text="", in_output=True)[0] == "retokenized"
    assert classify_drift(expected_text="abc", actual_text="abc", in_output=False)[0] == (
        "retokenized"
    )
