"""A turn on the wire (``agentkv._wire``): what ``openai``'s own ``create`` sends, the history
encoded by orjson, vLLM's echo of the prompt's ids not decoded. Real HTTP against the shared
simulator."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.resources.chat.completions import Completions

import agentkv
from agentkv import _wire
from agentkv._wire import _without_echo
from agentkv.sim.launch import SimProcess
from tests._support.tools import function_tool

TOOLS = [function_tool("get_weather", "Weather", city="string")]
LONG = " ".join(["agents resend their whole growing history every turn"] * 400)


class _Subclass(openai.OpenAI):
    """An ``openai.OpenAI`` subclass (it may build its requests its own way)."""


class Recorded:
    """Every request an ``openai`` client sent: (path, headers, JSON body)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], Any]] = []

    def hook(self, request: httpx.Request) -> None:
        body = json.loads(request.read()) if request.content else None
        self.requests.append((request.url.path, dict(request.headers), body))

    def chats(self) -> list[tuple[dict[str, str], Any]]:
        return [(h, b) for p, h, b in self.requests if p.endswith("/chat/completions")]


def _client(sim: SimProcess, cls: type[openai.OpenAI] = openai.OpenAI) -> tuple[Any, Recorded]:
    recorded = Recorded()
    http: Any = httpx.Client(event_hooks={"request": [recorded.hook]}, trust_env=False)
    oa = cls(base_url=f"{sim.url}/v1", api_key="k", http_client=http)
    return agentkv.Client(openai_client=oa, retries=0), recorded


def _turns(client: agentkv.Client, n: int) -> list[Any]:
    conv = client.conversation("wire-1", model="sim", system=LONG, tools=TOOLS)
    out = []
    for i in range(n):
        conv.add_user(f"question {i}")
        out.append(
            conv.create(
                max_tokens=8,
                temperature=0,
                seed=7,
                top_p=openai.NOT_GIVEN,
                stop=("zz",),
                extra_body={"top_k": 3, "min_p": openai.omit},
                extra_headers={"X-Test": "wire"},
            )
        )
    return out


def test_a_turn_sends_what_openai_create_sends(
    sim: SimProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, fast_sent = _client(sim)
    own, own_sent = _client(sim)
    with fast, own:
        fast_turns = _turns(fast, 3)
        monkeypatch.setitem(_wire._FAST, openai.OpenAI, False)  # as an openai without content=
        own_turns = _turns(own, 3)
    assert len(fast_sent.chats()) == len(own_sent.chats()) == 3
    for (fast_headers, fast_body), (own_headers, own_body) in zip(
        fast_sent.chats(), own_sent.chats(), strict=True
    ):
        assert fast_body == own_body
        assert "min_p" not in fast_body and "top_p" not in fast_body
        assert fast_body["stop"] == ["zz"] and fast_body["top_k"] == 3
        trace = {"traceparent", "tracestate"}  # each turn's own span when tracing is on
        assert {k: v for k, v in fast_headers.items() if k not in trace} == {
            k: v for k, v in own_headers.items() if k not in trace
        }  # auth, x-stainless-*, ours, content-length
    for a, b in zip(fast_turns, own_turns, strict=True):
        mine = {"id", "created", "usage"}  # usage: the second run hits the prefix cache
        assert a.model_dump(exclude=mine) == b.model_dump(exclude=mine)
        assert a.model_extra["prompt_token_ids"] == b.model_extra["prompt_token_ids"]


def test_the_history_never_goes_through_the_standard_json(
    sim: SimProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """openai encodes a body with ``json.dumps`` and decodes an answer with ``json.loads``
    (through httpx): after the first turn, neither sees the history's ids or text."""
    client = agentkv.Client(base_url=f"{sim.url}/v1", api_key="k", retries=0)
    conv = client.conversation(model="sim", system=LONG)
    conv.add_user("first")
    conv.create(max_tokens=8)
    seen: list[int] = []
    dumps, loads = json.dumps, json.loads

    def sized_dumps(obj: Any, **kw: Any) -> str:
        text = dumps(obj, **kw)
        seen.append(len(text))
        return text

    def sized_loads(data: Any, **kw: Any) -> Any:
        seen.append(len(data))
        return loads(data, **kw)

    monkeypatch.setattr(json, "dumps", sized_dumps)
    monkeypatch.setattr(json, "loads", sized_loads)
    for i in range(2):
        conv.add_user(f"question {i}")
        completion = conv.create(max_tokens=8)
        sent = conv._ledger.last_prompt_ids
        assert sent is not None and len(sent) > 3000
        assert completion.model_extra is not None
        echo = completion.model_extra["prompt_token_ids"]
        assert echo == sent and echo is not conv._ledger.ids  # the caller's own copy
    monkeypatch.undo()
    client.close()
    assert max(seen, default=0) < 2000, seen


def test_what_instruments_create_sees_all_but_the_messages(
    sim: SimProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrapper of ``Completions.create`` (tracing libraries wrap the class's) sees the
    arguments and the extra body, not the messages (openai's transform of them is skipped)."""
    seen: list[dict[str, Any]] = []
    create = Completions.create

    def traced(self: Completions, *args: Any, **kwargs: Any) -> Any:
        seen.append(copy.deepcopy(kwargs))  # as the call saw them (the ledger grows after)
        return create(self, *args, **kwargs)

    monkeypatch.setattr(Completions, "create", traced)
    client, sent = _client(sim)
    with client:
        _turns(client, 2)
    body = sent.chats()[-1][1]
    assert seen[-1]["messages"] == [] and seen[-1]["model"] == "sim"
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
    ids = seen[-1]["extra_body"]["kv_transfer_params"]["prompt_token_ids"]
    assert ids == body["kv_transfer_params"]["prompt_token_ids"]


def test_a_subclass_of_the_openai_client_takes_its_own_path(sim: SimProcess) -> None:
    client, sent = _client(sim, _Subclass)
    with client:
        turns = _turns(client, 2)
    assert [b["top_k"] for _, b in sent.chats()] == [3, 3]
    assert (
        turns[-1].model_extra["prompt_token_ids"]
        == sent.chats()[-1][1]["kv_transfer_params"]["prompt_token_ids"]
    )


@pytest.mark.anyio
async def test_async_turns_read_the_echo_as_sent(sim: SimProcess) -> None:
    async with agentkv.AsyncClient(base_url=f"{sim.url}/v1", api_key="k", retries=0) as client:
        conv = client.conversation(model="sim", system=LONG)
        for i in range(2):
            conv.add_user(f"question {i}")
            completion = await conv.create(max_tokens=8)
            assert completion.model_extra is not None
            assert completion.model_extra["prompt_token_ids"] == conv._ledger.last_prompt_ids
        assert conv.last_receipt is not None and conv.last_receipt.mode == "exact"


@pytest.fixture
def ids() -> Iterator[list[int]]:
    yield [5, 70000, 3, 151643]


def test_an_echo_as_sent_is_not_decoded(ids: list[int]) -> None:
    body = orjson.dumps({"id": "x", "choices": [{"token_ids": [1]}], "prompt_token_ids": ids})
    data = _without_echo(body, orjson.dumps(ids), ids)
    assert data == {"id": "x", "choices": [{"token_ids": [1]}], "prompt_token_ids": ids}


@pytest.mark.parametrize(
    "body",
    [
        b'{"id":"x","prompt_token_ids":[5, 70000, 3, 151643]}',  # spaced: decoded
        b'{"id":"x","prompt_token_ids":[5,70000,3]}',  # another prompt
        b'{"id":"x","prompt_token_ids":[5,70000,3,151643,9]}',
        b'{"c":"\\"prompt_token_ids\\":[5,70000,3,151643]","prompt_token_ids":[1]}',
        b'{"c":{"prompt_token_ids":[5,70000,3,151643]},"prompt_token_ids":[1]}',
        b'{"id":"x"}',
        b'{"big":18446744073709551616,"prompt_token_ids":[5,70000,3,151643]}',
        b'{"nan":NaN,"prompt_token_ids":[5,70000,3,151643]}',
    ],
)
def test_any_other_answer_is_decoded_as_it_is(body: bytes, ids: list[int]) -> None:
    got = _without_echo(body, orjson.dumps(ids), ids)
    assert json.dumps(got) == json.dumps(json.loads(body))  # NaN != NaN
