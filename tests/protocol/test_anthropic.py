"""The Messages codec (``agentkv.protocol.anthropic``) against vLLM 0.33's mapping
(``vllm/entrypoints/anthropic/serving.py``): each expected value here is what vLLM's
``to_chat_completion_request``, ``messages_full_converter`` and ``message_stream_converter``
produce for the same input, read off its source."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from agentkv.protocol import anthropic as a
from tests._support.tools import chat_tool

BILLING = "x-anthropic-billing-header: cc_version=2.1.197.123; cc_entrypoint=sdk-cli; cch=9f3a1;"
REMINDER = (
    "<system-reminder>\nAs you answer the user's questions, you can use the following context:\n"
    "# currentDate\nToday's date is 2026-12-02.\n</system-reminder>\n\n"
)
BASH = {
    "name": "Bash",
    "description": "Executes a given bash command and returns its output.",
    "input_schema": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The command to execute"},
            "description": {"type": "string"},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
}
READ = {
    "name": "Read",
    "description": "Reads a file from the local filesystem.",
    # no "type": vLLM's validator makes it an object schema
    "input_schema": {"properties": {"file_path": {"type": "string"}}, "required": ["file_path"]},
}


def claude_code_request() -> dict[str, Any]:
    """A second turn of Claude Code 2.1.197 (``claude -p``), captured against a local router and
    trimmed: 2 of its 24 tools, a shorter system prompt, one tool_use / tool_result round."""
    return {
        "model": "agentkv-sim",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": REMINDER},
                    {
                        "type": "text",
                        "text": "list the files",
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            },
            {"role": "system", "content": "Available agent types for the Agent tool: claude."},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I will run ls.", "signature": "c2ln"},
                    {"type": "text", "text": "Let me look."},
                    {
                        "type": "tool_use",
                        "id": "toolu_01",
                        "name": "Bash",
                        "input": {"command": "ls -la", "description": "List files"},
                        "caller": {"type": "direct"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01",
                        "content": [
                            {"type": "text", "text": "a.py"},
                            {"type": "text", "text": "b.txt"},
                        ],
                        "is_error": False,
                        "cache_control": {"type": "ephemeral"},
                    },
                    {
                        "type": "text",
                        "text": "<system-reminder>Todo list is empty.</system-reminder>",
                    },
                ],
            },
        ],
        "system": [
            {"type": "text", "text": BILLING},
            {
                "type": "text",
                "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK.",
                "cache_control": {"type": "ephemeral"},
            },
            {
                "type": "text",
                "text": "\nYou are an interactive agent that helps with software engineering.",
                "cache_control": {"type": "ephemeral"},
            },
        ],
        "tools": [BASH, READ],
        "metadata": {
            "user_id": '{"device_id":"5f88","account_uuid":"","session_id":"30050420-9bbc"}'
        },
        "max_tokens": 32000,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
    }


SYSTEM_TEXT = (
    "You are a Claude agent, built on Anthropic's Claude Agent SDK."
    "\nYou are an interactive agent that helps with software engineering."
)
CHAT_TOOLS = [
    chat_tool("Bash", BASH["description"], BASH["input_schema"]),
    chat_tool("Read", READ["description"], {**READ["input_schema"], "type": "object"}),
]


def test_claude_code_request_maps_as_vllm_maps_it():
    chat = a.messages_to_chat(claude_code_request())
    assert chat == {
        "model": "agentkv-sim",
        "messages": [
            # the billing header dropped, the other text blocks joined with nothing between
            {"role": "system", "content": SYSTEM_TEXT},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": REMINDER},
                    {"type": "text", "text": "list the files"},
                ],
            },
            # kept in place: the template accepts it (merge_inline_system=False)
            {"role": "system", "content": "Available agent types for the Agent tool: claude."},
            {
                "role": "assistant",
                "reasoning": "I will run ls.",
                "tool_calls": [
                    {
                        "id": "toolu_01",
                        "type": "function",
                        "function": {
                            "name": "Bash",
                            "arguments": '{"command": "ls -la", "description": "List files"}',
                        },
                    }
                ],
                "content": "Let me look.",
            },
            # the tool result first, then what is left of the user message
            {"role": "tool", "tool_call_id": "toolu_01", "content": "a.py\nb.txt"},
            {"role": "user", "content": "<system-reminder>Todo list is empty.</system-reminder>"},
        ],
        "max_tokens": 32000,
        "max_completion_tokens": 32000,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        # output_config.effort; the template sees it, and thinking on (build_chat_params)
        "reasoning_effort": "high",
        "chat_template_kwargs": {"reasoning_effort": "high", "enable_thinking": True},
        "tool_choice": "auto",
        "tools": CHAT_TOOLS,
    }
    # metadata, thinking (adaptive), context_management and cache_control leave no trace


def test_inline_system_messages_merge_into_the_leading_one():
    chat = a.messages_to_chat(claude_code_request(), merge_inline_system=True)
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert chat["messages"][0]["content"] == (
        SYSTEM_TEXT + "Available agent types for the Agent tool: claude."
    )


def test_billing_header_and_empty_system_messages_are_dropped():
    body = {
        "model": "m",
        "max_tokens": 8,
        "system": BILLING,  # a string is kept whole (vLLM strips only blocks)
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": BILLING},
            {"role": "system", "content": [{"type": "text", "text": BILLING}]},
            {
                "role": "system",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
    }
    chat = a.messages_to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": BILLING},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "ab"},
    ]
    assert a.messages_to_chat({**body, "system": [{"type": "text", "text": BILLING}]})["messages"][
        0
    ] == {"role": "user", "content": "hi"}


def _chat(**extra: Any) -> dict[str, Any]:
    return a.messages_to_chat(
        {"model": "m", "max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}], **extra}
    )


def test_sampling_fields_and_what_is_dropped():
    chat = _chat(
        stop_sequences=["END"],
        temperature=0.2,
        top_p=0.9,
        top_k=40,
        metadata={"user_id": "u"},
        cache_salt="s1",
        conversation_id="c1",
        agentkv_sim={"content": "x"},
        service_tier="auto",
    )
    assert chat == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2048,
        "max_completion_tokens": 2048,
        "stop": ["END"],
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 40,
        "cache_salt": "s1",
        "conversation_id": "c1",
        "agentkv_sim": {"content": "x"},
    }
    assert "stream" not in _chat(stream=False)


@pytest.mark.parametrize(
    ("thinking", "effort", "expected"),
    [
        ({"type": "disabled"}, None, {"reasoning_effort": "none", "enable_thinking": False}),
        # disabled wins over output_config.effort (vLLM handles thinking after output_config)
        ({"type": "disabled"}, "high", {"reasoning_effort": "none", "enable_thinking": False}),
        ({"type": "adaptive"}, "low", {"reasoning_effort": "low", "enable_thinking": True}),
        ({"type": "adaptive"}, None, None),
    ],
)
def test_thinking_and_effort(thinking, effort, expected):
    extra: dict[str, Any] = {"thinking": thinking}
    if effort:
        extra["output_config"] = {"effort": effort}
    chat = _chat(**extra)
    assert chat.get("chat_template_kwargs") == expected
    assert chat.get("reasoning_effort") == (expected or {}).get("reasoning_effort")


def test_thinking_disabled_uses_the_probed_effort_and_keeps_the_clients_kwargs():
    body = {
        "model": "m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "disabled"},
        "chat_template_kwargs": {"enable_thinking": True, "x": 1},
    }
    chat = a.messages_to_chat(body, disabled_thinking_effort="low")
    assert chat["reasoning_effort"] == "low"
    assert chat["chat_template_kwargs"] == {
        "enable_thinking": True,
        "x": 1,
        "reasoning_effort": "low",
    }
    assert a.parse_request(body).thinking_disabled


def test_thinking_budget():
    assert (
        _chat(thinking={"type": "enabled", "budget_tokens": 1024})["thinking_token_budget"] == 1024
    )
    with pytest.raises(a.BadRequest, match="budget_tokens must be less than max_tokens"):
        _chat(thinking={"type": "enabled", "budget_tokens": 4096})
    with pytest.raises(a.BadRequest, match="thinking"):
        _chat(thinking={"type": "enabled", "budget_tokens": 100})


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "any"}, "required", True),
        ({"type": "none", "disable_parallel_tool_use": False}, "none", True),
        (
            {"type": "tool", "name": "Bash", "disable_parallel_tool_use": True},
            {"type": "function", "function": {"name": "Bash"}},
            False,
        ),
    ],
)
def test_tool_choice(choice, expected, parallel):
    chat = _chat(tools=[BASH], tool_choice=choice)
    assert chat["tool_choice"] == expected and chat["parallel_tool_calls"] is parallel
    assert chat["tools"] == CHAT_TOOLS[:1]


def test_tools_serialized_as_vllm_renders_them():
    tool = {"name": "T", "input_schema": {"type": "object"}, "strict": True}
    assert _chat(tools=[tool])["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "T",
                "description": None,
                "parameters": {"type": "object"},
                "strict": True,
            },
        }
    ]
    no_tools = _chat(tool_choice={"type": "auto"})
    assert no_tools["tool_choice"] == "auto" and "tools" not in no_tools


def test_tool_addition_and_removal():
    deferred = {**READ, "defer_loading": True}
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "system",
            "content": [
                {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "Read"}},
                {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "Bash"}},
                {
                    "type": "tool_addition",
                    "tool": {
                        "type": "tool_definition",
                        "definition": {"name": "New", "input_schema": {}},
                    },
                },
            ],
        },
    ]
    chat = a.messages_to_chat(
        {"model": "m", "max_tokens": 8, "messages": messages, "tools": [BASH, deferred]}
    )
    assert [t["function"]["name"] for t in chat["tools"]] == ["Read", "New"]
    assert "defer_loading" not in chat["tools"][0]["function"]
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    unknown = [messages[0], {"role": "system", "content": [messages[1]["content"][1]]}]
    with pytest.raises(a.BadRequest, match="not declared"):
        a.messages_to_chat({"model": "m", "max_tokens": 8, "messages": unknown})
    with pytest.raises(a.BadRequest, match="only allowed in messages with role"):
        a.messages_to_chat(
            {
                "model": "m",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": messages[1]["content"]}],
            }
        )


def test_images_and_tool_results():
    png = {"type": "base64", "media_type": "image/png", "data": "iVBO"}
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "source": png},
                {"type": "image", "source": {"type": "url", "url": "https://x/y.jpg"}},
                {"type": "text", "text": "what is this?"},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "é.png"}},
                {"type": "tool_result", "tool_use_id": "t0", "content": "inline"},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [
                        {"type": "text", "text": "an image"},
                        {"type": "image", "source": png},
                        {"type": "tool_reference", "tool_name": "Bash"},
                    ],
                },
                {"type": "tool_result", "content": "no id"},
            ],
        },
    ]
    chat = a.messages_to_chat({"model": "m", "max_tokens": 8, "messages": messages})
    assert chat["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                {"type": "image_url", "image_url": {"url": "https://x/y.jpg"}},
                {"type": "text", "text": "what is this?"},
            ],
        },
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    # json.dumps as vLLM writes it: ASCII escapes, ", " and ": "
                    "function": {"name": "Read", "arguments": '{"file_path": "\\u00e9.png"}'},
                }
            ],
            "content": "Tool result: inline",
        },
        {"role": "tool", "tool_call_id": "t1", "content": "an image"},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}],
        },
        {
            "role": "tool",
            "tool_call_id": "t1",
            "content": [{"type": "tool_reference", "name": "Bash"}],
        },
        {"role": "tool", "tool_call_id": "", "content": "no id"},
    ]


def test_count_tokens_request():
    body = claude_code_request()
    for key in ("max_tokens", "stream", "metadata", "context_management"):
        body.pop(key)
    chat = a.messages_to_chat(body, count_tokens=True)
    assert "max_tokens" not in chat and "stream" not in chat
    assert a.count_tokens_body(chat) == {
        "model": "agentkv-sim",
        "messages": chat["messages"],
        "tools": CHAT_TOOLS,
        "chat_template_kwargs": {"reasoning_effort": "high", "enable_thinking": True},
    }
    with pytest.raises(a.BadRequest, match="max_tokens"):
        a.messages_to_chat(body)


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 8}, "model"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            {"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
            "max_tokens",
        ),
        (
            {"model": "m", "max_tokens": 8, "messages": [{"role": "tool", "content": "x"}]},
            "messages.0.role",
        ),
        (
            {
                "model": "m",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": [{"type": "video"}]}],
            },
            "messages.0",
        ),
        (
            {"model": "m", "max_tokens": 8, "messages": [], "stop_sequences": ["a"] * 5},
            "stop_sequences",
        ),
        (
            {"model": "m", "max_tokens": 8, "messages": [], "tool_choice": {"type": "tool"}},
            "tool_choice",
        ),
        ({"model": "", "max_tokens": 8, "messages": []}, "model"),
    ],
)
def test_invalid_requests(body, where):
    with pytest.raises(a.BadRequest, match=where.replace(".", r"\.")):
        a.messages_to_chat(body)


# -- answers -----------------------------------------------------------------------------------
def chat_answer(message: dict[str, Any], finish: str = "stop", **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-abc123",
        "object": "chat.completion",
        "model": "agentkv-sim",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, **extra}],
        "usage": {
            "prompt_tokens": 100,
            "completion_tokens": 7,
            "total_tokens": 107,
            "prompt_tokens_details": {"cached_tokens": 64},
        },
        "kv_transfer_params": None,
    }


def test_text_answer():
    out = a.chat_to_message(chat_answer({"role": "assistant", "content": "Hello."}))
    assert out == {
        "id": "msg_abc123",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "Hello."}],
        "model": "agentkv-sim",
        "stop_reason": "end_turn",
        # input_tokens excludes the cache reads (vLLM's _build_anthropic_usage)
        "usage": {"input_tokens": 36, "output_tokens": 7, "cache_read_input_tokens": 64},
    }


def test_thinking_and_tool_calls_answer():
    message = {
        "role": "assistant",
        "content": "Running it.",
        "reasoning": "Need ls.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "Bash", "arguments": '{"command": "ls"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "Read", "arguments": "{}"}},
        ],
    }
    out = a.chat_to_message(chat_answer(message, "tool_calls"))
    thinking, text, *calls = out["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == "Need ls."
    assert len(thinking["signature"]) == 32
    assert text == {"type": "text", "text": "Running it."}
    assert calls == [
        {"type": "tool_use", "id": "call_1", "name": "Bash", "input": {"command": "ls"}},
        {"type": "tool_use", "id": "call_2", "name": "Read", "input": {}},
    ]
    assert out["stop_reason"] == "tool_use"
    # a forced tool call finishes with "stop" in the chat layer: still tool_use
    assert a.chat_to_message(chat_answer(message, "stop"))["stop_reason"] == "tool_use"
    legacy = {"role": "assistant", "content": None, "reasoning_content": "old name"}
    assert a.chat_to_message(chat_answer(legacy))["content"][0]["thinking"] == "old name"
    with pytest.raises(ValueError, match="arguments"):
        bad = dict(
            message,
            tool_calls=[dict(message["tool_calls"][0], function={"name": "B", "arguments": "[1]"})],
        )
        a.chat_to_message(chat_answer(bad))


@pytest.mark.parametrize(
    ("finish", "stop_reason", "expected"),
    [
        ("length", None, ("max_tokens", None)),
        ("stop", "END", ("stop_sequence", "END")),
        ("stop", 151645, ("end_turn", None)),
        ("abort", None, (None, None)),
    ],
)
def test_stop_reasons(finish, stop_reason, expected):
    out = a.chat_to_message(
        chat_answer({"role": "assistant", "content": ""}, finish, stop_reason=stop_reason)
    )
    assert (out.get("stop_reason"), out.get("stop_sequence")) == expected
    # an empty completion is one empty text block, never []
    assert out["content"] == [{"type": "text", "text": ""}]


def test_usage_without_details():
    answer = chat_answer({"role": "assistant", "content": "x"})
    answer["usage"] = {
        "prompt_tokens": 10,
        "completion_tokens": None,
        "prompt_tokens_details": None,
    }
    assert a.chat_to_message(answer)["usage"] == {"input_tokens": 10, "output_tokens": 0}
    answer["usage"] = None
    assert a.chat_to_message(answer)["usage"] == {"input_tokens": 0, "output_tokens": 0}


# -- streams -----------------------------------------------------------------------------------
def events(frames: list[bytes]) -> list[dict[str, Any]]:
    """Each frame is ``event: <type>`` then ``data: <json>`` whose type matches."""
    out = []
    for frame in b"".join(frames).split(b"\n\n")[:-1]:
        head, data = frame.split(b"\n")
        event = orjson.loads(data.removeprefix(b"data: "))
        assert head == b"event: " + event["type"].encode()
        out.append(event)
    return out


def chunk(
    delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish, **extra}
    return {"id": "chatcmpl-s1", "model": "agentkv-sim", "choices": [choice]}


def call(
    index: int, arguments: str, id: str | None = None, name: str | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if id:
        out["id"], out["type"] = id, "function"
        out["function"]["name"] = name
    return {"tool_calls": [out]}


def block(index: int, start: dict[str, Any], *deltas: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of one content block: its start, its deltas, its stop."""
    return [
        {"type": "content_block_start", "index": index, "content_block": start},
        *({"type": "content_block_delta", "index": index, "delta": d} for d in deltas),
        {"type": "content_block_stop", "index": index},
    ]


def text_delta(text: str) -> dict[str, Any]:
    return {"type": "text_delta", "text": text}


def json_delta(partial: str) -> dict[str, Any]:
    return {"type": "input_json_delta", "partial_json": partial}


def tool_use(id: str, name: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": id, "name": name, "input": {}}


def test_stream_of_thinking_text_and_tool_calls():
    s = a.MessageStream()
    first = chunk({"role": "assistant", "content": ""})
    first["usage"] = {"prompt_tokens": 50, "completion_tokens": 0, "total_tokens": 50}
    frames = s.chunk(first)
    for c in [
        chunk({"reasoning": "Think"}),
        chunk({"reasoning": "ing."}),
        chunk({"content": "Hi "}),
        chunk({"content": "there."}),
        chunk(call(0, "", "call_1", "Bash")),
        chunk(call(0, '{"command": ')),
        chunk({"content": "held"}),  # text while a tool call is open: sent after it
        chunk(call(0, '"ls"}')),
        chunk(call(1, '{"file_path": "a"}', "call_2", "Read")),
        chunk({}, "tool_calls"),
        {
            "id": "chatcmpl-s1",
            "model": "agentkv-sim",
            "choices": [],
            "usage": {
                "prompt_tokens": 50,
                "completion_tokens": 9,
                "prompt_tokens_details": {"cached_tokens": 32},
            },
        },
    ]:
        frames += s.chunk(c)
    frames += s.done()
    out = events(frames)
    assert out[0] == {
        "type": "message_start",
        "message": {
            "id": "msg_s1",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": "agentkv-sim",
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 50, "output_tokens": 0},
        },
    }
    signature = out[4]["delta"]["signature"]
    assert len(signature) == 32
    text = {"type": "text", "text": ""}
    assert out[1:] == [
        *block(
            0,
            {"type": "thinking", "thinking": ""},
            {"type": "thinking_delta", "thinking": "Think"},
            {"type": "thinking_delta", "thinking": "ing."},
            {"type": "signature_delta", "signature": signature},
        ),
        *block(1, text, text_delta("Hi "), text_delta("there.")),
        *block(2, tool_use("call_1", "Bash"), json_delta('{"command": '), json_delta('"ls"}')),
        *block(3, text, text_delta("held")),
        *block(4, tool_use("call_2", "Read"), json_delta('{"file_path": "a"}')),
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"input_tokens": 18, "output_tokens": 9, "cache_read_input_tokens": 32},
        },
        {"type": "message_stop"},
    ]
    assert s.done() == [] and s.chunk(chunk({"content": "late"})) == []


def test_stream_stop_sequence_and_a_tool_call_cut_short():
    s = a.MessageStream()
    frames = s.chunk(chunk({"role": "assistant", "content": ""}))
    frames += s.chunk(chunk(call(0, '{"command": "l', "c1", "Bash")))
    frames += s.chunk(chunk({}, "stop", stop_reason="</call>"))
    frames += s.chunk(
        {"id": "x", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
    )
    frames += s.done()
    delta = next(e for e in events(frames) if e["type"] == "message_delta")
    # the stop string cut the call's JSON: it must not run
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "</call>"}


def test_stream_without_usage_chunk_still_ends_with_a_stop_reason():
    s = a.MessageStream()
    frames = s.chunk(chunk({"role": "assistant", "content": "Hi"}))
    frames += s.chunk(chunk({}, "length"))
    frames += s.done()
    kinds = [(e["type"], e.get("delta", {}).get("stop_reason")) for e in events(frames)]
    assert kinds == [
        ("message_start", None),
        ("content_block_start", None),
        ("content_block_delta", None),
        ("content_block_stop", None),
        ("message_delta", "max_tokens"),
        ("message_stop", None),
    ]


def test_stream_error_closes_the_open_block_and_ends_the_stream():
    s = a.MessageStream()
    frames = s.chunk(chunk({"role": "assistant", "content": ""}))
    frames += s.chunk(chunk({"reasoning": "hm"}))
    frames += s.error(503, "Engine overloaded.")
    assert s.done() == [] and s.error(500, "again") == []
    out = events(frames)
    assert [e["type"] for e in out] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",  # the thinking block's signature
        "content_block_stop",
        "error",
    ]
    assert out[-1] == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Engine overloaded."},
    }


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
    ],
)
def test_error_types(status, kind):
    assert a.error_body(status, "m") == {"type": "error", "error": {"type": kind, "message": "m"}}


def test_tool_arguments_are_json_dumps_bytes():
    """The arguments string is what the chat template renders: vLLM writes ``json.dumps``."""
    value = {"b": [1, 2], "a": "ü"}
    chat = _chat(
        messages=[
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "n", "input": value}],
            },
        ]
    )
    assert chat["messages"][1]["tool_calls"][0]["function"]["arguments"] == json.dumps(value)
