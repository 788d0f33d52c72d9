"""The simulator's Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) as
vLLM 0.33 serves it: its chat path under the Messages codec, with the real Qwen3 tokenizer and
template, through the real ASGI app; and ``--prompt-scripts``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest

from agentkv.chat import load_template, load_tokenizer
from agentkv.sim import SimConfig, create_app
from agentkv.sim.costmodel import PRESETS
from agentkv.sim.transfer import TransferClient
from tests._support.templates import TEMPLATES_DIR
from tests._support.tools import chat_tool

pytestmark = pytest.mark.anyio

MODEL = "agentkv-sim"
TOKENIZER = load_tokenizer()
TEMPLATE = load_template(None, TOKENIZER)
TRANSFER = TransferClient()
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cch=1a2b;"},
    {"type": "text", "text": "You are a coding agent."},
]
BASH = {
    "name": "Bash",
    "description": "Run a command.",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
}
Connect = Callable[..., httpx.AsyncClient]


@pytest.fixture
async def connect() -> AsyncIterator[Connect]:
    clients: list[httpx.AsyncClient] = []

    def make(**config: Any) -> httpx.AsyncClient:
        cfg = SimConfig.model_validate({"time_scale": 0.0, "num_blocks": 1024, **config})
        template = None if cfg.template else TEMPLATE
        app = create_app(
            cfg, tokenizer=TOKENIZER, template=template, cost=PRESETS["zero"], transfer=TRANSFER
        )
        clients.append(
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim")
        )
        return clients[-1]

    yield make
    for client in clients:
        await client.aclose()


def body(content: Any = "hello", **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 200,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


async def message(
    client: httpx.AsyncClient, path: str = "/v1/messages", **b: Any
) -> dict[str, Any]:
    r = await client.post(path, json=b)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def stream(client: httpx.AsyncClient, **b: Any) -> list[dict[str, Any]]:
    r = await client.post("/v1/messages", json={**b, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    out = []
    for frame in r.content.split(b"\n\n")[:-1]:
        head, data = frame.split(b"\n")
        event = orjson.loads(data.removeprefix(b"data: "))
        assert head == b"event: " + event["type"].encode()
        out.append(event)
    return out


async def count(client: httpx.AsyncClient, b: dict[str, Any]) -> int:
    b = {k: v for k, v in b.items() if k not in ("max_tokens", "stream")}
    counted = await message(client, "/v1/messages/count_tokens", **b)
    assert counted["context_management"] == {"original_input_tokens": counted["input_tokens"]}
    return int(counted["input_tokens"])


async def tokenize(client: httpx.AsyncClient, **b: Any) -> int:
    r = await client.post("/tokenize", json=b)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


async def test_answer_streamed_or_not_is_the_same(connect):
    client = connect()
    b = body()
    whole = await message(client, **b)
    assert whole["id"].startswith("msg_") and whole["model"] == MODEL
    assert [c["type"] for c in whole["content"]] == ["thinking", "text"]  # Qwen3 thinks
    assert whole["stop_reason"] == "end_turn"
    n = await count(client, b)
    assert whole["usage"]["input_tokens"] + whole["usage"]["cache_read_input_tokens"] == n
    events = await stream(client, **b)
    start, *_, delta, stop = events
    # continuous usage stats (which vLLM asks for) give message_start the prompt's length
    assert start["message"]["usage"] == {"input_tokens": n, "output_tokens": 0}
    assert stop == {"type": "message_stop"}
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    thought = "".join(
        e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta"
    )
    assert text == whole["content"][1]["text"] and thought == whole["content"][0]["thinking"]


async def test_scripted_tool_call_and_the_beta_route(connect):
    client = connect()
    script = {
        "reasoning": "Run it.",
        "tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}}],
    }
    out = await message(client, "/v1/messages?beta=true", **body(tools=[BASH], agentkv_sim=script))
    assert out["stop_reason"] == "tool_use"
    thinking, call = out["content"]
    assert thinking["thinking"] == "Run it."
    assert (
        call["type"] == "tool_use" and call["name"] == "Bash" and call["input"] == {"command": "ls"}
    )
    events = await stream(client, **body(tools=[BASH], agentkv_sim=script))
    args = "".join(
        e["delta"].get("partial_json", "") for e in events if e["type"] == "content_block_delta"
    )
    assert json.loads(args) == {"command": "ls"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


INLINE = [
    {"role": "user", "content": "hi"},
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "and?"},
]
CHAT_TOOLS = [chat_tool("Bash", "Run a command.", BASH["input_schema"])]


async def test_prompt_is_vllms_chat_prompt(connect):
    """Qwen3's template takes a system message anywhere: it stays in place; ``thinking:
    disabled`` turns thinking off (``reasoning_effort: none``); the billing header is gone."""
    client = connect()
    inline = body(messages=INLINE, thinking={"type": "disabled"}, tools=[BASH])
    chat = [{"role": "system", "content": "You are a coding agent."}, *INLINE]
    kwargs = {"reasoning_effort": "none", "enable_thinking": False}
    expected = await tokenize(client, messages=chat, tools=CHAT_TOOLS, chat_template_kwargs=kwargs)
    assert await count(client, inline) == expected
    out = await message(client, **inline)
    assert out["usage"]["input_tokens"] + out["usage"]["cache_read_input_tokens"] == expected
    assert [c["type"] for c in out["content"]] == ["text"]  # no thinking


async def test_inline_system_merged_for_a_template_that_wants_it_first(connect):
    """Qwen3.5's template refuses a system message after the first: vLLM (and the simulator)
    merge inline ones into the leading system message."""
    template = TEMPLATES_DIR / "qwen3.5.jinja"
    if not template.exists():
        pytest.skip(f"the real chat templates are not checked out ({TEMPLATES_DIR})")
    client = connect(template=str(template))
    merged = [
        {"role": "system", "content": "You are a coding agent.Be brief."},
        INLINE[0],
        INLINE[2],
    ]
    assert (await client.post("/tokenize", json={"messages": INLINE})).status_code == 400
    expected = await tokenize(client, messages=merged)
    assert await count(client, body(messages=INLINE)) == expected
    out = await message(client, **body(messages=INLINE))
    assert out["usage"]["input_tokens"] + out["usage"]["cache_read_input_tokens"] == expected


async def test_errors_in_anthropic_shape(connect):
    client = connect(role="both")

    async def error(r: httpx.Response, status: int, kind: str) -> str:
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
        return str(r.json()["error"]["message"])

    assert "does not exist" in await error(
        await client.post("/v1/messages", json=body(model="other")), 404, "not_found_error"
    )
    await error(await client.post("/v1/messages", content=b"{"), 400, "invalid_request_error")
    no_max = {k: v for k, v in body().items() if k != "max_tokens"}
    assert "max_tokens" in await error(
        await client.post("/v1/messages", json=no_max), 400, "invalid_request_error"
    )
    r = await client.post("/v1/messages/count_tokens", json=body(model="other"))
    await error(r, 404, "not_found_error")
    await client.post("/_sim/faults", json={"fail_next": 1, "fail_status": 503})
    await error(await client.post("/v1/messages", json=body()), 503, "overloaded_error")


async def test_continuous_usage_stats_on_chat_streams(connect):
    client = connect()
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 20,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    r = await client.post("/v1/chat/completions", json=chat)
    chunks = [orjson.loads(f[6:]) for f in r.content.split(b"\n\n") if f.startswith(b"data: {")]
    n = chunks[0]["usage"]["prompt_tokens"]
    assert chunks[0]["usage"] == {
        "prompt_tokens": n,
        "total_tokens": n,
        "completion_tokens": 0,
        "completion_tokens_details": None,
    }
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == counts[-2] > 0  # the usage chunk last
    plain = await client.post("/v1/chat/completions", json={**chat, "stream_options": None})
    assert b'"usage"' not in plain.content


async def test_prompt_scripts(connect):
    steps = [
        {"tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}}]},
        {"content": "Second."},
    ]
    prompt = [
        {"type": "text", "text": "<reminder/>"},
        {"type": "text", "text": "go agentkv_sim: " + json.dumps(steps) + " thanks"},
    ]
    client, plain = connect(prompt_scripts=True), connect()
    first = await message(client, **body(prompt, tools=[BASH]))
    assert first["content"][-1]["input"] == {"command": "ls"}
    history = [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": first["content"]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": first["content"][-1]["id"],
                    "content": "a.py",
                }
            ],
        },
    ]
    second = await message(client, **body(messages=history, tools=[BASH]))
    assert second["content"][-1] == {"type": "text", "text": "Second."}
    history += [
        {"role": "assistant", "content": second["content"]},
        {"role": "user", "content": "more?"},
    ]
    third = await message(client, **body(messages=history, tools=[BASH]))
    assert third["stop_reason"] == "end_turn" and third["content"][-1]["text"] != "Second."
    # a script in the body wins; without --prompt-scripts the prompt is only a prompt
    own = await message(client, **body(prompt, agentkv_sim={"content": "Body."}))
    assert own["content"][-1]["text"] == "Body."
    assert (await message(plain, **body(prompt, tools=[BASH])))["stop_reason"] == "end_turn"
    r = await client.post("/v1/messages", json=body("agentkv_sim: {broken"))
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = await client.post("/v1/messages", json=body('agentkv_sim: {"nope": 1}'))
    assert r.status_code == 400 and "script" in r.json()["error"]["message"]
