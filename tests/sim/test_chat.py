"""Chat completions with scripted model output (``agentkv_sim``), parsed the way vLLM 0.33
parses it, and streamed the way vLLM streams it.

Real Qwen3 tokenizer; templates: the packaged Qwen3 one (hermes tool calls) and the real
Qwen3-Coder one from ``shared/chat-templates`` (XML tool calls).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from agentkv.chat import load_template, load_tokenizer
from agentkv.sim import SimConfig, create_app
from agentkv.sim.costmodel import PRESETS
from agentkv.sim.transfer import TransferClient
from tests._support.templates import TEMPLATES_DIR
from tests._support.tools import chat_tool

pytestmark = pytest.mark.anyio

IM_END = 151645  # <|im_end|>
THINK, END_THINK = 151667, 151668  # <think>, </think>
CODER = TEMPLATES_DIR / "qwen3-coder.jinja"
MESSAGES = [{"role": "user", "content": "What's the weather in Paris for the next 3 days?"}]
TOOLS = [
    chat_tool(
        "get_weather",
        "Weather forecast for a city.",
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    )
]
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
REASONING = "The user wants a forecast; call the tool."
TOOL_SCRIPT = {"reasoning": REASONING, "content": "Let me check.", "tool_calls": [CALL]}

TOKENIZER = load_tokenizer()
TRANSFER = TransferClient()  # nothing here moves KV between instances
_TEMPLATES = {"qwen3": load_template(None, TOKENIZER)}
if CODER.is_file():
    _TEMPLATES["qwen3-coder"] = load_template(CODER, TOKENIZER)
FLAVOURS = ["qwen3", "qwen3-coder"]


@pytest.fixture
async def connect() -> AsyncIterator[Callable[[str], httpx.AsyncClient]]:
    """``connect(flavour)``: a fresh instance serving that template."""
    clients: list[httpx.AsyncClient] = []

    def make(flavour: str = "qwen3") -> httpx.AsyncClient:
        if flavour not in _TEMPLATES:
            pytest.skip(f"{CODER} is not checked out next to the repo")
        template = _TEMPLATES[flavour]
        path = str(CODER) if flavour == "qwen3-coder" else None
        cfg = SimConfig(time_scale=0.0, num_blocks=1024, template=path)
        app = create_app(
            cfg, tokenizer=TOKENIZER, template=template, cost=PRESETS["zero"], transfer=TRANSFER
        )
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim")
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()


async def chat(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert r.status_code == 200, r.text
    return r.json()


async def stream(client: httpx.AsyncClient, **body: Any) -> tuple[str, list[dict[str, Any]]]:
    """The raw SSE body and its JSON events (``[DONE]`` excluded)."""
    payload = {"messages": MESSAGES, "stream": True, **body}
    r = await client.post("/v1/chat/completions", json=payload)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = r.text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    events = [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]
    return r.text, events


def accumulate(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The message a client builds from the deltas (as the OpenAI SDK's stream helpers do)."""
    msg: dict[str, Any] = {"content": None, "reasoning": None}
    calls: dict[int, dict[str, Any]] = {}
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            for key in ("content", "reasoning"):
                if delta.get(key) is not None:
                    msg[key] = (msg[key] or "") + delta[key]
            for tc in delta.get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.get("id") or call["id"]
                call["name"] += tc.get("function", {}).get("name") or ""
                call["arguments"] += tc.get("function", {}).get("arguments") or ""
    msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


def tool_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls", [])
    ]


# -- scripted output, parsed --------------------------------------------------------------------
@pytest.mark.parametrize("flavour", FLAVOURS)
async def test_script_comes_back_as_reasoning_content_and_tool_call(connect, flavour):
    body = await chat(connect(flavour), tools=TOOLS, agentkv_sim=TOOL_SCRIPT, return_token_ids=True)
    (choice,) = body["choices"]
    message = choice["message"]
    assert message["reasoning"] == REASONING
    assert message["content"] == "Let me check."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert choice["finish_reason"] == "tool_calls"
    assert choice["token_ids"][0] == THINK and choice["token_ids"][-1] == IM_END


@pytest.mark.parametrize("flavour", FLAVOURS)
async def test_tool_call_markup_is_the_templates_own(connect, flavour):
    client = connect(flavour)
    body = await chat(client, tools=TOOLS, agentkv_sim=TOOL_SCRIPT, return_token_ids=True)
    r = await client.post("/detokenize", json={"tokens": body["choices"][0]["token_ids"]})
    raw = r.json()["prompt"]
    if flavour == "qwen3":
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in raw
    else:
        assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in raw


async def test_without_tools_the_markup_stays_in_the_content(connect):
    body = await chat(connect(), agentkv_sim=TOOL_SCRIPT)
    (choice,) = body["choices"]
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["content"].startswith("Let me check.<tool_call>")
    assert choice["finish_reason"] == "stop"


async def test_tool_choice_none_returns_no_tool_calls(connect):
    body = await chat(connect(), tools=TOOLS, tool_choice="none", agentkv_sim=TOOL_SCRIPT)
    (choice,) = body["choices"]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "script",
    [{"content": "It will be sunny and"}, {**TOOL_SCRIPT, "content": None}],
    ids=["content", "tool-call"],
)
async def test_length_script_has_no_end_of_turn(connect, script):
    body = await chat(
        connect(),
        tools=TOOLS,
        agentkv_sim={**script, "finish_reason": "length"},
        return_token_ids=True,
    )
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"  # a cut tool call is not reported as complete
    assert IM_END not in choice["token_ids"]


@pytest.mark.parametrize(
    "text",
    ["<think>\nhmm\n</think>\n\nHello <b>world</b> 🙂", "no think block at all", "</think>"],
    ids=["think-block", "plain", "markup-only"],
)
async def test_raw_text_script_emits_exactly_its_tokens(connect, text):
    client = connect()
    body = await chat(client, agentkv_sim={"text": text}, return_token_ids=True)
    expected = (await client.post("/tokenize", json={"prompt": text})).json()["tokens"]
    assert body["choices"][0]["token_ids"] == [*expected, IM_END]


async def test_thinking_off_gives_plain_content(connect):
    body = await chat(
        connect(),
        agentkv_sim={"content": "Sunny."},
        chat_template_kwargs={"enable_thinking": False},
        return_token_ids=True,
    )
    (choice,) = body["choices"]
    assert choice["message"]["content"] == "Sunny." and choice["message"]["reasoning"] is None
    assert THINK not in choice["token_ids"] and END_THINK not in choice["token_ids"]


# -- streaming ---------------------------------------------------------------------------------
async def test_stream_framing(connect):
    raw, events = await stream(connect(), agentkv_sim={"content": "Sunny."})
    for frame in raw.split("\n\n")[:-1]:
        assert frame.startswith("data: ") and "\n" not in frame
    assert raw.endswith("data: [DONE]\n\n")
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("chatcmpl-")
    assert {e["object"] for e in events} == {"chat.completion.chunk"}


@pytest.mark.parametrize("return_token_ids", [True, False], ids=["ids", "no-ids"])
async def test_stream_first_chunk_has_role_and_prompt_ids(connect, return_token_ids):
    client = connect()
    full = await chat(client, return_token_ids=True)
    _, events = await stream(client, return_token_ids=return_token_ids)
    first = events[0]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    expected = full["prompt_token_ids"] if return_token_ids else None
    assert first["prompt_token_ids"] == expected


SCRIPTS = {
    "generated": {},
    "reasoning-content": {"agentkv_sim": {"reasoning": REASONING, "content": "Sunny, 18 °C."}},
    "tool-call": {"agentkv_sim": TOOL_SCRIPT, "tools": TOOLS},
    "two-tool-calls": {
        "agentkv_sim": {
            **TOOL_SCRIPT,
            "tool_calls": [CALL, {**CALL, "arguments": {"city": "Lyon"}}],
        },
        "tools": TOOLS,
    },
    "length-cut": {"max_tokens": 9},
    "stop-string": {"agentkv_sim": {"content": "Sunny, then rain."}, "stop": ["rain"]},
    "no-thinking": {"chat_template_kwargs": {"enable_thinking": False}},
}


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("case", list(SCRIPTS))
async def test_stream_reproduces_the_full_response(connect, flavour, case):
    client = connect(flavour)
    body = {"seed": 11, "return_token_ids": True, **SCRIPTS[case]}
    full = (await chat(client, **body))["choices"][0]
    _, events = await stream(client, **body)
    chunks = [e["choices"][0] for e in events if e["choices"]]

    got = accumulate(events[1:])  # the role chunk's content "" is not model output
    assert got["reasoning"] == full["message"]["reasoning"]
    assert got["content"] == full["message"]["content"]
    assert got["tool_calls"] == tool_calls(full["message"])
    assert [t for c in chunks[1:] for t in c["token_ids"]] == full["token_ids"]
    finishes = [c["finish_reason"] for c in chunks]
    assert finishes == [None] * (len(chunks) - 1) + [full["finish_reason"]]
    assert chunks[-1]["stop_reason"] == full["stop_reason"]


async def test_stream_last_token_comes_with_finish_reason(connect):
    _, events = await stream(connect(), agentkv_sim={"content": "Sunny."}, return_token_ids=True)
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["token_ids"] == [IM_END]
    assert last["delta"] == {} and "kv_transfer_params" in events[-1]


async def test_stream_without_token_ids_skips_silent_tokens(connect):
    _, events = await stream(connect(), agentkv_sim={"reasoning": "r", "content": "Sunny."})
    for event in events[1:-1]:
        (choice,) = event["choices"]
        assert choice["delta"] and choice["token_ids"] is None


@pytest.mark.parametrize("include_usage", [True, False], ids=["usage", "no-usage"])
async def test_stream_usage_chunk_only_when_asked(connect, include_usage):
    client = connect()
    full = await chat(client, seed=5)
    _, events = await stream(client, seed=5, stream_options={"include_usage": include_usage})
    with_usage = [e for e in events if "usage" in e]
    if not include_usage:
        assert with_usage == []
        return
    assert with_usage == [events[-1]] and events[-1]["choices"] == []
    usage = events[-1]["usage"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage[key] == full["usage"][key]
    assert set(usage["prompt_tokens_details"]) == {"cached_tokens"}
