"""The simulator's ``POST /v1/responses``: vLLM 0.33's Responses API for a chat model, mapped
onto the chat path (stateless: no response store, as vLLM without
``VLLM_ENABLE_RESPONSES_API_STORE``). Real ASGI app, real Qwen3 tokenizer and template."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from agentkv.chat import load_template, load_tokenizer
from agentkv.sim import SimConfig, create_app
from agentkv.sim.costmodel import PRESETS
from agentkv.sim.transfer import TransferClient

pytestmark = pytest.mark.anyio

TOKENIZER = load_tokenizer()
TEMPLATE = load_template(None, TOKENIZER)
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
SYSTEM = "You are terse. " * 40


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    cfg = SimConfig.model_validate({"time_scale": 0.0, "num_blocks": 1024})
    app = create_app(
        cfg, tokenizer=TOKENIZER, template=TEMPLATE, cost=PRESETS["zero"], transfer=TransferClient()
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as c:
            yield c


async def respond(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/v1/responses", json={"model": "agentkv-sim", **body})


def events(text: str) -> list[dict[str, Any]]:
    out = []
    for frame in text.split("\n\n")[:-1]:
        head, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


async def test_a_tool_call_and_its_round_trip(client: httpx.AsyncClient) -> None:
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    script = {"reasoning": "Look it up.", "content": "", "tool_calls": [call]}
    r = await respond(
        client, instructions=SYSTEM, input="Weather in Paris?", tools=[TOOL], agentkv_sim=script
    )
    assert r.status_code == 200, r.text
    first = r.json()
    assert first["object"] == "response" and first["status"] == "completed"
    assert first["id"].startswith("resp_")
    assert [o["type"] for o in first["output"]] == ["reasoning", "function_call"]
    fc = first["output"][1]
    assert fc["name"] == "get_weather" and json.loads(fc["arguments"]) == {"city": "Paris"}
    assert first["usage"]["input_tokens"] > 100 and first["usage"]["output_tokens"] > 0
    # the whole input again, streamed: the prefix is in the engine's own cache
    history = [{"role": "user", "content": "Weather in Paris?"}, *first["output"]]
    history.append({"type": "function_call_output", "call_id": fc["call_id"], "output": "18 C"})
    r = await respond(
        client,
        instructions=SYSTEM,
        input=history,
        tools=[TOOL],
        stream=True,
        agentkv_sim={"content": "It is 18 C."},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    streamed = events(r.text)
    assert streamed[0]["type"] == "response.created"
    assert streamed[-1]["type"] == "response.completed"
    final = streamed[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message"]
    assert final["output"][0]["content"][0]["text"] == "It is 18 C."
    assert final["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert final["usage"]["input_tokens"] > first["usage"]["input_tokens"]


async def test_previous_response_id_is_not_found_without_a_store(client: httpx.AsyncClient) -> None:
    r = await respond(client, input="x", previous_response_id="resp_unknown")
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["message"] == "Response with id 'resp_unknown' not found."
    assert error["param"] == "response_id" and error["code"] == 404


async def test_bad_requests_in_openais_shape(client: httpx.AsyncClient) -> None:
    r = await respond(client, input=[{"type": "item_reference", "id": "x"}])
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Unsupported input item type: item_reference"
    assert r.json()["error"]["param"] == "input"
    r = await respond(client, input="x", model_unknown=1, model="other")
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
