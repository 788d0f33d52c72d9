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
from tests._support.stack import MODEL, NO_P_CACHE, Stack, stack, vllm_032_stack
from tests._support.templates import TEMPLATES_DIR

QWEN3 = str(TEMPLATES_DIR / "qwen3.jinja")

# paths.mode = "pull" (tests/_support/router_config.py): these tests check P's reads of
# D's KV (decision `pull`, X-AgentKV-Reused-Tokens, P's counters), which the default
# `choose` skips for a short turn by decoding it on D in place (test_paths_e2e.py)
pytestmark = [pytest.mark.e2e, pytest.mark.paths_pull]

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
    """The baseline: with ``identity.keep`` off the same client's pulls are trimmed as
    drift (the answer re-renders differently under the template)."""
    with stack(tmp_path, p_args=NO_P_CACHE, router={"identity": {"keep": False}}) as s:
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
    with vllm_032_stack(tmp_path) as s:
        chat = PlainChat(s.router.url, "vllm-032")
        try:
            turns = _four_turns(chat, (True, True, True, True))
        finally:
            chat.close()
        _assert_kept(turns)
        assert s.wrong_kv() == 0


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _assert_prefix_kept(
    s: Stack, turn: dict[str, Any], messages: list[dict[str, Any]], upto: dict[str, Any]
) -> int:
    """``turn`` ran ``upto``'s prompt and answer as generated, then exactly P's rendering of
    the client's messages after that answer (the tail of a whole rendering). Returns where the
    kept ids end."""
    assert turn["headers"][HEADER_IDENTITY.lower()] == "kept-prefix", turn["headers"]
    kept = [*upto["prompt_ids"], *upto["output_ids"]]
    assert turn["prompt_ids"][: len(kept)] == kept
    tail = turn["prompt_ids"][len(kept) :]
    whole = _p_tokenize(s, messages)
    assert tail and whole[len(whole) - len(tail) :] == tail
    assert turn["usage"]["prompt_tokens"] == len(turn["prompt_ids"])
    return len(kept)


@pytest.mark.parametrize("change", ["edited", "reasoning-stripped"])
def test_a_changed_answer_keeps_the_prefix_before_it(pd: Stack, change: str) -> None:
    """The last answer changed: the ids up to the answer before it are kept, the changed
    answer is rendered as the client sent it."""
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
        messages = list(chat.messages)
        third = chat.turn(SCRIPTS[2], stream=False)
    finally:
        chat.close()
    kept = _assert_prefix_kept(pd, third, messages, first)
    headers = third["headers"]
    # reuse covers the first answer and its tool call, and stops short of the changed one
    held = second["usage"]["prompt_tokens"] + second["usage"]["completion_tokens"] - 1
    verified = int(headers[HEADER_VERIFIED_PREFIX_TOKENS.lower()])
    assert kept - 16 < verified < held
    assert headers[HEADER_TRIM_CAUSE.lower()] == "drift"
    assert third["prompt_ids"][:verified] == second["prompt_ids"][:verified]
    assert pd.wrong_kv() == 0


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """P and D with the real Qwen3 template of ``../shared/chat-templates``."""
    template = ("--template", QWEN3)
    p_args = (("--no-prefix-caching", *template),)
    with stack(tmp_path_factory.mktemp("qwen3"), p_args=p_args, d_args=(template,)) as s:
        yield s


def test_a_rewrite_that_keeps_the_first_messages_pulls_their_ids(qwen3: Stack) -> None:
    """A compaction that keeps the first five messages (a tool call, its result, an answer):
    the next turn prompts with their recorded ids, tool call as generated, and pulls them all
    from D; a whole rendering would have left D at the first answer."""
    chat = PlainChat(qwen3.router.url, "rewrite-keeps-prefix")
    try:
        turns = _four_turns(chat, (False, True, False, True))
        _assert_kept(turns)
        last = turns[-1]
        held = [*last["prompt_ids"], *last["output_ids"][:-1]]  # what D holds
        chat.messages = [*chat.messages[:5], {"role": "user", "content": "Summary: main prints."}]
        messages = list(chat.messages)
        whole = _p_tokenize(qwen3, messages)
        rewritten = chat.turn(SCRIPTS[3], stream=False)
        chat.messages.append({"role": "user", "content": "Go on."})
        after = chat.turn(SCRIPTS[2], stream=True)
    finally:
        chat.close()
    kept = _assert_prefix_kept(qwen3, rewritten, messages, turns[1])
    headers = rewritten["headers"]
    verified = int(headers[HEADER_VERIFIED_PREFIX_TOKENS.lower()])
    assert headers["x-agentkv-decision"] == "pull"
    assert verified >= kept // 16 * 16
    # more than the client's history rendered whole would have read back
    assert _common(whole, held) < kept // 16 * 16 <= verified
    assert int(headers["x-agentkv-reused-tokens"]) >= kept // 16 * 16
    # the turn after the rewrite extends it as usual
    assert after["headers"][HEADER_IDENTITY.lower()] == "kept"
    assert HEADER_TRIM_CAUSE.lower() not in after["headers"]
    assert qwen3.wrong_kv() == 0


@pytest.mark.parametrize("edit", ["tool-result", "first-user"])
def test_an_edited_early_message_keeps_nothing_past_the_edit(qwen3: Stack, edit: str) -> None:
    chat = PlainChat(qwen3.router.url, f"edit-{edit}")
    try:
        turns = _four_turns(chat, (False, False, True, False))
        if edit == "tool-result":
            chat.messages[3] = {**chat.messages[3], "content": "def main():\n    print(7)\n"}
        else:
            chat.messages[1] = {"role": "user", "content": "What does src/lib.py do?"}
        chat.messages.append({"role": "user", "content": "Once more?"})
        messages = list(chat.messages)
        edited = chat.turn(SCRIPTS[3], stream=False)
    finally:
        chat.close()
    headers = edited["headers"]
    verified = int(headers[HEADER_VERIFIED_PREFIX_TOKENS.lower()])
    if edit == "tool-result":
        # the first answer (the tool call) is kept; the edited result is the client's own
        kept = _assert_prefix_kept(qwen3, edited, messages, turns[0])
        assert kept - 16 < verified < len(turns[1]["prompt_ids"])
    else:
        assert headers[HEADER_IDENTITY.lower()] == "rendered:history-changed"
        assert edited["prompt_ids"] == _p_tokenize(qwen3, messages)
        assert verified < len(turns[0]["prompt_ids"])
    assert headers[HEADER_TRIM_CAUSE.lower()] == "drift"
    assert qwen3.wrong_kv() == 0


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
    with stack(
        tmp_path, p_args=NO_P_CACHE, router={"store": {"backend": redis_url}}, routers=2
    ) as s:
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
