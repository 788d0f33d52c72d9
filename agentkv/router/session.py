"""Which conversation a request belongs to, from each client's own signal.

Agents do not send agentkv's header; each harness names its session its own way. The first
source present wins, in this order (docs/router.md, "Conversation ids"):

====================  =========================================================================
source                signal
====================  =========================================================================
``agentkv``           header ``X-Conversation-Id``, then body ``conversation_id`` (vLLM's example
                      proxy and multi-turn benchmark)
``session``           header ``X-Session-ID`` (vLLM, vllm-router, opencode), then body
                      ``session_id`` (vLLM's own field)
``claude-code``       header ``X-Claude-Code-Session-Id``, then body ``metadata.user_id``: a JSON
                      string holding ``session_id``, or the legacy
                      ``user_<hash>_account_<uuid>_session_<uuid>``; ``X-Claude-Code-Agent-Id``
                      makes a sub-agent a conversation of its own within the session
``codex``             headers ``session-id``, ``session_id``, ``thread-id``
``prompt-cache-key``  body ``prompt_cache_key`` (OpenAI's; Codex sends its session there too)
``opencode``          headers ``x-session-affinity``, ``x-opencode-session``
``dynamo``            header ``X-Dynamo-Session-ID``
====================  =========================================================================
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson

from agentkv.protocol import (
    BODY_CONVERSATION_ID,
    BODY_PROMPT_CACHE_KEY,
    BODY_SESSION_ID,
    HEADER_CLAUDE_CODE_AGENT_ID,
    HEADER_CLAUDE_CODE_SESSION_ID,
    HEADER_CODEX_SESSION_IDS,
    HEADER_CONVERSATION_ID,
    HEADER_DYNAMO_SESSION_ID,
    HEADER_OPENCODE_SESSION_IDS,
    HEADER_SESSION_ID,
)

__all__ = ["SOURCES", "conversation_of"]

SOURCES = ("agentkv", "session", "claude-code", "codex", "prompt-cache-key", "opencode", "dynamo")
"""Every source, in precedence order (``none``: the request named no conversation;
``response-chain``: a Responses request named by its ``previous_response_id`` chain)."""

_LEGACY_USER_ID = re.compile(r"_session_([0-9A-Za-z-]{8,64})$")


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _claude_code_user_id(metadata: Any) -> str | None:
    """The session in Claude Code's ``metadata.user_id`` (JSON string, or the legacy form)."""
    raw = _str(metadata.get("user_id")) if isinstance(metadata, dict) else None
    if raw is None:
        return None
    if raw.startswith("{"):
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        return _str(parsed.get("session_id")) if isinstance(parsed, dict) else None
    match = _LEGACY_USER_ID.search(raw)
    return match.group(1) if match else None


def _claude_code(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    session = _str(headers.get(HEADER_CLAUDE_CODE_SESSION_ID.lower())) or _claude_code_user_id(
        body.get("metadata")
    )
    agent = _str(headers.get(HEADER_CLAUDE_CODE_AGENT_ID.lower()))
    if session is not None and agent is not None:
        return f"{session}/agent/{agent}"
    return session


def _first_header(headers: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        value = _str(headers.get(name.lower()))
        if value is not None:
            return value
    return None


def conversation_of(headers: Mapping[str, str], body: Mapping[str, Any]) -> tuple[str | None, str]:
    """(conversation id, its source) of a request: ``headers`` with lower-case names, ``body``
    the request as the client sent it (any API). ``(None, "none")`` when nothing names one."""
    for source, value in (
        (
            "agentkv",
            _str(headers.get(HEADER_CONVERSATION_ID.lower()))
            or _str(body.get(BODY_CONVERSATION_ID)),
        ),
        (
            "session",
            _str(headers.get(HEADER_SESSION_ID.lower())) or _str(body.get(BODY_SESSION_ID)),
        ),
        ("claude-code", _claude_code(headers, body)),
        ("codex", _first_header(headers, HEADER_CODEX_SESSION_IDS)),
        ("prompt-cache-key", _str(body.get(BODY_PROMPT_CACHE_KEY))),
        ("opencode", _first_header(headers, HEADER_OPENCODE_SESSION_IDS)),
        ("dynamo", _str(headers.get(HEADER_DYNAMO_SESSION_ID.lower()))),
    ):
        if value is not None:
            return value, source
    return None, "none"
