"""Conversation ids from each harness's own signal (issue 22, item 3): units of the precedence,
and one e2e turn pair per signal through real processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from agentkv.protocol.promtext import parse_metrics
from agentkv.router.session import SOURCES, conversation_of
from tests._support.stack import MODEL, exact, stack

UUID = "8a3c9f2e-51d4-4c1b-9d0e-2b7f6a1c3e55"
OTHER = "1f0e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"

CASES: list[tuple[dict[str, str], dict[str, Any], str | None, str]] = [
    ({"x-conversation-id": "c1", "x-session-id": "s1"}, {}, "c1", "agentkv"),
    ({}, {"conversation_id": "c2", "session_id": "s2"}, "c2", "agentkv"),
    ({"x-session-id": "s3", "x-claude-code-session-id": UUID}, {}, "s3", "session"),
    ({}, {"session_id": "s4", "prompt_cache_key": "k4"}, "s4", "session"),
    ({"x-claude-code-session-id": UUID, "session-id": OTHER}, {}, UUID, "claude-code"),
    (
        {},
        {"metadata": {"user_id": orjson.dumps({"device_id": "d", "session_id": UUID}).decode()}},
        UUID,
        "claude-code",
    ),
    (
        {},
        {"metadata": {"user_id": f"user_ab12_account_{OTHER}_session_{UUID}"}},
        UUID,
        "claude-code",
    ),
    (
        {"x-claude-code-session-id": UUID, "x-claude-code-agent-id": "agent-7"},
        {},
        f"{UUID}/agent/agent-7",
        "claude-code",
    ),
    ({"session-id": UUID, "thread-id": OTHER}, {"prompt_cache_key": OTHER}, UUID, "codex"),
    ({"session_id": UUID}, {}, UUID, "codex"),
    ({"thread-id": UUID}, {}, UUID, "codex"),
    ({"x-session-affinity": OTHER}, {"prompt_cache_key": UUID}, UUID, "prompt-cache-key"),
    ({"x-session-affinity": UUID, "x-dynamo-session-id": OTHER}, {}, UUID, "opencode"),
    ({"x-opencode-session": UUID}, {}, UUID, "opencode"),
    ({"x-dynamo-session-id": UUID}, {}, UUID, "dynamo"),
    ({}, {"metadata": {"user_id": "not json, no session"}}, None, "none"),
    ({}, {"metadata": {"user_id": "{broken"}}, None, "none"),
    ({}, {"metadata": "a string", "session_id": 5}, None, "none"),
    ({"x-claude-code-session-id": ""}, {}, None, "none"),
]


@pytest.mark.parametrize(("headers", "body", "conversation", "source"), CASES)
def test_each_signal_in_its_place(
    headers: dict[str, str], body: dict[str, Any], conversation: str | None, source: str
) -> None:
    assert conversation_of(headers, body) == (conversation, source)
    assert source == "none" or source in SOURCES


HARNESS_HEADERS = [
    {"X-Claude-Code-Session-Id": UUID},
    {"session-id": UUID, "thread-id": UUID},
    {"x-session-affinity": UUID},
    {"X-Dynamo-Session-ID": UUID},
]


@pytest.mark.e2e
@pytest.mark.paths_pull  # P's read of D's KV is what it checks (tests/_support/router_config.py)
def test_a_plain_client_with_a_harness_header_pulls(tmp_path: Path) -> None:
    """Chat Completions with exact ids and nothing but a harness's session header: turn 2
    pulls what turn 1 left on D, under each header, and the source is counted."""
    with stack(tmp_path) as s:
        for n, extra in enumerate(HARNESS_HEADERS):
            headers = {k: v.replace(UUID[:8], f"{n:08d}") for k, v in extra.items()}
            ids = [(n * 131 + i * 17) % 20_000 + 200 for i in range(300)]
            first = exact(s, None, ids, headers=headers, max_tokens=12)
            assert first.status_code == 200, first.text
            assert first.headers["x-agentkv-decision"] == "miss"
            out = first.json()["choices"][0]["token_ids"]
            second = exact(s, None, [*ids, *out, *range(500, 540)], headers=headers, max_tokens=12)
            assert second.headers["x-agentkv-decision"] == "pull", (extra, second.headers)
            assert int(second.headers["x-agentkv-verified-prefix-tokens"]) >= len(ids)
        text = httpx.get(f"{s.router.url}/metrics", timeout=10).text
        sources = parse_metrics(text, by="source")
        for source in ("claude-code", "codex", "opencode", "dynamo"):
            assert sources.get(f"agentkv_router_conversation_sources_total[{source}]") == 2, sources
        assert s.wrong_kv() == 0


@pytest.mark.e2e
def test_the_sdk_closes_a_conversation_whose_id_has_url_characters(tmp_path: Path) -> None:
    """An id with ``/``, ``?``, ``#`` and ``%`` is percent-encoded by the SDK and decoded by the
    router: closing it releases the handle its turn left on D."""
    import agentkv

    with stack(tmp_path) as s:
        client = agentkv.Client(base_url=f"{s.router.url}/v1", api_key="sk-local")
        conv = client.conversation("team/a?b#c%d", model=MODEL, system="Keep it short.")
        conv.add_user("hello")
        conv.create(max_tokens=4)
        health = httpx.get(f"{s.router.url}/health", timeout=10).json()
        assert health["handles"] == 1, health
        assert conv.close() is True
        health = httpx.get(f"{s.router.url}/health", timeout=10).json()
        assert health["handles"] == 0, health
        client.close()
