"""Receipts never claim what P did not do when its KV-event index is stale (issue 21, item 6).

Real processes on loopback: a simulator P that publishes vLLM 0.33's KV events over ZMQ, a
simulator D, ``agentkv router`` processes. Every turn's receipt is checked against what P
really did, from P's own counters: a receipt that states L (not ``X-AgentKV-Estimated``) must
have L = P's local prefix-cache hit and M (``X-AgentKV-Reused-Tokens``) = the tokens P read from
D. Each scenario runs without and with vLLM's replay socket (``replay_endpoint``): without it
the index cannot know what P held before it started listening and says so; with it the index
is rebuilt from P's buffer and states exact figures again.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from agentkv.protocol.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from agentkv.protocol.promtext import parse_metrics
from agentkv.sim.launch import SimProcess, free_port, start_sims
from tests._support.stack import MODEL, Stack, exact, start_router

# paths.mode = "pull" (tests/_support/router_config.py): these tests check P's reads of
# D's KV (decision `pull`, X-AgentKV-Reused-Tokens, P's counters), which the default
# `choose` skips for a short turn by decoding it on D in place (test_paths_e2e.py)
pytestmark = [pytest.mark.e2e, pytest.mark.paths_pull]

BS = 16
LOCAL = "vllm:prompt_tokens_by_source_total[local_cache_hit]"
EXTERNAL = "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
OUTPUT = 100
"""D's answer per turn: the next turn's handle holds about this many tokens P does not (more
than the router's 64-token threshold, so a turn with a handle pulls)."""


@dataclass(frozen=True)
class Turn:
    """One turn's receipt beside what P did."""

    decision: str
    reused: int
    local: int | None
    p_local: int
    """P's own local_cache_hit for the turn."""
    p_read: int
    """P's own external_kv_transfer for the turn."""

    @property
    def estimated(self) -> bool:
        return self.local is None

    @property
    def honest(self) -> bool:
        """An estimate, or exactly what P did."""
        return self.estimated or (self.local == self.p_local and self.reused == self.p_read)


class Deployment:
    """P (KV events on fixed ports, so it can restart in place), D and one router at a time."""

    def __init__(self, tmp: Path, events: dict[str, Any], router: dict[str, Any]) -> None:
        self.tmp, self.events = tmp, events
        self.p_port = free_port()
        common = ["--time-scale", "0", "--block-size", str(BS)]
        self.p_argv = ["--role", "prefill", *common, "--kv-events-config", json.dumps(events)]
        p, d = start_sims(
            [self.p_argv, ["--role", "decode", *common]], ports=[self.p_port, free_port()]
        )
        self.stack = Stack([p], [d])
        self.config = {
            "upstream": {
                "prefill": [{"url": p.url, "kv_events": events}],
                "decode": [{"url": d.url}],
                "block_size": BS,
            },
            **router,
        }
        self.start_router()

    @property
    def p(self) -> SimProcess:
        return self.stack.prefill[0]

    def start_router(self) -> None:
        for r in self.stack.routers:
            r.stop()
        self.stack.routers = [start_router(self.config, self.tmp, log_level="info")]

    def restart_p(self) -> None:
        """P stops and starts again on its ports; back when the router has seen it go and come
        back: with a replay socket the index is rebuilt (the new P's empty buffer), without one
        it has gone out of sync. (A turn routed in between, while the index is being rebuilt,
        is an estimate: honest, but not the exact receipt the replay case checks.)"""
        replay = "replay_endpoint" in self.events
        mark = "index in sync" if replay else "index out of sync"
        seen = self.log_count(mark)
        self.p.stop()
        (p,) = start_sims([self.p_argv], ports=[self.p_port])
        self.stack.prefill = [p]
        wait_until(lambda: self.router_health()["prefill"][p.url] is True)
        wait_until(lambda: self.log_count(mark) > seen)

    def log_count(self, text: str) -> int:
        """How often the router's log says ``text`` (its subscriber logs each change of sync)."""
        return self.stack.router.log_text().count(text)

    def router_health(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.stack.router.url}/health", timeout=10).json())

    def in_sync(self) -> bool:
        text = httpx.get(f"{self.stack.router.url}/metrics", timeout=10).text
        return (
            parse_metrics(text, by="url").get(f"agentkv_router_kv_index_in_sync[{self.p.url}]") == 1
        )

    def turn(self, conv: str, ids: list[int]) -> tuple[Turn, list[int]]:
        """One turn of ``conv`` with prompt ``ids``; also the tokens D then holds."""
        before = self.stack.metrics(self.p)
        r = exact(self.stack, conv, ids, max_tokens=OUTPUT, ignore_eos=True)
        assert r.status_code == 200, r.text
        after = self.stack.metrics(self.p)
        h = r.headers
        local = h.get("x-agentkv-local-prefix-tokens")
        assert (local is None) == (h.get("x-agentkv-estimated") == "1"), dict(h)
        t = Turn(
            decision=h["x-agentkv-decision"],
            reused=int(h["x-agentkv-reused-tokens"]),
            local=None if local is None else int(local),
            p_local=int(after.get(LOCAL, 0) - before.get(LOCAL, 0)),
            p_read=int(after.get(EXTERNAL, 0) - before.get(EXTERNAL, 0)),
        )
        return t, [*ids, *r.json()["choices"][0]["token_ids"]]

    def stop(self) -> None:
        self.stack.stop()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def synced(d: Deployment, timeout_s: float = 15.0) -> None:
    """Until the router's index is in sync with P, whose prefix cache is reset (emptied, an
    ``AllBlocksCleared`` published) while it is not. A router that binds and has no replay
    socket can miss P's first batch, the one that would bring it in sync: ZMQ drops what P
    publishes before the router's subscription has reached it."""
    deadline = time.monotonic() + timeout_s
    while not d.in_sync():
        assert time.monotonic() < deadline, "timed out"
        assert httpx.post(f"{d.p.url}/reset_prefix_cache", timeout=10).status_code == 200
        time.sleep(0.5)


@contextlib.contextmanager
def deployment(
    tmp: Path, *, replay: bool, p_binds: bool = True, router: dict[str, Any] | None = None
) -> Iterator[Deployment]:
    """P's events on ``tcp://*:PORT`` (P binds, the router connects: vLLM's default) or on
    ``tcp://127.0.0.1:PORT`` (P connects, the router binds), with or without a replay socket."""
    port = free_port()
    events: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{port}" if p_binds else f"tcp://127.0.0.1:{port}",
        "topic": "kv",
    }
    if replay:
        events["replay_endpoint"] = f"tcp://*:{free_port()}"
    d = Deployment(tmp, events, router or {})
    try:
        yield d
    finally:
        d.stop()


def tokens(d: Deployment, text: str) -> list[int]:
    r = httpx.post(f"{d.p.url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=10)
    return list(r.json()["tokens"])


def opening(d: Deployment) -> list[int]:
    return tokens(d, f"[{uuid.uuid4().hex}] " + "Keep every block of this prompt. " * 30)


def conversation(
    d: Deployment, conv: str, ids: list[int], turns: int, *, wait_sync: bool = False
) -> tuple[list[Turn], list[int]]:
    """``turns`` turns of ``conv`` from prompt ``ids``, each adding a user message to what D
    then holds; before each, optionally, wait until the router's index is in sync."""
    out = []
    for i in range(turns):
        if wait_sync:
            wait_until(d.in_sync)
        t, held = d.turn(conv, ids)
        out.append(t)
        ids = [*held, *tokens(d, f" Question {i}: and then?")]
        time.sleep(0.2)  # P's events of this turn reach the router
    return out, ids


# -- 1. the router restarts next to a P that holds the conversation --------------------------


@pytest.mark.parametrize("replay", [False, True], ids=["no-replay", "replay"])
def test_a_restarted_router_claims_nothing_it_cannot_know(tmp_path, redis_url, replay):
    """Handles in Redis survive the router's restart; P's prefix cache survives too. The new
    router's index starts empty: without a replay socket every later turn is an estimate (P
    holds the prefix, the index cannot know it); with one the index is rebuilt from P's buffer
    and the receipts state exactly what P did, pulls included."""
    with deployment(tmp_path, replay=replay, router={"store": {"backend": redis_url}}) as d:
        conv = f"restart-{uuid.uuid4().hex[:8]}"
        before, ids = conversation(d, conv, opening(d), 3)
        assert all(t.honest for t in before), before
        assert any(t.decision == "pull" and not t.estimated for t in before[1:]), before
        d.start_router()
        after, _ = conversation(d, conv, ids, 3)
        assert all(t.honest for t in after), after
        assert all(t.p_local > 0 for t in after), after  # P held the prefix all along
        if replay:
            assert d.in_sync()
            assert not any(t.estimated for t in after), after
            assert any(t.decision == "pull" and t.reused > 0 for t in after), after
        else:
            assert not d.in_sync()
            assert all(t.estimated for t in after), after


# -- 2. P restarts in place: its cache is gone --------------------------------------------------


@pytest.mark.parametrize("replay", [False, True], ids=["no-replay", "replay"])
def test_a_restarted_p_is_not_claimed_to_hold_its_old_cache(tmp_path, replay):
    """P restarts on the same ports while D still holds the conversation's handle. The first
    turn after is not a false ``local``: P holds nothing and pulls. Without a replay socket the
    receipt is an estimate (the index lost P, then cannot know what it holds); with one the
    new P's empty buffer proves an empty cache, and the receipt states the pull."""
    with deployment(tmp_path, replay=replay) as d:
        conv = f"p-restart-{uuid.uuid4().hex[:8]}"
        before, ids = conversation(d, conv, opening(d), 3)
        assert all(t.honest for t in before), before
        assert before[-1].local and not before[-1].estimated, before  # the index knew P's cache
        d.restart_p()
        after, _ = conversation(d, conv, ids, 2)
        first = after[0]
        assert first.p_local == 0 and first.p_read > 0, first  # the new P pulled
        assert all(t.honest for t in after), after
        if replay:
            assert (first.decision, first.local, first.estimated) == ("pull", 0, False), first
        else:
            assert first.estimated, first


# -- 3. a foreign process publishes to a router that binds ------------------------------------


def _forged(ids: list[int]) -> bytes:
    """A batch saying P holds every whole block of ``ids`` (unsalted, from the root)."""
    n = len(ids) // BS
    stored = BlockStored(
        block_hashes=[10_000 + i for i in range(n)],
        parent_block_hash=None,
        token_ids=ids[: n * BS],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None] * n,
        group_idx=0,
    )
    batch = KVEventBatch(ts=time.time(), events=[AllBlocksCleared(), stored], data_parallel_rank=0)
    return msgspec.msgpack.encode(batch)


@pytest.mark.parametrize("replay", [False, True], ids=["no-replay", "replay"])
def test_a_foreign_publisher_cannot_change_receipts(tmp_path, replay):
    """P connects to the router's bound port (``tcp://127.0.0.1:PORT``, the local profile's
    shape), and so does a foreign process, which publishes batches saying P holds the whole of
    the next prompt (sequence 0 and on, and an ``AllBlocksCleared`` first). No receipt claims
    them: without a replay socket the index goes out of sync and stays out until P's cache is
    reset; with one it keeps following P's own replay buffer."""
    with deployment(tmp_path, replay=replay, p_binds=False) as d:
        conv = f"foreign-{uuid.uuid4().hex[:8]}"
        synced(d)
        before, ids = conversation(d, conv, opening(d), 2)
        assert all(t.honest for t in before), before
        wait_until(d.in_sync)
        ctx: zmq.Context[Any] = zmq.Context()
        foreign = ctx.socket(zmq.PUB)
        foreign.setsockopt(zmq.LINGER, 0)
        try:
            foreign.connect(d.events["endpoint"])
            time.sleep(0.5)  # connected, and subscribed to by the router
            for seq in (0, 1, 2, 3, 1000):
                foreign.send_multipart([b"kv", seq.to_bytes(8, "big"), _forged(ids)])
            time.sleep(0.3)
            during, ids = conversation(d, conv, ids, 2)
        finally:
            foreign.close(0)
            ctx.term()
        after, ids = conversation(d, conv, ids, 1)
        turns = [*during, *after]
        assert all(t.honest for t in turns), turns
        assert all(t.local is None or t.local == t.p_local for t in turns), turns
        if replay:
            assert not any(t.estimated for t in turns), turns
        else:
            assert all(t.estimated for t in turns), turns
            # P's own AllBlocksCleared brings the index back in sync.
            assert httpx.post(f"{d.p.url}/reset_prefix_cache", timeout=10).status_code == 200
            wait_until(d.in_sync)
            (t,), _ = conversation(d, conv, ids, 1)
            assert t.honest and not t.estimated and t.local == 0 and t.p_read > 0, t
