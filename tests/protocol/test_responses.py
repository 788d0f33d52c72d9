"""The Responses API codec (:mod:`agentkv.protocol.responses`): a Responses request as the Chat
Completions body vLLM 0.33's chat path would run, and a chat answer (whole or streamed) as a
``response`` object or Responses events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentkv.protocol.errors import APIError
from agentkv.protocol.responses import (
    history_items,
    last_response_of,
    new_response_id,
    not_found_error,
    response_of_item,
    responses_to_chat,
)
from agentkv.protocol.responses_output import chat_to_response
from agentkv.protocol.responses_stream import ResponsesEncoder

SESSION = "01a23591-27a5-7ca3-8f3f-9e92577e7fdd"


def fn_tool(name: str, **props: str) -> dict[str, Any]:
    return {
        "type": "function",
        "name": name,
        "description": f"The {name} tool.",
        "strict": False,
        "parameters": {"type": "object", "properties": {k: {"type": v} for k, v in props.items()}},
    }


def codex_request() -> dict[str, Any]:
    """What Codex CLI 0.171 sends on its second request of a turn (captured shape): developer
    and user messages with ``input_text`` parts, the model's reasoning and function call, the
    call's output; function tools, a namespace of tools and the built-in ``web_search``."""
    text = lambda t: [{"type": "input_text", "text": t}]  # noqa: E731
    return {
        "model": "agentkv-sim",
        "stream": True,
        "input": [
            {"type": "message", "id": "msg_a", "role": "developer", "content": text("Be a coder.")},
            {"type": "message", "role": "user", "content": text("<environment_context/>")},
            {"type": "message", "role": "user", "content": text("list the files")},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "I should list them."}],
                "encrypted_content": None,
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "name": "exec_command",
                "arguments": '{"cmd":"ls"}',
                "call_id": "call_1",
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"},
        ],
        "tools": [
            fn_tool("exec_command", cmd="string"),
            fn_tool("view_image", path="string"),
            {
                "type": "namespace",
                "name": "multi_agent_v1",
                "description": "Agents.",
                "tools": [fn_tool("spawn_agent", task="string"), fn_tool("wait_agent")],
            },
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": SESSION,
        "client_metadata": {"session_id": SESSION, "x-codex-window-id": f"{SESSION}:0"},
    }


# -- request -> chat ---------------------------------------------------------------------------
def test_codex_request_maps_onto_the_chat_path() -> None:
    chat = responses_to_chat(codex_request())
    assert chat["messages"] == [
        {"role": "developer", "content": [{"type": "text", "text": "Be a coder."}]},
        {"role": "user", "content": [{"type": "text", "text": "<environment_context/>"}]},
        {"role": "user", "content": [{"type": "text", "text": "list the files"}]},
        {  # the reasoning and the call it led to: one assistant message (vLLM merges them)
            "role": "assistant",
            "reasoning": "I should list them.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'},
                }
            ],
        },
        {"role": "tool", "content": "a.py\nb.py", "tool_call_id": "call_1"},
    ]
    names = [t["function"]["name"] for t in chat["tools"]]
    # namespace functions flattened; the built-in web_search never shown to the model
    assert names == [
        "exec_command",
        "view_image",
        "multi_agent_v1__spawn_agent",
        "multi_agent_v1__wait_agent",
    ]
    assert chat["tools"][0] == {
        "type": "function",
        "function": {
            "name": "exec_command",
            "description": "The exec_command tool.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
            "strict": False,
        },
    }
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is True
    assert chat["prompt_cache_key"] == SESSION  # the router's conversation id
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat["model"] == "agentkv-sim"
    for dropped in ("input", "store", "include", "client_metadata", "reasoning", "instructions"):
        assert dropped not in chat
    assert "reasoning_effort" not in chat and "chat_template_kwargs" not in chat


def test_instructions_string_input_and_sampling() -> None:
    chat = responses_to_chat(
        {
            "instructions": "Be terse.",
            "input": "Hi",
            "max_output_tokens": 50,
            "temperature": 0.2,
            "top_p": 0.9,
            "seed": 7,
            "metadata": {"k": "v"},
            "reasoning": {"effort": "low"},
            "text": {
                "format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}
            },
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 3,
            "session_id": "s1",
        }
    )
    assert chat["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
    ]
    assert chat["max_tokens"] == 50 and chat["temperature"] == 0.2 and chat["top_p"] == 0.9
    assert chat["seed"] == 7 and chat["session_id"] == "s1" and "metadata" not in chat
    assert chat["tool_choice"] == "none"  # no tools: vLLM's check_tool_usage
    assert chat["reasoning_effort"] == "low"
    assert chat["chat_template_kwargs"] == {"reasoning_effort": "low", "enable_thinking": True}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}},
    }
    assert chat["logprobs"] is True and chat["top_logprobs"] == 3
    assert "stream" not in chat
    # effort none turns thinking off, unless the client's own kwargs say otherwise
    off = responses_to_chat({"input": "x", "reasoning": {"effort": "none"}})
    assert off["chat_template_kwargs"]["enable_thinking"] is False
    mine = responses_to_chat(
        {
            "input": "x",
            "reasoning": {"effort": "none"},
            "chat_template_kwargs": {"enable_thinking": True},
        }
    )
    assert mine["chat_template_kwargs"]["enable_thinking"] is True


def test_previous_items_come_first_without_their_instructions() -> None:
    first = {"instructions": "Old rules.", "input": "Q1"}
    answer = chat_to_response(
        {"choices": [{"message": {"content": "A1"}, "finish_reason": "stop"}]}, first
    )
    previous = history_items(None, first, answer)
    assert [i.get("role") for i in previous] == ["user", "assistant"]
    chat = responses_to_chat(
        {"instructions": "New rules.", "input": "Q2"},
        [{"role": "system", "content": "dropped"}, *previous],
    )
    assert chat["messages"] == [
        {"role": "system", "content": "New rules."},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]


def test_assistant_items_merge_as_vllm_merges_them() -> None:
    chat = responses_to_chat(
        {
            "input": [
                {"role": "user", "content": "go"},
                {
                    "type": "reasoning",
                    "summary": [{"type": "summary_text", "text": "from the summary"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Calling two."}],
                },
                {"type": "function_call", "call_id": "c1", "name": "a", "arguments": "{}"},
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "name": "spawn",
                    "namespace": "agents",
                    "arguments": "{}",
                },
                {"type": "function_call_output", "call_id": "c1", "output": "1"},
                {"type": "function_call_output", "call_id": "c2", "output": "2"},
                {"role": "assistant", "content": "Plain text answer."},
            ]
        }
    )
    _, assistant, tool1, tool2, last = chat["messages"]
    assert assistant["reasoning"] == "from the summary"
    assert assistant["content"] == "Calling two."
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["a", "agents__spawn"]
    assert (tool1["tool_call_id"], tool2["tool_call_id"]) == ("c1", "c2")
    assert last == {"role": "assistant", "content": "Plain text answer."}


def test_custom_tools_are_a_one_string_function() -> None:
    tool = {"type": "custom", "name": "apply_patch", "description": "Patch files."}
    chat = responses_to_chat(
        {
            "tools": [tool],
            "tool_choice": {"type": "custom", "name": "apply_patch"},
            "input": [
                {"role": "user", "content": "fix"},
                {"type": "custom_tool_call", "call_id": "c", "name": "apply_patch", "input": "é"},
                {"type": "custom_tool_call_output", "call_id": "c", "output": "done"},
            ],
        }
    )
    fn = chat["tools"][0]["function"]
    assert fn["name"] == "apply_patch" and fn["parameters"]["required"] == ["input"]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "apply_patch"}}
    call = chat["messages"][1]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"input": "é"}
    assert "é" in call["function"]["arguments"]  # ensure_ascii=False, as vLLM
    assert chat["messages"][2] == {"role": "tool", "content": "done", "tool_call_id": "c"}
    # and back: a call of the shim is a custom_tool_call with the payload
    answer = {
        "choices": [
            {
                "message": {
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "k",
                            "type": "function",
                            "function": {"name": "apply_patch", "arguments": '{"input": "diff"}'},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ]
    }
    (item,) = chat_to_response(answer, {"tools": [tool]})["output"]
    assert item["type"] == "custom_tool_call" and item["input"] == "diff"
    assert item["call_id"] == "k" and item["id"].startswith("ctc_")


def test_named_tool_choice_resolves_namespaces() -> None:
    tools = [
        {"type": "namespace", "name": "a", "tools": [fn_tool("run"), fn_tool("only_a")]},
        {"type": "namespace", "name": "b", "tools": [fn_tool("run")]},
    ]
    pick = lambda name: responses_to_chat(  # noqa: E731
        {"input": "x", "tools": tools, "tool_choice": {"type": "function", "name": name}}
    )["tool_choice"]["function"]["name"]
    assert pick("only_a") == "a__only_a"
    assert pick("b__run") == "b__run"
    with pytest.raises(APIError, match="ambiguous"):
        pick("run")
    with pytest.raises(APIError, match="not found"):
        pick("nope")


def test_a_partial_assistant_message_is_continued() -> None:
    chat = responses_to_chat(
        {
            "input": [
                {"role": "user", "content": "Count"},
                {
                    "type": "message",
                    "role": "assistant",
                    "status": "incomplete",
                    "content": [{"type": "output_text", "text": "1, 2,"}],
                },
            ]
        }
    )
    assert chat["add_generation_prompt"] is False and chat["continue_final_message"] is True
    assert "add_generation_prompt" not in responses_to_chat({"input": "x"})


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "Unsupported input item"),
        (
            {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
            "input",
            "Encrypted content",
        ),
        ({"input": 5}, "input", "must be a string or a list"),
        ({"input": []}, "input", "must not be empty"),
        (
            {
                "input": "x",
                "tools": [{"type": "custom", "name": "p", "format": {"type": "grammar"}}],
            },
            "tools",
            "grammar",
        ),
        (
            {
                "input": "x",
                "tools": [{"type": "web_search"}],
                "tool_choice": {"type": "web_search"},
            },
            "tool_choice",
            "built-in",
        ),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "must be specified with"),
        (
            {"input": "x", "tool_choice": {"type": "function", "name": "f"}},
            "tool_choice",
            "not found",
        ),
        ({"input": "x", "background": True}, "background", "Background"),
        ({"input": "x", "background": True, "store": False}, "background", "store"),
        ({"input": "x", "prompt": {"id": "p"}}, "prompt", "prompt template"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"input": "x", "include": ["everything"]}, "include", "must be a list of"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "positive"),
        ({"input": "x", "temperature": 3}, "temperature", "between"),
        ({"input": "x", "stream": "yes"}, "stream", "boolean"),
        ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning.effort", "one of"),
        ({"input": "x", "previous_response_id": ""}, "previous_response_id", "non-empty"),
    ],
)
def test_refusals_say_what_and_where(body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(APIError) as refused:
        responses_to_chat(body)
    assert refused.value.status == 400
    assert refused.value.param == param
    assert message in refused.value.message


def test_not_found_is_openais_error() -> None:
    body = not_found_error("resp_x").body()
    assert body == {
        "error": {
            "message": "Previous response with id 'resp_x' not found.",
            "type": "invalid_request_error",
            "param": "previous_response_id",
            "code": "previous_response_not_found",
        }
    }


# -- chat answer -> response ---------------------------------------------------------------------
def tool_answer(finish: str = "tool_calls") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "created": 1700000000,
        "model": "agentkv-sim",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Let me look.",
                    "reasoning": "Need the listing.",
                    "tool_calls": [
                        {
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'},
                        },
                        {
                            "id": "call_10",
                            "type": "function",
                            "function": {"name": "multi_agent_v1__wait_agent", "arguments": "{}"},
                        },
                    ],
                },
                "finish_reason": finish,
            }
        ],
        "usage": {
            "prompt_tokens": 100,
            "completion_tokens": 20,
            "total_tokens": 120,
            "prompt_tokens_details": {"cached_tokens": 64},
            "completion_tokens_details": {"reasoning_tokens": 5},
        },
        "kv_transfer_params": None,
    }


def test_chat_answer_as_a_response() -> None:
    request = codex_request()
    rid = new_response_id()
    response = chat_to_response(tool_answer(), request, response_id=rid)
    assert response["id"] == rid and response["object"] == "response"
    assert response["status"] == "completed" and response["incomplete_details"] is None
    assert response["model"] == "agentkv-sim" and response["created_at"] == 1700000000
    reasoning, message, call, namespaced = response["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Need the listing."}]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["status"] == "completed"
    assert message["content"] == [
        {"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}
    ]
    assert call["type"] == "function_call" and call["call_id"] == "call_9"
    assert call["name"] == "exec_command" and call["arguments"] == '{"cmd":"ls"}'
    assert "namespace" not in call
    assert namespaced["name"] == "wait_agent" and namespaced["namespace"] == "multi_agent_v1"
    assert response["usage"] == {
        "input_tokens": 100,
        "input_tokens_details": {"cached_tokens": 64},
        "output_tokens": 20,
        "output_tokens_details": {"reasoning_tokens": 5},
        "total_tokens": 120,
    }
    assert response["prompt_cache_key"] == SESSION and response["store"] is False
    assert response["tools"] == request["tools"] and response["parallel_tool_calls"] is True
    # every item id names its response, so an item sent back finds its chain
    assert {response_of_item(i["id"]) for i in response["output"]} == {rid}
    assert last_response_of([{"role": "user"}, *response["output"], {"id": "x"}]) == rid
    assert response_of_item("fc_1") is None and response_of_item(None) is None
    assert len({i["id"] for i in response["output"]}) == 4


def test_a_length_cut_is_incomplete() -> None:
    response = chat_to_response(tool_answer("length"), {"input": "x"})
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    statuses = [i.get("status") for i in response["output"]]
    assert statuses == [None, "completed", "completed", "incomplete"]


def test_output_items_sent_back_render_the_same_assistant_message() -> None:
    """A stateless client's next input holds the output items: they must come back as the
    assistant message the engine generated (the router's KV reuse depends on it)."""
    response = chat_to_response(tool_answer(), {"input": "x"})
    chat = responses_to_chat({"input": [{"role": "user", "content": "x"}, *response["output"]]})
    generated = tool_answer()["choices"][0]["message"]
    (assistant,) = chat["messages"][1:]
    assert assistant["reasoning"] == generated["reasoning"]
    assert assistant["content"] == generated["content"]
    assert assistant["tool_calls"] == generated["tool_calls"]


# -- the stream ----------------------------------------------------------------------------------
def events_of(frames: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for frame in b"".join(frames).decode().split("\n\n")[:-1]:
        head, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"id": "c", "model": "agentkv-sim", "created": 1, "choices": [choice]}


def stream(encoder: ResponsesEncoder, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    frames: list[bytes] = []
    for c in chunks:
        frames += encoder.chunk(c)
    frames += encoder.done()
    return events_of(frames)


def call_delta(index: int, **fn: Any) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": fn}
    if "name" in fn:
        call.update(id=f"call_{index}", type="function")
    return {"tool_calls": [call]}


def test_stream_events_as_vllm_emits_them() -> None:
    encoder = ResponsesEncoder(codex_request())
    usage = {
        "prompt_tokens": 10,
        "completion_tokens": 7,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    events = stream(
        encoder,
        [
            chunk({"role": "assistant", "content": ""}),
            chunk({"reasoning": "Think"}),
            chunk({"reasoning": "ing."}),
            chunk({"content": "Calling."}),
            chunk(call_delta(0, name="exec_command", arguments="")),
            chunk(call_delta(0, arguments='{"cmd":')),
            chunk(call_delta(0, arguments='"ls"}')),
            chunk(call_delta(1, name="multi_agent_v1__wait_agent", arguments="{}")),
            chunk({}, "tool_calls"),
            {"id": "c", "model": "agentkv-sim", "choices": [], "usage": usage},
        ],
    )
    types = [e["type"] for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == [] and events[0]["response"]["usage"] is None
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in done] == [0, 1, 2, 3]
    args_done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert args_done[0]["arguments"] == '{"cmd":"ls"}' and args_done[0]["name"] == "exec_command"
    assert args_done[1]["name"] == "wait_agent"
    final = events[-1]["response"]
    assert final is encoder.final or final == encoder.final
    assert final["status"] == "completed" and final["id"] == encoder.id
    assert final["output"] == [e["item"] for e in done]
    assert final["output"][3]["namespace"] == "multi_agent_v1"
    assert final["output"][2]["call_id"] == "call_0"
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 8
    assert final["usage"]["total_tokens"] == 17
    # the streamed items' ids are the ones of the completed response
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [i["id"] for i in final["output"]]


def test_stream_cut_by_length_is_incomplete() -> None:
    events = stream(
        ResponsesEncoder({"input": "x"}), [chunk({"content": "Once upon"}), chunk({}, "length")]
    )
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"


def test_stream_error_fails_the_response_once() -> None:
    encoder = ResponsesEncoder({"input": "x"})
    frames = encoder.chunk(chunk({"content": "Half"}))
    frames += encoder.stream_error({"message": "D broke.", "type": "BadGatewayError", "code": 502})
    frames += encoder.stream_error({"message": "again", "code": 502})
    frames += encoder.done()  # the [DONE] after the error: nothing more
    events = events_of(frames)
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["code"] == "server_error" and events[-2]["message"] == "D broke."
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "D broke."}
    assert encoder.final is None
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_an_empty_stream_still_completes() -> None:
    encoder = ResponsesEncoder({"input": "x"})
    events = events_of(encoder.done())
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.completed",
    ]
    assert events[-1]["response"]["output"] == []
