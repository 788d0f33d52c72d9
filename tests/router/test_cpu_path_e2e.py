"""D's CPU copy as a path (docs/paths.md), between real processes on loopback: a simulator P, a
simulator D with a CPU tier that publishes it as KV events (vLLM 0.33's ``medium: "CPU"``), and
``agentkv router`` with ``paths = "choose"`` subscribed to D's events.

Conversation A's first turn leaves a handle on D. D's TTL passes (D frees the blocks, the router
drops the handle) and conversation B takes every GPU block D has, so nothing of A is left in D's
prefix cache. A's next turn: with the CPU tier still holding A's history it goes straight to D
(``cpu``), which loads it from the tier and prefills the rest, P never sees it, and D keeps a
handle for the turn after. Once more conversations have pushed A's copy out of the tier, A's
next turn goes through P, which computes it all. The simulator checks every block's KV content:
no turn runs on wrong KV."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentkv.protocol.promtext import parse_metrics
from agentkv.sim.launch import free_port, start_sims
from tests._support.stack import Stack, exact, held_after, start_router

pytestmark = pytest.mark.e2e

BS = 16
D_BLOCKS = 32
"""D's GPU: 31 usable blocks, all of which conversation B's turn takes."""
TTL_S = 2.5
"""D's TTL; the router stops using a handle 0.5 s before it (2 s: room for a loaded machine
between a turn and the next, which must find the handle)."""
MARGIN_S = 0.5
A = list(range(1000, 1300))  # 300 tokens; with 20 generated, D holds 19 full blocks (304)
B = list(range(5000, 5470))  # 470 tokens; with 20 generated, 31 blocks: D's whole GPU
CPU_LOADED = "agentkv_sim_cpu_loaded_tokens_total"
PROMPT = "vllm:prompt_tokens_total"
COMPUTED = "vllm:prompt_tokens_by_source_total[local_compute]"


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Stack]:
    """P (no prefix cache: what it gets, it computes), D with a CPU tier of 64 blocks and KV
    events (it binds; the router connects and bootstraps from the replay
    socket), and a router that takes decode-side paths."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{free_port()}",
        "replay_endpoint": f"tcp://*:{free_port()}",
        "topic": "kv",
    }
    common = ["--time-scale", "0", "--block-size", str(BS), "--decoder-kv-blocks-ttl", str(TTL_S)]
    p, d = start_sims(
        [
            ["--role", "prefill", *common, "--no-prefix-caching"],
            ["--role", "decode", *common, "--num-blocks", str(D_BLOCKS),
             "--cpu-offload-blocks", "64", "--kv-events-config", json.dumps(events)],
        ]
    )  # fmt: skip
    s = Stack([p], [d])
    try:
        config = {
            "upstream": {
                "prefill": [{"url": p.url}],
                "decode": [{"url": d.url, "kv_events": events}],
                "block_size": BS,
            },
            "retention": {"decoder_kv_blocks_ttl_s": TTL_S, "ttl_margin_s": MARGIN_S},
            "paths": {"mode": "choose"},
        }
        s.routers.append(start_router(config, tmp_path, log_level="info"))
        until(lambda: in_sync(s), "the router's index of D's CPU tier is in sync")
        yield s
    finally:
        s.stop()


def in_sync(s: Stack) -> bool:
    text = httpx.get(f"{s.router.url}/metrics", timeout=10).text
    key = f"agentkv_router_kv_index_in_sync[{s.decode[0].url}]"
    return parse_metrics(text, by="url").get(key) == 1


def until(predicate: object, what: str, timeout_s: float = 10.0) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.05)


def turn(s: Stack, conv: str, ids: list[int], out: int = 20) -> httpx.Response:
    r = exact(s, conv, ids, ignore_eos=True, max_tokens=out)
    assert r.status_code == 200, r.text
    return r


def first_turns(s: Stack) -> list[int]:
    """A's first turn; D's TTL passes; B's first turn takes every GPU block D has. Returns
    A's next prompt (what D held of A, then 30 new tokens)."""
    d = s.decode[0]
    r = turn(s, "a", A)
    assert r.headers["x-agentkv-decision"] == "miss"
    held = held_after(r, A)
    until(lambda: s.retained(d) == 0, "D frees A's blocks at its TTL")
    assert turn(s, "b", B).headers["x-agentkv-decision"] == "miss"
    return [*held, *range(9000, 9030)]


def test_a_turn_whose_handle_is_gone_loads_ds_cpu_copy_while_the_tier_holds_it(
    deployment: Stack,
) -> None:
    s = deployment
    p, d = s.prefill[0], s.decode[0]
    ids = first_turns(s)
    held = (len(A) + 20 - 1) // BS * BS  # the full blocks of what D computed: 304
    before_p, before_d = s.metrics(p), s.metrics(d)
    r = turn(s, "a", ids, 5)
    h = r.headers
    after_p, after_d = s.metrics(p), s.metrics(d)
    assert h["x-agentkv-decision"] == "cpu", dict(h)
    assert h["x-agentkv-reused-tokens"] == "0"  # nothing read over NIXL
    assert h["x-agentkv-runner-up"] == "recompute"
    # what D reported finding: nothing in its GPU prefix cache, A's history in its CPU tier
    assert h["x-agentkv-decode-cached-tokens"] == str(held)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == held
    assert after_d[CPU_LOADED] - before_d.get(CPU_LOADED, 0) == held
    assert after_d[COMPUTED] - before_d[COMPUTED] == len(ids) - held
    # P never saw the prompt (it may have had a 1-token notify freeing B's handle: D's KV is
    # full, so the router releases its oldest handle early)
    assert after_p[PROMPT] - before_p[PROMPT] <= 1
    # D kept the blocks for a handle: the next turn decodes in place from D's GPU
    ids = [*held_after(r, ids), *range(9100, 9110)]
    r = turn(s, "a", ids, 5)
    assert r.headers["x-agentkv-decision"] == "decode", dict(r.headers)

    # three more conversations of 30 blocks each fill the 64-block tier: A's copy is evicted
    for k in range(3):
        assert turn(s, f"c{k}", [k, *B[1:]]).headers["x-agentkv-decision"] == "miss"
    ids = [*held_after(r, ids), *range(9200, 9210)]
    until(lambda: s.retained(d) <= 1, "D frees A's blocks at its TTL")
    before_p, before_d = s.metrics(p), s.metrics(d)
    r = turn(s, "a", ids)
    after_p, after_d = s.metrics(p), s.metrics(d)
    # A's handle is gone (expired, or released early under D's KV pressure): through P, which
    # computes the whole prompt (and perhaps a 1-token notify)
    assert r.headers["x-agentkv-decision"] in ("expired", "miss"), dict(r.headers)
    assert "x-agentkv-decode-cached-tokens" not in r.headers
    assert 0 <= after_p[COMPUTED] - before_p[COMPUTED] - len(ids) <= 1
    assert after_d[CPU_LOADED] == before_d[CPU_LOADED]
    assert s.wrong_kv() == 0
