"""Token identity kept by the router (agentkv.router.identity): what counts as the same message,
the ledger's bounds, and which turns keep identity, against a real simulator's ``/tokenize``
(in process) and a real Redis."""

from __future__ import annotations

import asyncio
import uuid
from array import array
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from agentkv.protocol.errors import UpstreamError
from agentkv.protocol.exact import AppendJob, append_plan, run_plan_async
from agentkv.router.config import RouterConfig
from agentkv.router.identity import (
    KEPT,
    KEPT_PREFIX,
    MAX_MARKS,
    Entry,
    Identity,
    Mark,
    MemoryLedger,
    Pending,
    RedisLedger,
    answer_digest,
    context_digest,
    message_digest,
    pack,
    unpack,
)
from agentkv.router.identity_digests import prefix_digests
from agentkv.router.identity_ids import PackedIds
from agentkv.router.request import ClientRequest, TokenIds, int32_le, parse_request
from agentkv.router.sse import Captured, EventRelay
from agentkv.sim import SimConfig
from agentkv.sim import create_app as create_sim
from tests._support.tools import function_tool

pytestmark = pytest.mark.anyio

MODEL = "agentkv-sim"
TOOLS = [function_tool("read_file", "Read a file", path="string")]
CONFIG = RouterConfig.model_validate(
    {
        "upstream": {
            "prefill": [{"url": "http://127.0.0.1:1"}],
            "decode": [{"url": "http://127.0.0.1:2"}],
        }
    }
)


# -- what counts as the same message -------------------------------------------------------------
ANSWER = {
    "role": "assistant",
    "content": None,
    "reasoning": "Read it first.",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
        }
    ],
    "refusal": None,
    "annotations": None,
    "audio": None,
    "function_call": None,
}


def _call(**function: Any) -> dict[str, Any]:
    fn = {"name": "read_file", "arguments": '{"path": "a.py"}', **function}
    return {"id": "call_1", "function": fn}


@pytest.mark.parametrize(
    "same",
    [
        # what the openai SDK's model_dump(exclude_none=True) sends back
        {"role": "assistant", "reasoning": "Read it first.", "tool_calls": [_call()]},
        # a streaming client: content "" and the call's index
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Read it first.",
            "tool_calls": [{**_call(), "index": 0, "type": "function"}],
            "annotations": [],
        },
    ],
)
def test_an_answer_sent_back_in_another_form_is_the_same(same: dict[str, Any]) -> None:
    assert answer_digest(same) == answer_digest(ANSWER)


@pytest.mark.parametrize(
    "changed",
    [
        {**ANSWER, "reasoning": None},  # reasoning stripped
        {**ANSWER, "content": "Let me look."},  # content added
        {**ANSWER, "tool_calls": [_call(arguments='{"path":"a.py"}')]},  # re-encoded arguments
        {**ANSWER, "tool_calls": [{**_call(), "id": "call_2"}]},
        {**ANSWER, "tool_calls": [_call(name="write_file")]},
        {**ANSWER, "tool_calls": []},
        {**ANSWER, "name": "helper"},  # a field a template may render
    ],
)
def test_a_changed_answer_is_not_the_same(changed: dict[str, Any]) -> None:
    assert answer_digest(changed) != answer_digest(ANSWER)


def test_text_parts_and_strings() -> None:
    text = {"role": "user", "content": "hi"}
    assert message_digest(text) == message_digest(
        {**text, "content": [{"type": "text", "text": "hi"}]}
    )
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    assert message_digest(text) != message_digest({**text, "content": [image]})
    assert message_digest(text) != message_digest({**text, "role": "system"})
    assert message_digest({"role": "tool", "tool_call_id": "a", "content": "1"}) != message_digest(
        {"role": "tool", "tool_call_id": "b", "content": "1"}
    )


def test_messages_nested_past_orjson_s_depth_still_digest() -> None:
    def nested(leaf: bytes) -> Any:  # as a request body arrives: orjson reads 1024 levels
        return {"role": "user", "content": orjson.loads(b'{"a":' * 1000 + leaf + b"}" * 1000)}

    assert message_digest(nested(b"1")) == message_digest(nested(b"1"))
    assert message_digest(nested(b"1")) != message_digest(nested(b"2"))


def test_context_is_model_tools_and_template() -> None:
    body = {"model": MODEL, "messages": [], "tools": TOOLS, "temperature": 0.3}
    assert context_digest(body) == context_digest({**body, "temperature": 1, "max_tokens": 5})
    for change in (
        {"model": "other"},
        {"tools": None},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"chat_template": "{{ messages }}"},
    ):
        assert context_digest(body) != context_digest({**body, **change}), change


# -- entries and ledgers ---------------------------------------------------------------------------
def entry(messages: int, tokens: int, tag: int = 0) -> Entry:
    return Entry(
        messages,
        bytes([tag]) * 16,
        bytes([tag + 1]) * 16,
        bytes([tag + 2]) * 16,
        PackedIds.of(array("i", range(tokens - 2))),
        PackedIds.of(array("i", [tag, (1 << 31) - 1])),
    )


def test_packed_ids_round_trip_in_about_two_bytes_an_id() -> None:
    # a 150k vocabulary: most ids below 65,536, some above, the int32 extremes
    ids = [(i * 7919) % 151_000 for i in range(32_000)] + [0, 65_535, 65_536, (1 << 31) - 1]
    packed = PackedIds.of(ids)
    assert packed.tolist() == ids and len(packed) == len(ids)
    assert packed.le() == array("i", ids).tobytes()  # the test machine is little-endian
    assert packed == PackedIds.of(array("i", ids)) and packed != PackedIds.of(ids[:-1])
    assert packed.nbytes < 2.2 * len(ids)
    small = PackedIds.of(list(range(60_000)))  # all below 65,536: exactly 2 bytes an id
    assert small.nbytes == 2 * 60_000 and small.tolist() == list(range(60_000))
    assert PackedIds.of([]).tolist() == [] and len(PackedIds.of([])) == 0
    with pytest.raises(OverflowError):
        PackedIds.of([1 << 31])


def test_entries_pack_and_unpack() -> None:
    marks = (Mark(2, 5, 9, b"m" * 16), Mark(4, 12, 20, b"n" * 16))
    entries = [entry(3, 10, 1), entry(5, 40_000, 7), replace(entry(6, 30, 2), marks=marks)]
    assert unpack(pack(entries)) == entries
    assert unpack(pack(entries)[:-1]) == []  # cut short
    assert unpack(b"\x09" + pack(entries)[1:]) == []  # another format
    assert unpack(b"") == []


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


KEY = ("tenant", "conv")


def memory(**kw: Any) -> MemoryLedger:
    args: dict[str, Any] = {
        "max_tokens": 1000,
        "per_conversation": 500,
        "branches": 2,
        "ttl_s": 60.0,
    }
    return MemoryLedger(**{**args, **kw})


async def test_memory_ledger_bounds_branches_and_tokens() -> None:
    ledger = memory()
    await ledger.put(KEY, entry(2, 100, 1), set())
    await ledger.put(KEY, entry(4, 100, 2), set())
    await ledger.put(KEY, entry(6, 100, 3), set())
    assert [e.messages for e in await ledger.get(KEY)] == [6, 4]  # two branches, newest first
    # an entry supersedes the one it extends
    await ledger.put(KEY, entry(8, 100, 4), {entry(6, 100, 3).id})
    assert [e.messages for e in await ledger.get(KEY)] == [8, 4]
    # the conversation's token bound: what does not fit is not kept
    await ledger.put(KEY, entry(10, 450, 5), set())
    assert [e.messages for e in await ledger.get(KEY)] == [10]
    await ledger.put(KEY, entry(12, 501, 6), set())
    assert [e.messages for e in await ledger.get(KEY)] == [10]
    assert ledger.tokens == 450


async def test_memory_ledger_evicts_least_recently_used_and_expires() -> None:
    clock = Clock()
    ledger = memory(max_tokens=300, clock=clock)
    for i in range(3):
        await ledger.put((f"t{i}", "c"), entry(2, 100, i), set())
    await ledger.get(("t0", "c"))  # used: t1 is now the least recently used
    await ledger.put(("t3", "c"), entry(2, 100, 9), set())
    assert [len(await ledger.get((f"t{i}", "c"))) for i in range(4)] == [1, 0, 1, 1]
    assert ledger.tokens == 300
    clock.now += 61
    assert await ledger.get(("t0", "c")) == []
    await ledger.drop(("t2", "c"))
    assert await ledger.get(("t2", "c")) == []


@pytest.fixture
async def redis_client(redis_url: str, anyio_backend: str) -> AsyncIterator[Any]:
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        await client.aclose()


async def test_redis_ledger_is_shared_and_expires_with_the_router_ttl(redis_client: Any) -> None:
    prefix = f"test-{uuid.uuid4().hex}:"

    def replica() -> RedisLedger:
        return RedisLedger(redis_client, prefix=prefix, per_conversation=500, branches=2, ttl_s=0.5)

    a, b = replica(), replica()
    key = ("ten:ant", "conv%1")
    await a.put(key, entry(2, 100, 1), set())
    await b.put(key, entry(4, 100, 2), {entry(2, 100, 1).id})
    assert [e.messages for e in await a.get(key)] == [4]
    assert 0 < await redis_client.pttl(a.key(key)) <= 500
    assert a.key(key) == f"{prefix}identity:ten%3Aant:conv%251"
    await a.put(key, entry(6, 499, 3), set())
    assert [e.messages for e in await b.get(key)] == [6]  # the bound, in Redis too
    marked = replace(entry(8, 100, 4), marks=(Mark(2, 10, 30, b"m" * 16),))
    await a.put(key, marked, set())
    assert (await b.get(key))[0] == marked  # the marks too
    await b.drop(key)
    assert await a.get(key) == []
    await a.put(key, entry(2, 100, 1), set())
    await asyncio.sleep(0.6)
    assert await b.get(key) == []


# -- a streamed answer's message, accumulated by the relay -----------------------------------------
def _sse(*chunks: Any) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)


def test_the_relay_accumulates_the_streamed_message_and_passes_the_bytes() -> None:
    def chunk(delta: dict[str, Any], **choice: Any) -> dict[str, Any]:
        return {"id": "x", "choices": [{"index": 0, "delta": delta, **choice}]}

    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "read_file"}}
    body = (
        _sse(
            chunk({"role": "assistant", "content": ""}),
            chunk({"reasoning": "Read "}, token_ids=[1]),
            chunk({"reasoning": "it."}, token_ids=[2]),
            chunk({"tool_calls": [call]}, token_ids=[3]),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"path": '}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"a.py"}'}}]}),
            chunk({}, finish_reason="tool_calls", token_ids=[4]),
        )
        + b"data: [DONE]\n\n"
    )
    captured = Captured()
    relay = EventRelay(captured, keep_ids=True, keep_prompt_ids=True, accumulate=True)
    out = b"".join(relay.feed(body[i : i + 7]) for i in range(0, len(body), 7)) + relay.close()
    assert out == body
    assert captured.output_ids == [1, 2, 3, 4]
    message = captured.assistant_message()
    assert message is not None
    assert answer_digest(message) == answer_digest({**ANSWER, "reasoning": "Read it."})
    plain = Captured()
    EventRelay(plain, keep_ids=True, keep_prompt_ids=True).feed(body)
    assert plain.assistant_message() is None  # only when asked for


# -- which turns keep identity (a real simulator's /tokenize, in process) --------------------------
class Tokenizer:
    """``ask`` for :meth:`Identity.resolve`: an in-process simulator's ``/tokenize`` and
    ``/detokenize`` (its 4xx raised as the router raises them), counting the calls."""

    def __init__(self, template: str | None = None) -> None:
        app = create_sim(SimConfig(role="prefill", template=template))
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p")
        self.calls = 0

    async def ask(self, path: str, body: dict[str, Any]) -> Any:
        self.calls += 1
        r = await self.http.post(path, json=body)
        if 400 <= r.status_code < 500:
            raise UpstreamError(r.status_code, r.content)
        r.raise_for_status()
        return r.json()

    async def render(self, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
        body = {"model": MODEL, "messages": messages, "tools": TOOLS, **extra}
        tokens: list[int] = (await self.ask("/tokenize", body))["tokens"]
        return tokens


@pytest.fixture
async def tok(anyio_backend: str) -> AsyncIterator[Tokenizer]:
    t = Tokenizer()
    try:
        yield t
    finally:
        await t.http.aclose()


def request(
    messages: list[dict[str, Any]], conversation: str | None = "c1", **body: Any
) -> ClientRequest:
    raw = orjson.dumps({"model": MODEL, "messages": messages, "tools": TOOLS, **body})
    headers = {"x-conversation-id": conversation} if conversation else {}
    return parse_request(raw, headers, chat=True, config=CONFIG)


SYSTEM = {"role": "system", "content": "You read files."}
USER = {"role": "user", "content": "What is in a.py?"}


async def answered(
    identity: Identity, tok: Tokenizer, messages: list[dict[str, Any]], message: dict[str, Any]
) -> tuple[str | None, list[int], list[int]]:
    """One turn: resolve, render when not kept, and record an answer whose ids are what the
    template renders for ``message`` (as a model that generated it would have)."""
    req = request(messages)
    got = await identity.resolve(req, tok.ask)
    prompt = got.ids if got.ids is not None else await tok.render(messages)
    whole = await tok.render([*messages, message], add_generation_prompt=False)
    base = await tok.render(messages)
    assert whole[: len(base)] == base
    output = whole[len(base) :]
    output = output[: output.index(151645) + 1]  # up to and with <|im_end|>
    assert got.pending is not None
    await identity.record(got.pending, prompt, output, message)
    return got.outcome, prompt, output


def identity_of(**kw: Any) -> Identity:
    return Identity(memory(max_tokens=100_000, per_conversation=50_000), **kw)


async def test_a_history_that_repeats_the_answer_keeps_the_ids(tok: Tokenizer) -> None:
    identity = identity_of()
    answer = {"role": "assistant", "content": "It defines main()."}
    messages = [SYSTEM, USER]
    outcome, prompt, output = await answered(identity, tok, messages, answer)
    assert outcome == "rendered:first-turn"
    messages = [*messages, {**answer, "refusal": None}, {"role": "user", "content": "Why?"}]
    got = await identity.resolve(request(messages), tok.ask)
    assert got.outcome == KEPT and got.ids is not None
    # previous prompt + the answer's ids + the new message's ids alone
    assert got.ids[: len(prompt) + len(output)] == [*prompt, *output]
    job = AppendJob([messages[-1]], output, answer)
    plan = append_plan(job)
    assert got.ids[len(prompt) + len(output) :] == await run_plan_async(plan, _answer(tok))
    # the ids' int32 bytes come with them (the kept part's from the ledger), and survive a copy
    assert isinstance(got.ids, TokenIds) and got.ids.data == int32_le(list(got.ids))
    assert TokenIds(got.ids).data is got.ids.data
    # a full render agrees up to the answer, then renders it otherwise (Qwen3 drops the empty
    # think block the model generated): what the pull would have lost as drift
    full = await tok.render(messages)
    assert full[: len(prompt)] == prompt and full != got.ids


def _answer(tok: Tokenizer) -> Any:
    from agentkv.protocol.exact import ChatCall, TextCall

    async def answer(r: Any) -> Any:
        if isinstance(r, ChatCall):
            return await tok.render(
                r.messages,
                add_generation_prompt=r.add_generation_prompt,
                continue_final_message=r.continue_final_message,
            )
        if isinstance(r, TextCall):
            body = {"model": MODEL, "prompt": r.text, "add_special_tokens": False}
            return (await tok.ask("/tokenize", body))["tokens"]
        return (await tok.ask("/detokenize", {"model": MODEL, "tokens": r.ids}))["prompt"]

    return answer


async def test_tool_results_keep_the_ids_and_fixed_probes_are_cached(tok: Tokenizer) -> None:
    identity = identity_of()
    call = {**ANSWER, "content": ""}
    messages = [SYSTEM, USER]
    await answered(identity, tok, messages, call)
    result = {"role": "tool", "tool_call_id": "call_1", "content": "def main(): pass"}
    messages = [*messages, call, result]
    before = tok.calls
    got = await identity.resolve(request(messages), tok.ask)
    assert got.outcome == KEPT
    first = tok.calls - before
    # the next turn in the same context asks only for what depends on its messages
    reply = {"role": "assistant", "content": "It defines main."}
    await identity.record(got.pending, got.ids or [], [1, 2, 151645], reply)  # type: ignore[arg-type]
    before = tok.calls
    again = await identity.resolve(
        request([*messages, reply, {"role": "user", "content": "OK"}]), tok.ask
    )
    assert again.outcome == KEPT
    assert tok.calls - before == 1 < first


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("edit-user", "history-changed"),
        ("drop-system", "history-changed"),
        ("edit-answer", "answer-changed"),
        ("strip-reasoning", "answer-changed"),
        ("no-answer", "answer-changed"),
        ("tools", "context-changed"),
        ("kwargs", "context-changed"),
        ("continue", "options"),
        ("nothing-new", "options"),
    ],
)
async def test_a_changed_history_is_rendered(tok: Tokenizer, change: str, reason: str) -> None:
    identity = identity_of()
    answer = {"role": "assistant", "content": "It defines main().", "reasoning": "Easy."}
    await answered(identity, tok, [SYSTEM, USER], answer)
    sent = dict(answer)
    history: list[dict[str, Any]] = [SYSTEM, USER]
    body: dict[str, Any] = {}
    new: list[dict[str, Any]] = [{"role": "user", "content": "Why?"}]
    if change == "edit-user":
        history = [SYSTEM, {**USER, "content": "What is in b.py?"}]
    elif change == "drop-system":
        history = [USER]
    elif change == "edit-answer":
        sent["content"] = "It defines run()."
    elif change == "strip-reasoning":
        del sent["reasoning"]
    elif change == "no-answer":
        sent = {"role": "user", "content": "Hm."}
    elif change == "tools":
        body["tools"] = [*TOOLS, function_tool("grep", "Search", pattern="string")]
    elif change == "kwargs":
        body["chat_template_kwargs"] = {"enable_thinking": False}
    elif change == "continue":
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        new = []
    got = await identity.resolve(request([*history, sent, *new], **body), tok.ask)
    assert (got.outcome, got.ids) == (f"rendered:{reason}", None)


async def test_turns_that_identity_does_not_cover(tok: Tokenizer) -> None:
    identity = identity_of()
    answer = {"role": "assistant", "content": "It defines main()."}
    await answered(identity, tok, [SYSTEM, USER], answer)
    later = [SYSTEM, USER, answer, {"role": "user", "content": "Why?"}]
    assert (await identity.resolve(request(later, None), tok.ask)).outcome == (
        "rendered:no-conversation"
    )
    ids = request(later, kv_transfer_params={"prompt_token_ids": [1, 2, 3]})
    assert (await identity.resolve(ids, tok.ask)).outcome == "rendered:exact-ids"
    other = request(later)
    other.conversation_id = "c2"
    assert (await identity.resolve(other, tok.ask)).outcome == "rendered:no-record"
    off = Identity(identity.ledger, enabled=False)
    assert (await off.resolve(request(later), tok.ask)).outcome == "rendered:disabled"
    raw = orjson.dumps({"model": MODEL, "prompt": "hi"})
    text = parse_request(raw, {"x-conversation-id": "c1"}, chat=False, config=CONFIG)
    assert (await identity.resolve(text, tok.ask)).outcome is None
    await identity.drop((request(later).tenant, "c1"))
    assert (await identity.resolve(request(later), tok.ask)).outcome == "rendered:no-record"


async def test_the_branch_the_history_extends_is_the_one_used(tok: Tokenizer) -> None:
    identity = identity_of()
    a = {"role": "assistant", "content": "Branch A."}
    b = {"role": "assistant", "content": "Branch B."}
    _, prompt_a, out_a = await answered(identity, tok, [SYSTEM, USER], a)
    other_user = {"role": "user", "content": "What is in b.py?"}
    await answered(identity, tok, [SYSTEM, other_user], b)
    got = await identity.resolve(
        request([SYSTEM, USER, a, {"role": "user", "content": "?"}]), tok.ask
    )
    assert got.outcome == KEPT and got.ids is not None
    assert got.ids[: len(prompt_a) + len(out_a)] == [*prompt_a, *out_a]


@pytest.fixture
def blind_template(tmp_path: Path) -> Iterator[str]:
    """A template that does not render assistant messages: no probe finds its marker."""
    path = tmp_path / "blind.jinja"
    path.write_text(
        "{% for m in messages %}{% if m.role != 'assistant' %}<|im_start|>{{ m.role }}\n"
        "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    yield str(path)


async def test_a_template_the_probes_cannot_read_is_rendered(blind_template: str) -> None:
    blind = Tokenizer(blind_template)
    try:
        identity = identity_of()
        answer = {"role": "assistant", "content": "Fine."}
        messages = [SYSTEM, USER]
        got = await identity.resolve(request(messages), blind.ask)
        assert got.pending is not None
        await identity.record(got.pending, await blind.render(messages), [5, 151645], answer)
        later = [*messages, answer, {"role": "user", "content": "?"}]
        assert (await identity.resolve(request(later), blind.ask)).outcome == "rendered:template"
    finally:
        await blind.http.aclose()


async def test_a_failing_tokenizer_costs_identity_not_the_turn(tok: Tokenizer) -> None:
    identity = identity_of()
    answer = {"role": "assistant", "content": "It defines main()."}
    await answered(identity, tok, [SYSTEM, USER], answer)
    later = [SYSTEM, USER, answer, {"role": "user", "content": "Why?"}]
    async with httpx.AsyncClient(base_url="http://127.0.0.1:9") as nowhere:

        async def down(path: str, body: dict[str, Any]) -> Any:
            return (await nowhere.post(path, json=body)).json()

        got = await identity.resolve(request(later), down)
    assert (got.outcome, got.ids) == ("rendered:probe-failed", None)
    assert got.pending is not None


async def test_a_failing_ledger_costs_identity_not_the_turn(tok: Tokenizer) -> None:
    import redis.asyncio

    dead = redis.asyncio.Redis.from_url("redis://127.0.0.1:9/0", socket_connect_timeout=0.2)
    errors: list[str] = []
    ledger = RedisLedger(dead, prefix="x:", per_conversation=100, branches=1, ttl_s=10)
    identity = Identity(ledger, on_error=errors.append)
    try:
        req = request([SYSTEM, USER, {"role": "assistant", "content": "a"}, USER])
        got = await identity.resolve(req, tok.ask)
        assert got.outcome == "rendered:no-record"
        assert isinstance(got.pending, Pending)
        await identity.record(got.pending, [1, 2], [3], {"role": "assistant", "content": "b"})
    finally:
        await dead.aclose()
    assert errors == ["identity_get", "identity_put"]


# -- a rewritten history keeps the ids of its unchanged prefix ------------------------------------
def _turn_answer(i: int) -> dict[str, Any]:
    return {"role": "assistant", "content": f"Answer {i}: it defines f{i}().", "reasoning": "Hm."}


async def _conversation(
    identity: Identity, tok: Tokenizer, turns: int
) -> tuple[list[dict[str, Any]], list[tuple[list[int], list[int]]]]:
    """``turns`` answered turns, each after the first kept: the history and each turn's
    (prompt, output)."""
    messages: list[dict[str, Any]] = [SYSTEM, USER]
    ids = []
    for i in range(turns):
        outcome, prompt, output = await answered(identity, tok, messages, _turn_answer(i))
        assert outcome == ("rendered:first-turn" if i == 0 else KEPT)
        ids.append((prompt, output))
        messages = [*messages, _turn_answer(i), {"role": "user", "content": f"And f{i + 1}?"}]
    return messages[:-1], ids


async def _prefix_kept(
    identity: Identity,
    tok: Tokenizer,
    messages: list[dict[str, Any]],
    upto: tuple[list[int], list[int]],
    answer_at: int,
) -> list[int]:
    """Resolve ``messages`` and check it keeps ``upto``'s prompt and answer, then the ids of
    the messages after the answer at ``answer_at`` exactly as the template renders them."""
    got = await identity.resolve(request(messages), tok.ask)
    assert got.outcome == KEPT_PREFIX and got.ids is not None
    prompt, output = upto
    kept = len(prompt) + len(output)
    assert got.ids[:kept] == [*prompt, *output]
    job = AppendJob(messages[answer_at + 1 :], output, messages[answer_at])
    tail = await run_plan_async(append_plan(job), _answer(tok))
    assert got.ids[kept:] == tail
    # what follows the kept answer is what the client sent: the template's own rendering
    full = await tok.render(messages)
    assert full[len(full) - len(tail) :] == tail and full != got.ids
    return got.ids


async def test_a_rewrite_that_keeps_the_first_messages_keeps_their_ids(tok: Tokenizer) -> None:
    identity = identity_of()
    history, ids = await _conversation(identity, tok, 4)
    # a compaction that keeps the first two answers (messages 0-4) and summarizes the rest
    summary = {"role": "user", "content": "Summary: f2 and f3 print numbers. Go on."}
    rewritten = [*history[:5], summary]
    assert [m["role"] for m in rewritten[2:5:2]] == ["assistant", "assistant"]
    got = await _prefix_kept(identity, tok, rewritten, ids[1], 4)
    # that turn is kept with its own prefix: the next turn extends it as usual
    reply = {"role": "assistant", "content": "Going on."}
    await identity.record(
        (await identity.resolve(request(rewritten), tok.ask)).pending,  # type: ignore[arg-type]
        got,
        [7, 151645],
        reply,
    )
    later = [*rewritten, reply, {"role": "user", "content": "Then?"}]
    again = await identity.resolve(request(later), tok.ask)
    assert again.outcome == KEPT and again.ids is not None
    assert again.ids[: len(got) + 2] == [*got, 7, 151645]
    # and a rewrite of that one still finds the first answers' ids
    back = [*history[:3], {"role": "user", "content": "Only f1, please."}]
    await _prefix_kept(identity, tok, back, ids[0], 2)


@pytest.mark.parametrize("change", ["strip-reasoning", "edit-answer", "edit-user", "edit-tool"])
async def test_the_kept_prefix_stops_before_the_first_change(tok: Tokenizer, change: str) -> None:
    identity = identity_of()
    history, ids = await _conversation(identity, tok, 4)
    new = {"role": "user", "content": "Next?"}
    changed = [dict(m) for m in history]
    if change == "strip-reasoning":  # every answer from the third on, as a client strips them
        for m in changed[6:]:
            m.pop("reasoning", None)
        first = 6
    elif change == "edit-answer":
        changed[6]["content"] = "Answer 2: it defines g()."
        first = 6
    elif change == "edit-user":
        changed[5]["content"] = "And g?"
        first = 5
    else:  # a tool result in place of a user message
        changed[3] = {"role": "tool", "tool_call_id": "call_1", "content": "f1"}
        first = 3
    # the last answer before the first change is the last one kept
    answer_at = max(i for i in (2, 4, 6, 8) if i < first)
    got = await _prefix_kept(identity, tok, [*changed, new], ids[answer_at // 2 - 1], answer_at)
    # nothing of the changed message's recorded ids: the prompt holds the client's version
    assert len(got) >= len(ids[answer_at // 2 - 1][0])


async def test_an_edit_before_the_first_answer_keeps_nothing(tok: Tokenizer) -> None:
    identity = identity_of()
    history, _ = await _conversation(identity, tok, 3)
    edited = [SYSTEM, {**USER, "content": "What is in b.py?"}, *history[2:]]
    got = await identity.resolve(request([*edited, USER]), tok.ask)
    assert (got.outcome, got.ids) == ("rendered:history-changed", None)
    # another context keeps nothing either
    other = await identity.resolve(
        request([*history[:3], USER], chat_template_kwargs={"enable_thinking": False}), tok.ask
    )
    assert (other.outcome, other.ids) == ("rendered:history-changed", None)


async def test_marks_are_bounded(tok: Tokenizer) -> None:
    identity = identity_of()
    answer = {"role": "assistant", "content": "It defines main()."}
    later = request([SYSTEM, USER, answer, {"role": "user", "content": "Why?"}])
    marks = tuple(Mark(0, i, i + 1, bytes([i]) * 16) for i in range(MAX_MARKS))
    e = Entry(
        2,
        prefix_digests([SYSTEM, USER], {2})[2],
        answer_digest(answer),
        context_digest(later.body),
        PackedIds.of(await tok.render([SYSTEM, USER])),
        PackedIds.of([5, 151645]),
        marks,
    )
    await identity.ledger.put((later.tenant, "c1"), e, set())
    got = await identity.resolve(later, tok.ask)
    assert got.outcome == KEPT and got.pending is not None
    # one more than the bound: the oldest quarter and the most recent stay
    assert len(got.pending.marks) == MAX_MARKS
    assert got.pending.marks[: MAX_MARKS // 4] == marks[: MAX_MARKS // 4]
    assert got.pending.marks[MAX_MARKS // 4] == marks[MAX_MARKS // 4 + 1]
    assert got.pending.marks[-1] == e.own_mark()
