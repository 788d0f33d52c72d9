"""The Responses API (``POST /v1/responses``) through a real router and simulator P and D
processes on loopback, driven by the official ``openai`` SDK (``client.responses.create``).

Codex CLI's way (stateless, ``store: false``, the whole input every turn, ``prompt_cache_key``
as the session) and the ``previous_response_id`` way (memory store, and Redis), tenant isolation
of stored responses, errors in OpenAI's shape, and the OpenAI Agents SDK's default setup."""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests._support.agents import SYSTEM
from tests._support.redis_server import _INSTALL, _start, _unavailable
from tests._support.stack import MODEL, Stack, stack

# paths.mode = "pull" (tests/_support/router_config.py): these tests check P's reads of
# D's KV (decision `pull`, X-AgentKV-Reused-Tokens, P's counters), which the default
# `choose` skips for a short turn by decoding it on D in place (test_paths_e2e.py)
pytestmark = [pytest.mark.e2e, pytest.mark.paths_pull]

KEY_A, KEY_B = "key-a", "key-b"
TENANTS = [
    {"name": "a", "api_keys": [KEY_A]},
    {"name": "b", "api_keys": [KEY_B]},
]
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "read_file",
        "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
    {
        "type": "function",
        "name": "list_dir",
        "description": "List a directory.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
]
DECISION = "x-agentkv-decision"


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {
        "reasoning": f"I should call {name}.",
        "content": "",
        "tool_calls": [{"name": name, "arguments": arguments}],
    }


def say(text: str) -> dict[str, Any]:
    return {"reasoning": "I know the answer.", "content": text}


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with stack(tmp_path_factory.mktemp("responses"), router={"tenancy": {"tenants": TENANTS}}) as s:
        yield s


def client_for(s: Stack, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.router.url}/v1", api_key=key, max_retries=0, timeout=60)


def create(client: openai.OpenAI, **body: Any) -> tuple[Any, httpx.Headers]:
    """``client.responses.create`` (the parsed response, or for a stream its last event's
    response and the events' types) and the router's headers."""
    script = body.pop("script", None)
    extra = {"agentkv_sim": script} if script is not None else None
    raw = client.responses.with_raw_response.create(model=MODEL, extra_body=extra, **body)
    parsed = raw.parse()
    if not body.get("stream"):
        return parsed, raw.headers
    types, final = [], None
    for event in parsed:
        types.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types[-1] == "response.completed", types
    assert final is not None
    return final, raw.headers


def items(response: Any) -> list[dict[str, Any]]:
    """A response's output as input items for the next request (what a stateless client sends
    back)."""
    return [o.model_dump(exclude_none=True) for o in response.output]


# -- stateless (Codex's way) -------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_stateless_turns_with_a_function_call_round_pull(pd: Stack, stream: bool) -> None:
    client = client_for(pd)
    session = str(uuid.uuid4())  # Codex sends its session id as prompt_cache_key
    common: dict[str, Any] = {
        "instructions": SYSTEM,
        "tools": TOOLS,
        "store": False,
        "stream": stream,
        "prompt_cache_key": session,
        "include": ["reasoning.encrypted_content"],
        "reasoning": {"summary": "auto"},
        "parallel_tool_calls": True,
    }
    history: list[dict[str, Any]] = [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Read main.py"}],
        }
    ]
    first, h1 = create(client, input=history, script=call("read_file", path="main.py"), **common)
    assert first.status == "completed"
    kinds = [o.type for o in first.output]
    assert kinds == ["reasoning", "function_call"], kinds
    fc = first.output[-1]
    assert fc.name == "read_file" and '"main.py"' in fc.arguments and fc.call_id
    assert h1[DECISION] in ("miss", "recompute")
    history += items(first)
    history.append(
        {"type": "function_call_output", "call_id": fc.call_id, "output": "print(1)\n" * 8}
    )
    second, h2 = create(client, input=history, script=say("main.py prints 1."), **common)
    assert second.output_text == "main.py prints 1."
    assert h2[DECISION] == "pull", dict(h2)
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.usage.input_tokens > first.usage.input_tokens
    history += items(second)
    history.append({"role": "user", "content": "And list src?"})
    third, h3 = create(client, input=history, script=call("list_dir", path="src"), **common)
    assert third.output[-1].type == "function_call" and third.output[-1].name == "list_dir"
    assert h3[DECISION] == "pull", dict(h3)
    # Qwen3's template drops the reasoning of turns before the last question: turn 3's prompt
    # verifies a shorter prefix of turn 2's KV than turn 2 did of turn 1's, and still pulls it
    for headers in (h2, h3):
        assert int(headers["x-agentkv-verified-prefix-tokens"]) > 0
        assert int(headers["x-agentkv-reused-tokens"]) > 0
    assert third.usage.input_tokens_details.cached_tokens > 0
    assert pd.wrong_kv() == 0


# -- previous_response_id ------------------------------------------------------------------------
def chain(
    s: Stack, client: openai.OpenAI, *, stream: bool = False
) -> list[tuple[Any, httpx.Headers]]:
    """Three turns chained by ``previous_response_id`` without any conversation id: a tool
    call, its result, a new question."""
    first = create(
        client,
        input="Read main.py",
        instructions=SYSTEM,
        tools=TOOLS,
        script=call("read_file", path="main.py"),
        stream=stream,
    )
    fc = first[0].output[-1]
    second = create(
        client,
        previous_response_id=first[0].id,
        input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "x = 1\n" * 10}],
        instructions=SYSTEM,
        tools=TOOLS,
        script=say("It sets x."),
        stream=stream,
    )
    third = create(
        client,
        previous_response_id=second[0].id,
        input="Thanks. And y?",
        instructions=SYSTEM,
        tools=TOOLS,
        script=say("There is no y."),
    )
    return [first, second, third]


def check_chain(s: Stack, turns: list[tuple[Any, httpx.Headers]]) -> None:
    (r1, h1), (r2, h2), (r3, h3) = turns
    assert [h[DECISION] for h in (h2, h3)] == ["pull", "pull"], [dict(h) for h in (h1, h2, h3)]
    assert r2.previous_response_id == r1.id and r3.previous_response_id == r2.id
    # the history was prepended: each turn's prompt holds the one before and its answer (less
    # the reasoning of turns before the last question, which Qwen3's template drops)
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    assert r3.usage.input_tokens > r2.usage.input_tokens
    assert r3.usage.input_tokens_details.cached_tokens > 0
    assert r3.output_text == "There is no y."
    assert s.wrong_kv() == 0


def test_previous_response_id_chain_memory(pd: Stack) -> None:
    client = client_for(pd)
    turns = chain(pd, client, stream=True)
    check_chain(pd, turns)
    # the stored response, as it was answered
    got = client.responses.retrieve(turns[1][0].id)
    assert got.id == turns[1][0].id and got.output_text == "It sets x."


def test_previous_response_id_chain_redis(tmp_path: Path) -> None:
    binary = shutil.which("redis-server")
    if binary is None:
        _unavailable(f"redis-server is not installed: {_INSTALL}")
    assert binary is not None
    redis = pytest.importorskip("redis")
    (tmp_path / "redis").mkdir()
    with _start(binary, tmp_path / "redis") as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        with stack(tmp_path, router={"store": {"backend": url}}) as s:
            client = client_for(s, "anything")
            turns = chain(s, client)
            check_chain(s, turns)
            with redis.Redis(port=server.port) as r:
                keys = {k.decode() for k in r.keys("agentkv:r:*")}
                assert {f"agentkv:r:default:{t.id}" for t, _ in turns} <= keys, keys
                assert 0 < r.pttl(f"agentkv:r:default:{turns[0][0].id}") <= 3600_000


def test_stored_responses_are_per_tenant(pd: Stack) -> None:
    a, b = client_for(pd, KEY_A), client_for(pd, KEY_B)
    mine, _ = create(a, input="Hello", script=say("Hi."))
    with pytest.raises(openai.NotFoundError) as lost:
        create(b, input="Go on", previous_response_id=mine.id, script=say("?"))
    assert lost.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(mine.id)
    assert a.responses.retrieve(mine.id).output_text == "Hi."
    follow, _ = create(a, input="Go on", previous_response_id=mine.id, script=say("Going."))
    assert follow.output_text == "Going."
    a.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(mine.id)


# -- errors ------------------------------------------------------------------------------------
def test_errors_in_openai_shape_and_no_handle_lost(pd: Stack) -> None:
    client = client_for(pd)
    session = str(uuid.uuid4())
    common: dict[str, Any] = {"instructions": SYSTEM, "prompt_cache_key": session}
    first, _ = create(client, input="Hello", script=say("Hello to you. " * 3), **common)
    history = [{"role": "user", "content": "Hello"}, *items(first)]
    # store: false keeps nothing to continue from
    with pytest.raises(openai.NotFoundError) as gone:
        unstored, _ = create(client, input="x", store=False, script=say("x"))
        create(client, input="y", previous_response_id=unstored.id)
    assert gone.value.code == "previous_response_not_found"
    assert gone.value.body["param"] == "previous_response_id"  # type: ignore[index]
    bad: list[dict[str, Any]] = [
        {"input": [*history, {"type": "item_reference", "id": "x"}]},
        {
            "input": history,
            "tools": [{"type": "web_search"}],
            "tool_choice": {"type": "web_search"},  # forced: refused
        },
        {"input": history, "background": True},
        {"input": history, "max_output_tokens": 0},
        {"input": [*history, {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
    ]
    for extra in bad:
        with pytest.raises(openai.BadRequestError) as refused:
            create(client, **common, **extra)
        body = refused.value.body
        assert isinstance(body, dict) and body["message"] and body["type"], body
    r = httpx.post(
        f"{pd.router.url}/v1/responses", content=b"{", headers={"authorization": f"Bearer {KEY_A}"}
    )
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(f"{pd.router.url}/v1/responses", json={"input": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"]
    # web_search offered (as Codex does) but not forced: dropped, as vLLM drops it
    history += [{"role": "user", "content": "Again?"}]
    again, headers = create(
        client, input=history, tools=[{"type": "web_search"}, *TOOLS], script=say("Yes."), **common
    )
    assert again.output_text == "Yes."
    assert headers[DECISION] == "pull"  # none of the refused requests cost the handle
    assert pd.wrong_kv() == 0


# -- the OpenAI Agents SDK, default setup (Responses) ------------------------------------------
class _Scripts:
    """Adds the next simulator script to each ``/responses`` request; records the bodies and
    the router's decisions (for a transport of either kind)."""

    def __init__(self, scripts: list[dict[str, Any]]) -> None:
        self.scripts = scripts
        self.decisions: list[str] = []
        self.bodies: list[dict[str, Any]] = []

    def scripted(self, request: httpx.Request) -> httpx.Request:
        import json

        if request.url.path.endswith("/responses") and request.method == "POST":
            body = json.loads(request.content)
            self.bodies.append(body)
            if self.scripts:
                body["agentkv_sim"] = self.scripts.pop(0)
            headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
            request = httpx.Request(request.method, request.url, headers=headers, json=body)
        return request

    def answered(self, response: httpx.Response) -> httpx.Response:
        if DECISION in response.headers:
            self.decisions.append(response.headers[DECISION])
        return response


class _Scripted(_Scripts, httpx.AsyncBaseTransport):
    """:class:`_Scripts` for an asynchronous client."""

    def __init__(self, scripts: list[dict[str, Any]]) -> None:
        super().__init__(scripts)
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return self.answered(await self.inner.handle_async_request(self.scripted(request)))

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_openai_agents_default_setup_two_turns(pd: Stack) -> None:
    agents = pytest.importorskip("agents")

    def read_file(path: str) -> str:
        """Read a file."""
        return f"{path}: x = 1\n" * 6

    scripts = [
        call("read_file", path="main.py"),
        say("main.py sets x."),
        say("It sets it to 1."),
    ]
    transport = _Scripted(scripts)
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(
        base_url=f"{pd.router.url}/v1",
        api_key=KEY_A,
        http_client=httpx.AsyncClient(transport=transport, timeout=60),
        max_retries=0,
    )
    agents.set_default_openai_client(client, use_for_tracing=False)
    agent = agents.Agent(
        name="coder", instructions=SYSTEM, tools=[agents.function_tool(read_file)], model=MODEL
    )

    async def run() -> tuple[Any, Any]:
        first = await agents.Runner.run(agent, "What does main.py do?")
        follow = [*first.to_input_list(), {"role": "user", "content": "To what?"}]
        second = await agents.Runner.run(agent, follow)
        await client.close()
        return first, second

    try:
        first, second = asyncio.run(run())
    finally:
        agents.set_default_openai_client(
            openai.AsyncOpenAI(api_key="unused"), use_for_tracing=False
        )
    assert first.final_output == "main.py sets x." and second.final_output == "It sets it to 1."
    assert len(transport.bodies) == 3 and all(b.get("input") for b in transport.bodies)
    # no conversation id of its own, the whole input each call: the items it sends back name
    # the stored response they came from, whose chain keeps the KV
    assert transport.decisions[0] in ("miss", "recompute")
    assert transport.decisions[1:] == ["pull", "pull"], transport.decisions
    assert pd.wrong_kv() == 0


# -- LangChain ChatOpenAI(use_responses_api=True) ----------------------------------------------
class _ScriptedSync(_Scripts, httpx.BaseTransport):
    """:class:`_Scripts` for a synchronous client."""

    def __init__(self, scripts: list[dict[str, Any]]) -> None:
        super().__init__(scripts)
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.answered(self.inner.handle_request(self.scripted(request)))

    def close(self) -> None:
        self.inner.close()


def test_langchain_chat_openai_responses_api_two_turns(pd: Stack) -> None:
    lc_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage

    transport = _ScriptedSync([call("read_file", path="main.py"), say("main.py sets x.")])
    with httpx.Client(transport=transport, timeout=60) as http:
        llm = lc_openai.ChatOpenAI(
            model=MODEL,
            base_url=f"{pd.router.url}/v1",
            api_key=KEY_A,
            use_responses_api=True,
            max_retries=0,
            http_client=http,
        ).bind_tools([TOOLS[0]])
        messages: list[Any] = [SystemMessage(SYSTEM), HumanMessage("What does main.py do?")]
        first = llm.invoke(messages)
        assert first.tool_calls and first.tool_calls[0]["name"] == "read_file"
        messages += [first, ToolMessage("x = 1\n" * 8, tool_call_id=first.tool_calls[0]["id"])]
        second = llm.invoke(messages)
    assert second.text == "main.py sets x."
    assert transport.decisions[0] in ("miss", "recompute")
    assert transport.decisions[1] == "pull", (transport.decisions, transport.bodies[1]["input"])
    assert pd.wrong_kv() == 0


def test_a_broken_decode_stream_fails_the_response(pd: Stack) -> None:
    """D drops the connection mid-answer: the Responses stream says so (``error``, then
    ``response.failed``) instead of completing."""
    (decode,) = pd.decode
    client = client_for(pd)
    httpx.post(f"{decode.url}/_sim/faults", json={"cut_stream_after": 3}, timeout=10)
    try:
        stream = client.responses.create(
            model=MODEL,
            input="Tell me a story.",
            stream=True,
            extra_body={"agentkv_sim": say("Once upon a time there was a cache. " * 4)},
        )
        types = [event.type for event in stream]
    finally:
        httpx.post(f"{decode.url}/_sim/faults", json={"cut_stream_after": None}, timeout=10)
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-2:] == ["error", "response.failed"], types
    assert "response.completed" not in types
    deadline = time.monotonic() + 10  # D is back in rotation once its health check passes
    while httpx.get(f"{pd.router.url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
