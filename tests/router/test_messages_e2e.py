"""Anthropic's Messages API through the router (issue 22): the official ``anthropic`` SDK against
a real router and simulator P and D on loopback. The router turns each request into vLLM's chat
request, runs it through the same turn core as chat, and answers in Anthropic's format."""

from __future__ import annotations

import uuid
from typing import Any

import anthropic
import httpx
import pytest

from tests._support.stack import NO_P_CACHE, stack, start_router
from tests._support.templates import TEMPLATES_DIR

# paths.mode = "pull" (tests/_support/router_config.py): these tests check P's reads of
# D's KV (decision `pull`, X-AgentKV-Reused-Tokens, P's counters), which the default
# `choose` skips for a short turn by decoding it on D in place (test_paths_e2e.py)
pytestmark = [pytest.mark.e2e, pytest.mark.paths_pull]

MODEL = "agentkv-sim"
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cc_entrypoint=cli;"},
    {
        "type": "text",
        "text": "You are Claude Code. "
        + " ".join(f"Rule {i}: keep changes small." for i in range(30)),
        "cache_control": {"type": "ephemeral"},
    },
]
TOOLS = [
    {
        "name": "Bash",
        "description": "Run a shell command.",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
    {
        "name": "Read",
        "description": "Read a file.",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}},
            "required": ["file_path"],
        },
    },
]
TENANT_KEY = "sk-team-a"


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """One P (no prefix cache: reuse is D's KV), one D; router 0 open, router 1 with a tenant."""
    tmp = tmp_path_factory.mktemp("messages")
    with stack(tmp, p_args=NO_P_CACHE) as s:
        cfg = {
            **s.router_config(),
            "tenancy": {"tenants": [{"name": "team-a", "api_keys": [TENANT_KEY]}]},
        }
        s.routers.append(start_router(cfg, tmp))
        yield s


@pytest.fixture
def client(pd):
    """``client(key=, router=)``: an SDK client of router 0 (or ``router``), closed after."""
    made: list[anthropic.Anthropic] = []

    def make(key: str = "sk-local", router: int = 0) -> anthropic.Anthropic:
        made.append(
            anthropic.Anthropic(base_url=pd.routers[router].url, api_key=key, max_retries=0)
        )
        return made[-1]

    yield make
    for c in made:
        c.close()


def request(messages: list[dict[str, Any]], script: dict[str, Any]) -> dict[str, Any]:
    """A Claude Code-shaped request whose answer the simulator is scripted to give."""
    return {
        "model": MODEL,
        "max_tokens": 400,
        "system": SYSTEM,
        "tools": TOOLS,
        "messages": messages,
        "metadata": {"user_id": '{"device_id": "d1", "session_id": "s1"}'},
        "thinking": {"type": "adaptive"},
        "extra_body": {"agentkv_sim": script, "context_management": {"edits": []}},
    }


SCRIPTS = [
    {"tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}}]},
    {
        "reasoning": "Read the file.",
        "tool_calls": [{"name": "Read", "arguments": {"file_path": "a.py"}}],
    },
    {"content": "The project has one file, a.py."},
]
RESULTS = ["a.py\nb.txt", "print('hello')"]


def _blocks(message: Any) -> list[dict[str, Any]]:
    return [block.model_dump(exclude_none=True) for block in message.content]


def test_tool_use_round_trip_over_three_turns_pulls_with_no_wrong_kv(pd, client):
    c = client()
    conv = f"messages-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What is in this project?"},
        # Claude Code's inline system message: Qwen3's template takes it where it is
        {"role": "system", "content": "<system-reminder>Be brief.</system-reminder>"},
    ]
    decisions, cached = [], []
    for turn, script in enumerate(SCRIPTS):
        raw = c.messages.with_raw_response.create(
            **request(messages, script), extra_headers={"X-Conversation-Id": conv}
        )
        message = raw.parse()
        decisions.append(raw.headers["x-agentkv-decision"])
        cached.append(message.usage.cache_read_input_tokens)
        assert message.id.startswith("msg_") and message.role == "assistant"
        if turn < 2:
            assert message.stop_reason == "tool_use"
            call = message.content[-1]
            assert call.type == "tool_use" and call.name == script["tool_calls"][0]["name"]
            assert call.input == script["tool_calls"][0]["arguments"]
            if turn == 1:
                assert message.content[0].type == "thinking"
                assert message.content[0].thinking == "Read the file."
            messages.append({"role": "assistant", "content": _blocks(message)})
            result = {"type": "tool_result", "tool_use_id": call.id, "content": RESULTS[turn]}
            messages.append({"role": "user", "content": [result]})
        else:
            assert message.stop_reason == "end_turn"
            assert [b.type for b in message.content] == ["text"]
            assert message.content[0].text == script["content"]
    assert decisions == ["miss", "pull", "pull"]
    assert cached[0] == 0 and all(n and n > 0 for n in cached[1:]), cached
    assert pd.wrong_kv() == 0


def test_streamed_turns_through_the_beta_route(pd, client):
    """``client.beta.messages`` posts to ``/v1/messages?beta=true``, as Claude Code does."""
    c = client()
    conv = f"stream-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "List the files."}]
    events: list[str] = []
    with c.beta.messages.stream(
        **request(messages, SCRIPTS[0]), extra_headers={"X-Conversation-Id": conv}
    ) as stream:
        for event in stream:
            events.append(event.type)
        first = stream.get_final_message()
        assert stream.response.headers["x-agentkv-decision"] == "miss"
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "message_delta" in events
    assert first.stop_reason == "tool_use"
    call = first.content[-1]
    assert call.type == "tool_use" and call.input == {"command": "ls"}
    messages.append({"role": "assistant", "content": _blocks(first)})
    result = {"type": "tool_result", "tool_use_id": call.id, "content": RESULTS[0]}
    messages.append({"role": "user", "content": [result]})
    with c.beta.messages.stream(
        **request(messages, SCRIPTS[2]), extra_headers={"X-Conversation-Id": conv}
    ) as stream:
        text = "".join(stream.text_stream)
        second = stream.get_final_message()
        assert stream.response.headers["x-agentkv-decision"] == "pull"
    assert text == SCRIPTS[2]["content"] and second.stop_reason == "end_turn"
    assert second.usage.output_tokens > 0
    assert second.usage.cache_read_input_tokens and second.usage.cache_read_input_tokens > 0
    assert pd.wrong_kv() == 0


def test_count_tokens_is_the_prompt_the_engines_ran(pd, client):
    c = client()
    body = request([{"role": "user", "content": "Count me."}], {"content": "ok"})
    body.pop("max_tokens")
    body.pop("metadata")
    counted = c.messages.count_tokens(
        **{k: v for k, v in body.items() if k != "extra_body"}
    ).input_tokens
    message = c.messages.create(
        **request([{"role": "user", "content": "Count me."}], {"content": "ok"})
    )
    ran = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert counted == ran > 100


def _error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return str(body["error"]["message"])


def test_errors_in_anthropic_shape(pd, client):
    url = f"{pd.router.url}/v1/messages"
    assert "JSON" in _error(
        httpx.post(url, content=b"{bad", timeout=30), 400, "invalid_request_error"
    )
    no_max = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert "max_tokens" in _error(
        httpx.post(url, json=no_max, timeout=30), 400, "invalid_request_error"
    )
    with pytest.raises(anthropic.NotFoundError) as exc:
        client().messages.create(
            model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert exc.value.body["error"]["type"] == "not_found_error"
    counted = httpx.post(f"{url}/count_tokens", content=b"[]", timeout=30)
    _error(counted, 400, "invalid_request_error")


def test_tenant_keys_from_x_api_key(pd, client):
    """Anthropic clients send ``x-api-key``: a tenant's key there is accepted, a wrong one is
    a 401 ``authentication_error``, on both routes."""
    with pytest.raises(anthropic.AuthenticationError) as exc:
        client(key="sk-wrong", router=1).messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert exc.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        client(key="sk-wrong", router=1).messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
    ok = client(key=TENANT_KEY, router=1).messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    )
    assert ok.usage.output_tokens > 0
    r = httpx.post(
        f"{pd.routers[1].url}/v1/messages",
        json={"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {TENANT_KEY}"},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_template_probes_merge_inline_system_and_turn_thinking_off(tmp_path):
    """Behind engines whose template wants the system prompt first (Qwen3.5's), the router
    learns it from P's ``/tokenize`` as vLLM learns it from its template: inline system messages
    join the leading one, and ``thinking: disabled`` is ``reasoning_effort: none``."""
    template = TEMPLATES_DIR / "qwen3.5.jinja"
    if not template.exists():
        pytest.skip(f"the real chat templates are not checked out ({TEMPLATES_DIR})")
    common = ("--time-scale", "0", "--block-size", "16", "--template", str(template))
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "and?"},
    ]
    with stack(tmp_path, common=common) as s:
        merged = [
            {"role": "system", "content": "You are terse.Be brief."},
            messages[0],
            messages[2],
        ]
        kwargs = {"reasoning_effort": "none", "enable_thinking": False}
        r = httpx.post(
            f"{s.router.url}/tokenize",
            json={"messages": merged, "chat_template_kwargs": kwargs},
            timeout=30,
        )
        expected = r.json()["count"]
        with anthropic.Anthropic(base_url=s.router.url, api_key="k", max_retries=0) as c:
            args: dict[str, Any] = {
                "model": MODEL,
                "system": "You are terse.",
                "messages": messages,
                "thinking": {"type": "disabled"},
            }
            assert c.messages.count_tokens(**args).input_tokens == expected
            message = c.messages.create(max_tokens=40, **args)
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == expected
    assert [b.type for b in message.content] == ["text"]
