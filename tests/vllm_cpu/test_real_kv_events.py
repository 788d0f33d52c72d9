"""P's prefix cache, told to the router by vLLM's KV events (L of M = max(0, min(C, N) - L)).

cpu-tiny starts P with prefix caching on and ``--kv-events-config`` (the profile's
``prefill.kv_events_base_port``): a non-wildcard endpoint on 127.0.0.1, so P connects and the
router binds it; vLLM's ``GET /kv_event_sources`` on P says where its events go.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests._support.vllm_scenarios import MODEL, Stack

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(600)]
LOCAL = "vllm:prompt_tokens_by_source_total[local_cache_hit]"


def test_p_sends_its_kv_events_to_the_router_on_loopback(real: Stack) -> None:
    sources = httpx.get(f"{real.prefill}/kv_event_sources", timeout=30).json()
    assert sources["0"]["enable_kv_cache_events"] is True, sources
    assert sources["0"]["publisher"] == "zmq"
    assert sources["0"]["endpoint"] == "tcp://127.0.0.1:5610", sources


def test_the_receipt_says_what_p_holds_itself(real: Stack) -> None:
    """Two conversations with the same opening: the second's P already holds it. The receipt's
    L is what P's own counter says it found in its cache, and it is not an estimate."""
    system = f"[local {uuid.uuid4().hex[:8]}] " + "P announces every block it caches. " * 20
    receipts = []
    with real.client() as c:
        for _ in range(2):
            conv = c.conversation(model=MODEL, system=system)
            conv.add_user("Same opening, twice.")
            before = real.metrics(real.prefill).get(LOCAL, 0.0)
            conv.create(max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
            local = int(real.metrics(real.prefill).get(LOCAL, 0.0) - before)
            receipts.append((conv.last_receipt, local))
    (first, _), (second, local) = receipts
    assert local >= 3 * 32, local  # the shared opening, in P's cache
    assert second.local_prefix_tokens is not None
    assert abs(second.local_prefix_tokens - local) <= 32, (second, local)
    assert not second.estimated
    assert first.local_prefix_tokens in (0, None)
