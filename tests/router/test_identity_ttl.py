"""Token identity outlives D's KV (``identity_ttl_s``): a raw chat client's turn after a pause
longer than the router TTL is recomputed, but still prompted with the answers' generated ids;
past ``identity_ttl_s`` its history is rendered. In-process (``inprocess_stack``, one manual
clock for the engines, the handle store and the identity ledger)."""

from __future__ import annotations

from typing import Any

import pytest

from agentkv.protocol import HEADER_DECISION
from agentkv.router.config import RouterConfig
from agentkv.router.identity import KEPT
from tests._support.agents import SYSTEM
from tests._support.inprocess_stack import InProcessStack, inprocess_stack

# paths.mode = "pull" (tests/_support/router_config.py): these tests check P's reads of
# D's KV (decision `pull`, X-AgentKV-Reused-Tokens, P's counters), which the default
# `choose` skips for a short turn by decoding it on D in place (test_paths_e2e.py)
pytestmark = [pytest.mark.anyio, pytest.mark.paths_pull]

IDENTITY = "x-agentkv-identity"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


async def _turn(pd: InProcessStack, messages: list[dict[str, Any]], text: str) -> dict[str, str]:
    """One Chat Completions request as a raw client sends it (messages, a session header); the
    answer as received goes back into ``messages``."""
    messages.append({"role": "user", "content": text})
    r = await pd.http.post(
        f"{pd.router.url}/v1/chat/completions",
        json={"model": "agentkv-sim", "messages": messages, "max_tokens": 30},
        headers={"X-Session-ID": "pause"},
    )
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    messages.append({k: v for k, v in message.items() if v is not None})
    return {k.lower(): v for k, v in r.headers.items()}


@pytest.mark.parametrize(
    ("identity_ttl_s", "keep_s"),
    [(3_600.0, 3_600.0), (100.0, 450.0)],  # never less than the router TTL (480 - 30)
)
def test_identity_is_kept_at_least_the_router_ttl(identity_ttl_s: float, keep_s: float) -> None:
    config = RouterConfig.model_validate(
        {
            "upstream": {"prefill": [{"url": "http://p"}], "decode": [{"url": "http://d"}]},
            "identity": {"ttl_s": identity_ttl_s},
        }
    )
    assert config.router_ttl_s == 450.0 and config.identity_keep_s == keep_s


async def test_a_turn_after_a_long_pause_keeps_the_answers_ids(anyio_backend: str) -> None:
    router = {"identity": {"ttl_s": 2_000.0}}
    async with inprocess_stack(p_args=({"prefix_caching": False},), router=router) as pd:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        first = await _turn(pd, messages, "hello")
        assert first[IDENTITY] == "rendered:first-turn"
        assert (await _turn(pd, messages, "go on"))[IDENTITY] == KEPT
        pd.advance(1_000.0)  # past the router TTL (450 s): D's KV is gone, the identity is not
        paused = await _turn(pd, messages, "back again")
        assert paused[HEADER_DECISION.lower()] in ("expired", "miss")
        assert paused[IDENTITY] == KEPT
        # the next turn reads what the recomputed one left on D
        after = await _turn(pd, messages, "and then?")
        assert after[HEADER_DECISION.lower()] == "pull" and after[IDENTITY] == KEPT
        pd.advance(2_500.0)  # past identity_ttl_s too: the history is rendered
        assert (await _turn(pd, messages, "still there?"))[IDENTITY] == "rendered:no-record"
        assert pd.wrong_kv() == 0
