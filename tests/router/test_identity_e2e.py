"""Token identity kept by the router, between real simulator processes: plain Chat Completions
clients (the ``openai`` SDK, no agentkv SDK) that send their history back as messages pull the
previous prompt *and* the previous answer, with no drift; a client that edits its history gets
exactly its own rendering; two replicas share what they keep through Redis."""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import openai
import pytest

from agentkv.protocol import HEADER_IDENTITY, HEADER_TRIM_CAUSE, HEADER_VERIFIED_PREFIX_TOKENS
from tests._support.agents import SYSTEM, TOOLS
from tests._support.stack import MODEL, Stack, stack

pytestmark = pytest.mark.e2e

NO_P_CACHE = (("--no-prefix-caching",),)
"""P recomputes what it does not read from D: what the pull covers is all P skips."""

CALL = {"name": "read_file", "arguments": {"path": "src/app.py"}}
SCRIPTS: list[dict[str, Any]] = [
    {"reasoning": "I should read the file first.", "content": "", "tool_calls": [CALL]},
    {"reasoning": "The file is short.", "content": "It defines main(), which prints 42. " * 4},
    {"reasoning": "A small change.", "content": "Rename main() to run() and keep the print."},
    {"reasoning": "Nothing else.", "content": "That is all it needs. " * 3},
]


class PlainChat:
    """A Chat Completions client as agents write them: the ``openai`` SDK, the history sent
    back as messages (the assistant message as received, reasoning included), a conversation
    id header, and nothing of agentkv."""

    def __init__(self, base_url: str, conversation: str) -> None:
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="k", max_retries=0)
        self.headers = {"X-Conversation-Id": conversation}
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]

    def turn(self, script: dict[str, Any], *, stream: bool) -> dict[str, Any]:
        """One request; the answer is appended to the history. Returns its receipt headers,
        usage, the ids the engine ran and generated (``return_token_ids``), and the message."""
        extra = {"agentkv_sim": script, "return_token_ids": True}
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "messages": self.messages,
            "tools": TOOLS,
            "max_tokens": 200,
            "extra_headers": self.headers,
            "extra_body": extra,
        }
        if stream:
            raw = self.client.chat.completions.with_raw_response.create(
                **kwargs, stream=True, stream_options={"include_usage": True}
            )
            message, usage, prompt_ids, out_ids = _accumulate(raw.parse())
        else:
            raw = self.client.chat.completions.with_raw_response.create(**kwargs)
            completion = raw.parse()
            choice = completion.choices[0]
            message = choice.message.model_dump(exclude_none=True)
            usage = completion.usage.model_dump() if completion.usage else {}
            prompt_ids = (completion.model_extra or {})["prompt_token_ids"]
            out_ids = (choice.model_extra or {})["token_ids"]
        self.messages.append(message)
        return {
            "headers": dict(raw.headers),
            "usage": usage,
            "prompt_ids": prompt_ids,
            "output_ids": out_ids,
            "message": message,
        }

    def close(self) -> None:
        self.client.close()


def _accumulate(chunks: Any) -> tuple[dict[str, Any], dict[str, Any], list[int], list[int]]:
    """What a streaming client keeps: content, reasoning and tool calls concatenated."""
    content, reasoning, calls = "", "", {}
    usage: dict[str, Any] = {}
    prompt_ids: list[int] = []
    out_ids: list[int] = []
    for chunk in chunks:
        extra = chunk.model_extra or {}
        prompt_ids = extra.get("prompt_token_ids") or prompt_ids
        if chunk.usage:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            out_ids += (choice.model_extra or {}).get("token_ids") or []
            delta = choice.delta.model_dump(exclude_none=True)
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                slot["id"] += call.get("id") or ""
                fn = call.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for _, c in sorted(calls.items())
        ]
    return message, usage, prompt_ids, out_ids


def _tool_result(chat: PlainChat, done: dict[str, Any], text: str) -> None:
    call = done["message"]["tool_calls"][0]
    chat.messages.append({"role": "tool", "tool_call_id": call["id"], "content": text})


def _p_tokenize(s: Stack, messages: list[dict[str, Any]]) -> list[int]:
    """P's own rendering of ``messages`` (its /tokenize, as the engine would template them)."""
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "add_generation_prompt": True}
    r = httpx.post(f"{s.prefill[0].url}/tokenize", json=body, timeout=30)
    r.raise_for_status()
    tokens: list[int] = r.json()["tokens"]
    return tokens


def _four_turns(chat: PlainChat, streams: tuple[bool, ...]) -> list[dict[str, Any]]:
    """A tool call, its result, an answer, two more questions."""
    turns = []
    chat.messages.append({"role": "user", "content": "What does src/app.py do?"})
    for i, (script, stream) in enumerate(zip(SCRIPTS, streams, strict=True)):
        done = chat.turn(script, stream=stream)
        turns.append(done)
        if i == 0:
            _tool_result(chat, done, "def main():\n    print(42)\n" * 3)
        else:
            chat.messages.append({"role": "user", "content": f"And then ({i})?"})
    return turns


def _assert_kept(turns: list[dict[str, Any]]) -> None:
    first = turns[0]["headers"]
    assert first[HEADER_IDENTITY.lower()] == "rendered:first-turn"
    for before, now in itertools.pairwise(turns):
        headers = now["headers"]
        held = before["usage"]["prompt_tokens"] + before["usage"]["completion_tokens"] - 1
        assert headers[HEADER_IDENTITY.lower()] == "kept", headers
        assert HEADER_TRIM_CAUSE.lower() not in headers, headers
        assert headers["x-agentkv-decision"] == "pull", headers
        # D holds the previous prompt + its answer (minus the last token): all of it verifies
        assert int(headers[HEADER_VERIFIED_PREFIX_TOKENS.lower()]) >= held, headers
        # the engine ran the previous prompt + the ids it generated, then the new messages
        assert now["prompt_ids"][: len(before["prompt_ids"])] == before["prompt_ids"]
        start = len(before["prompt_ids"])
        assert now["prompt_ids"][start : start + len(before["output_ids"])] == before["output_ids"]


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with stack(tmp_path_factory.mktemp("identity"), p_args=NO_P_CACHE) as s:
        yield s


@pytest.mark.parametrize(
    "streams",
    [(False, False, False, False), (True, True, True, True), (False, True, False, True)],
    ids=["plain", "streamed", "mixed"],
)
def test_plain_clients_pull_prompt_and_answer_without_drift(pd: Stack, streams: Any) -> None:
    chat = PlainChat(pd.router.url, f"plain-{streams}")
    try:
        turns = _four_turns(chat, streams)
    finally:
        chat.close()
    _assert_kept(turns)
    assert turns[0]["message"]["tool_calls"][0]["function"]["name"] == "read_file"
    assert pd.wrong_kv() == 0


def test_without_identity_the_same_client_drifts(tmp_path: Any) -> None:
    """The baseline: with ``keep_token_identity`` off the same client's pulls are trimmed as
    drift (the answer re-renders differently under the template)."""
    with stack(tmp_path, p_args=NO_P_CACHE, router={"keep_token_identity": False}) as s:
        chat = PlainChat(s.router.url, "baseline")
        try:
            turns = _four_turns(chat, (False, True, False, True))
        finally:
            chat.close()
        for turn in turns:
            assert turn["headers"][HEADER_IDENTITY.lower()] == "rendered:disabled"
        assert [t["headers"].get(HEADER_TRIM_CAUSE.lower()) for t in turns[1:]] == ["drift"] * 3
        assert s.wrong_kv() == 0


def test_streams_re_streamed_from_vllm_032_keep_identity(tmp_path: Any) -> None:
    """D without the handle on streams: the router reads D whole and re-streams it; the
    message it keeps is the non-streamed answer's."""
    with stack(
        tmp_path,
        p_args=NO_P_CACHE,
        d_args=(("--compat", "0.32"),),
        backend={"handle_on_stream": False},
    ) as s:
        chat = PlainChat(s.router.url, "vllm-032")
        try:
            turns = _four_turns(chat, (True, True, True, True))
        finally:
            chat.close()
        _assert_kept(turns)
        assert s.wrong_kv() == 0


@pytest.mark.parametrize("change", ["edited", "reasoning-stripped"])
def test_a_changed_answer_is_rendered_as_the_client_sent_it(pd: Stack, change: str) -> None:
    chat = PlainChat(pd.router.url, f"changed-{change}")
    try:
        chat.messages.append({"role": "user", "content": "What does src/app.py do?"})
        first = chat.turn(SCRIPTS[0], stream=False)
        _tool_result(chat, first, "def main():\n    print(42)\n")
        second = chat.turn(SCRIPTS[1], stream=True)
        assert second["headers"][HEADER_IDENTITY.lower()] == "kept"
        answer = chat.messages[-1]
        if change == "edited":
            answer["content"] = answer["content"].replace("42", "43")
        else:
            del answer["reasoning"]
        chat.messages.append({"role": "user", "content": "Sure?"})
        expected = _p_tokenize(pd, chat.messages)
        third = chat.turn(SCRIPTS[2], stream=False)
    finally:
        chat.close()
    headers = third["headers"]
    assert headers[HEADER_IDENTITY.lower()] == "rendered:answer-changed"
    # the engine ran exactly P's rendering of the client's messages, nothing of its own
    assert third["prompt_ids"] == expected
    assert third["usage"]["prompt_tokens"] == len(expected)
    # reuse stays at the verified prefix: short of the previous answer
    held = second["usage"]["prompt_tokens"] + second["usage"]["completion_tokens"] - 1
    verified = int(headers[HEADER_VERIFIED_PREFIX_TOKENS.lower()])
    assert 0 < verified < held
    assert headers[HEADER_TRIM_CAUSE.lower()] == "drift"
    assert third["prompt_ids"][:verified] == second["prompt_ids"][:verified]
    assert pd.wrong_kv() == 0


def test_a_closed_conversation_forgets_its_answers(pd: Stack) -> None:
    chat = PlainChat(pd.router.url, "closed")
    try:
        chat.messages.append({"role": "user", "content": "Hello."})
        chat.turn(SCRIPTS[1], stream=False)
        r = httpx.delete(f"{pd.router.url}/v1/conversations/closed", timeout=10)
        assert r.status_code == 200
        chat.messages.append({"role": "user", "content": "Again."})
        again = chat.turn(SCRIPTS[2], stream=False)
    finally:
        chat.close()
    assert again["headers"][HEADER_IDENTITY.lower()] == "rendered:no-record"
    assert pd.wrong_kv() == 0


def test_two_replicas_share_identity_through_redis(tmp_path: Any, redis_url: str) -> None:
    with stack(tmp_path, p_args=NO_P_CACHE, router={"store": redis_url}, routers=2) as s:
        chats = [PlainChat(r.url, "shared-identity") for r in s.routers]
        turns = []
        try:
            chats[0].messages.append({"role": "user", "content": "What does src/app.py do?"})
            for i, script in enumerate(SCRIPTS):
                chat = chats[i % 2]  # every turn on the other replica
                if i:
                    chat.messages = list(chats[(i - 1) % 2].messages)
                done = chat.turn(script, stream=bool(i % 2))
                turns.append(done)
                if i == 0:
                    _tool_result(chat, done, "def main():\n    print(42)\n")
                else:
                    chat.messages.append({"role": "user", "content": f"And then ({i})?"})
        finally:
            for chat in chats:
                chat.close()
        _assert_kept(turns)
        assert s.wrong_kv() == 0
