"""The turn core (:mod:`agentkv.router.turn`), driven with scripted outcomes: every fault path is
a row, and each row states the exact actions the core takes and how the turn ends."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from agentkv.protocol import KVTransferParams
from agentkv.router import turn as core
from agentkv.router.config import RouterConfig
from agentkv.router.identity import Pending, Resolved
from agentkv.router.paths import Curves, TurnState, choose
from agentkv.router.receipt import Receipt
from agentkv.router.sse import Captured
from agentkv.router.store import StoredHandle, Taken
from agentkv.router.verify import PromptHashes, hash_root, held_record

BS = 4
ROOT = hash_root("m", None)
PROMPT = list(range(1000, 1040))  # 40 tokens: 10 blocks
KEY = ("t", "c")
P1, P2, D1, D2 = "http://p1", "http://p2", "http://d1", "http://d2"
CFG = RouterConfig.model_validate(
    {
        "upstream": {
            "prefill": [{"url": P1}, {"url": P2}],
            "decode": [{"url": D1}, {"url": D2}],
            "block_size": BS,
            "kv_recompute_threshold": 8,
            "retries": 2,
        },
        "paths": {"mode": "pull"},  # through P (the decode-in-place rows: PATH_ROWS)
    }
)
OLD = CFG.router_ttl_s + 1
"""An age past the router's TTL."""


def handle(
    name: str, held: Sequence[int], *, epoch: int = 0, d: str = D1, engine: str = "d1"
) -> StoredHandle:
    """D's handle ``name`` holding ``held`` (issued by engine ``engine`` behind ``d``)."""
    record = held_record([], len(held), PromptHashes(list(held), BS, ROOT))
    params = {
        "do_remote_decode": True,
        "remote_block_ids": [list(range(len(held) // BS + 1))],
        "remote_engine_id": engine,
        "remote_request_id": name,
        "remote_host": "10.0.0.9",
        "remote_port": 5600,
        "remote_num_tokens": len(held),
    }
    return StoredHandle(
        params, record.digests, record.tail, len(held), BS, epoch, d, ROOT, record.prefix
    )


H1 = handle("h1", PROMPT[:32])
"""Holds 32 tokens of the prompt: a full pull."""
H2 = handle("h2", PROMPT[:24], d=D2, engine="d2")
NAMES = {H1.id: "h1", H2.id: "h2"}
P_HANDLE = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "x"}
DONE = core.PrefillDone(P_HANDLE)


@dataclass
class World:
    """What the driver answers: the store, the engines, and P's and D's scripted outcomes."""

    handles: list[Taken] = field(default_factory=list)
    engines: dict[str, str | None] = field(default_factory=lambda: {D1: "d1", D2: "d2"})
    can_pull: bool = True
    lost_races: set[str] = field(default_factory=set)
    """Handles another router replica takes first."""
    prefill: list[tuple[str | None, int | None, Any]] = field(default_factory=list)
    """Per P attempt: (the P placed, or None: none qualifies; its L; P's outcome)."""
    decode: list[tuple[str | None, Any]] = field(default_factory=list)
    """Per D attempt: (the D placed, or None; D's outcome)."""
    displaced: list[StoredHandle] = field(default_factory=list)
    resolved: Resolved = field(default_factory=lambda: Resolved(None, None))
    tokenized: list[int] = field(default_factory=lambda: list(PROMPT))
    in_flight: dict[str, int] = field(default_factory=dict)
    """Each D's decode-in-place tokens in flight."""
    reserve: list[bool] = field(default_factory=list)
    """Per :class:`~agentkv.router.turn.Reserve`: whether D's budget takes it."""
    unhealthy: frozenset[str] = frozenset()
    running: dict[str, int] = field(default_factory=dict)
    """Each D's requests running (the router's count)."""
    p_queued: int = 0
    """Prompt tokens queued on the least loaded P."""
    cpu: dict[str, int] = field(default_factory=dict)
    """What each D's CPU tier holds of the prompt (its KV events), for :class:`CpuHeld`."""


def short(url: str) -> str:
    return url.removeprefix("http://")


def name(h: StoredHandle) -> str:
    return NAMES.get(h.id, f"new@{short(h.decode_url)}")


def show_receipt(r: Any) -> str:
    local = "?" if r.local is None else r.local
    cause = f" {r.cause}" if r.cause else ""
    # the cost model's choice: the runner-up (its estimate is checked in test_turn_paths.py)
    chosen = f" next={r.runner_up}" if r.estimate_s is not None else ""
    return f"{r.decision} M={r.reused} C={r.verified} L={local}{cause}{chosen}"


def show(a: core.Action) -> str:
    """One action, every field that matters, in a line."""
    if isinstance(a, core.Renew):
        return f"renew {a.seconds:g}"
    if isinstance(a, core.Discard):
        return f"discard {NAMES[a.handle_id]}" + (f" {a.reason}" if a.reason else "")
    if isinstance(a, core.Take):
        return f"take {NAMES[a.handle_id]}" + (f" releases={a.releases}" if a.releases else "")
    if isinstance(a, core.Restore):
        return f"restore {name(a.taken.handle)}"
    if isinstance(a, core.Store):
        return f"store {name(a.handle)}"
    if isinstance(a, core.Release):
        return f"release {name(a.handle)} {a.reason}"
    if isinstance(a, core.Retry):
        return f"retry {a.reason}"
    if isinstance(a, core.PickPrefill):
        return "pick-prefill" + (" bidirectional" if a.bidirectional else "")
    if isinstance(a, core.Prefill):
        assert list(a.prompt) == list(PROMPT)
        params = KVTransferParams.model_validate(a.params)
        if not a.attached:
            assert params == KVTransferParams.for_prefill() and not a.reads
            return f"prefill {short(a.url)}"
        if not a.reads:
            assert params.remote_num_tokens == 0
            return f"prefill {short(a.url)} release {a.params['remote_request_id']}"
        return f"prefill {short(a.url)} read {a.params['remote_request_id']} {params.num_tokens}"
    if isinstance(a, core.PickDecode):
        holder = short(a.holder) if a.holder else "-"
        return f"pick-decode {','.join(short(u) for u in a.candidates)} holder={holder}"
    if isinstance(a, core.Reserve):
        return f"reserve {short(a.url)} {a.tokens}"
    if isinstance(a, core.CpuHeld):
        assert list(a.prompt) == list(PROMPT)
        return "cpu-held"
    if isinstance(a, core.Decode):
        assert list(a.remember.prompt.prompt) == list(PROMPT)
        if a.prefill_url is None:
            assert a.params == core.KEEP_ON_DECODE and a.reserved > 0
            return f"decode {short(a.url)} in place [{show_receipt(a.receipt)}]"
        assert a.params == P_HANDLE and a.reserved == 0
        return f"decode {short(a.url)} via {short(a.prefill_url)} [{show_receipt(a.receipt)}]"
    if isinstance(a, core.Record):
        return f"record {len(a.prompt)}+{len(a.output)}"
    if isinstance(a, core.Identify):
        return f"identify {short(a.url)} as {a.engine_id}"
    return type(a).__name__.lower()  # resolve, tokenize, candidates


def show_end(end: core.End) -> str:
    if isinstance(end, core.Answered):
        assert list(end.prompt) == list(PROMPT)
        p = "in place" if end.prefill_url is None else short(end.prefill_url)
        via = f"{p}->{short(end.decode_url)}"
        return f"answered {via} [{show_receipt(end.receipt)}]"
    what = end.body.decode() if end.body is not None else end.message
    return f"fail {end.status} {what}"


def drive(plan: Generator[core.Action, Any, Any], world: World) -> tuple[list[str], Any]:
    """Run a plan against ``world``; the actions it took (one line each) and its result."""
    by_id = {t.handle.id: t for t in world.handles}
    prefill, decode, reserve = list(world.prefill), list(world.decode), list(world.reserve)
    pending_p: list[Any] = []
    pending_d: list[Any] = []
    seen: list[str] = []
    answer: Any = None
    while True:
        try:
            action = plan.send(answer)
        except StopIteration as stop:
            return seen, stop.value
        seen.append(show(action))
        answer = None
        if isinstance(action, core.Resolve):
            answer = world.resolved
        elif isinstance(action, core.Tokenize):
            answer = world.tokenized
        elif isinstance(action, core.Candidates):
            answer = core.Found(
                world.handles,
                world.engines,
                world.can_pull,
                world.in_flight,
                world.unhealthy,
                world.running,
                world.p_queued,
            )
        elif isinstance(action, core.Take):
            answer = (
                None if NAMES[action.handle_id] in world.lost_races else by_id[action.handle_id]
            )
        elif isinstance(action, (core.Restore, core.Store)):
            answer = world.displaced
        elif isinstance(action, core.PickPrefill):
            url, local, outcome = prefill.pop(0)
            pending_p.append(outcome)
            answer = None if url is None else core.PrefillChoice(url, local)
        elif isinstance(action, core.Prefill):
            answer = pending_p.pop()
        elif isinstance(action, core.PickDecode):
            url, outcome = decode.pop(0)
            assert url is None or url in action.candidates
            pending_d.append(outcome)
            answer = url
        elif isinstance(action, core.Reserve):
            answer = reserve.pop(0)
        elif isinstance(action, core.CpuHeld):
            answer = world.cpu
        elif isinstance(action, core.Decode):
            if action.prefill_url is None:
                url, answer = decode.pop(0)
                assert url == action.url
            else:
                answer = pending_d.pop()


def run(world: World, cfg: RouterConfig = CFG, **turn: Any) -> tuple[list[str], str]:
    inp = core.TurnInput(
        **{
            "key": KEY,
            "epoch": 0,
            "model": "m",
            "cache_salt": None,
            "decode_urls": (D1, D2),
            "prompt_ids": list(PROMPT),
            **turn,
        }
    )
    seen, end = drive(core.turn_plan(inp, cfg), world)
    assert prefill_left(world, seen) and decode_left(world, seen)
    assert sum(s.startswith("reserve") for s in seen) == len(world.reserve)
    return seen, show_end(end)


def prefill_left(world: World, seen: list[str]) -> bool:
    """Every scripted P answer was asked for (a row scripts exactly what the core does)."""
    return sum(s.startswith("pick-prefill") for s in seen) == len(world.prefill)


def decode_left(world: World, seen: list[str]) -> bool:
    """... and every D answer: placed by pick-decode, or decoding in place on the holder."""
    placed = sum(s.startswith("pick-decode") or " in place [" in s for s in seen)
    return placed == len(world.decode)


def fresh(h: StoredHandle, age: float = 5.0) -> Taken:
    return Taken(h, age)


UNREACHABLE, TIMED_OUT = core.PrefillUnreachable(), core.PrefillTimedOut()
STARTED, D_FAILED = core.DecodeStarted(), core.DecodeFailed()

ROWS: list[tuple[str, World, dict[str, Any], list[str], str]] = [
    (
        "first turn: no handle",
        World(prefill=[(P1, None, DONE)], decode=[(D1, STARTED)]),
        {},
        [
            "resolve",
            "candidates",
            "pick-prefill",
            "prefill p1",
            "pick-decode d1,d2 holder=-",
            "decode d1 via p1 [miss M=0 C=0 L=?]",
        ],
        "answered p1->d1 [miss M=0 C=0 L=?]",
    ),
    (
        "pull: the handle verifies whole",
        World([fresh(H1)], prefill=[(P1, 0, DONE)], decode=[(D1, STARTED)]),
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            "pick-prefill bidirectional",
            "prefill p1 read h1 32",
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p1 [pull M=32 C=32 L=0]",
        ],
        "answered p1->d1 [pull M=32 C=32 L=0]",
    ),
    (
        "no P answers: the handle is put back, not spent",
        World([fresh(H1)], prefill=[(P1, None, UNREACHABLE), (P2, None, UNREACHABLE)] * 2),
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            *["pick-prefill bidirectional", "prefill p1 read h1 32", "retry prefill_error"],
            *["pick-prefill bidirectional", "prefill p2 read h1 32", "retry prefill_error"],
            *["pick-prefill bidirectional", "prefill p1 read h1 32", "retry prefill_error"],
            *["pick-prefill bidirectional", "prefill p2 read h1 32", "retry prefill_error"],
            "restore h1",
        ],
        "fail 503 No prefill instance answered.",
    ),
    (
        "P refuses the request (4xx): the handle is put back, P's error passes",
        World([fresh(H1)], prefill=[(P1, None, core.PrefillRefused(400, b'{"error":1}'))]),
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            "pick-prefill bidirectional",
            "prefill p1 read h1 32",
            "restore h1",
        ],
        'fail 400 {"error":1}',
    ),
    (
        "P's read passes its deadline: the handle is released, P again without it",
        World([fresh(H1)], prefill=[(P1, 0, TIMED_OUT), (P1, 0, DONE)], decode=[(D1, STARTED)]),
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            "pick-prefill bidirectional",
            "prefill p1 read h1 32",
            "retry deadline",
            "release h1 deadline",
            "pick-prefill",
            "prefill p1",
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p1 [recompute M=0 C=32 L=0]",
        ],
        "answered p1->d1 [recompute M=0 C=32 L=0]",
    ),
    (
        "P fails the read (500 with the handle): released, P once more without it",
        World(
            [fresh(H1)],
            prefill=[(P1, None, core.PrefillFailed(500)), (P2, None, DONE)],
            decode=[(D1, STARTED)],
        ),
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            "pick-prefill bidirectional",
            "prefill p1 read h1 32",
            "retry handle_failed",
            "release h1 prefill_failed",
            "pick-prefill",
            "prefill p2",
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p2 [recompute M=0 C=32 L=?]",
        ],
        "answered p2->d1 [recompute M=0 C=32 L=?]",
    ),
    (
        "P answers 429 or cannot be reached: the unread handle goes to the next P",
        World(
            [fresh(H1)],
            prefill=[(P1, None, core.PrefillFailed(429)), (P2, None, UNREACHABLE), (P1, 8, DONE)],
            decode=[(D2, STARTED)],
        ),
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            "pick-prefill bidirectional",
            "prefill p1 read h1 32",
            "retry prefill_error",
            "pick-prefill bidirectional",
            "prefill p2 read h1 32",
            "retry prefill_error",
            "pick-prefill bidirectional",
            "prefill p1 read h1 32",
            "pick-decode d1,d2 holder=d1",
            "decode d2 via p1 [pull M=24 C=32 L=8]",
        ],
        "answered p1->d2 [pull M=24 C=32 L=8]",
    ),
    (
        "no P can read the handle: it is put back, P recomputes",
        World([fresh(H1)], prefill=[(None, None, None), (P1, 0, DONE)], decode=[(D1, STARTED)]),
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            "pick-prefill bidirectional",
            "restore h1",
            "pick-prefill",
            "prefill p1",
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p1 [local M=0 C=32 L=0]",
        ],
        "answered p1->d1 [local M=0 C=32 L=0]",
    ),
    (
        "no healthy P at all",
        World(prefill=[(None, None, None)]),
        {},
        ["resolve", "candidates", "pick-prefill"],
        "fail 503 No healthy prefill instance.",
    ),
    (
        "P answers without a handle: P accepted, so the handle is spent",
        World([fresh(H1)], prefill=[(P1, None, core.PrefillDone(None))]),
        {},
        ["resolve", "candidates", "take h1", "pick-prefill bidirectional", "prefill p1 read h1 32"],
        "fail 502 A prefill instance returned no kv_transfer_params.",
    ),
    (
        "D fails before its first byte: a fresh P pass without the handle, another D, L unknown",
        World(
            [fresh(H1)],
            prefill=[(P1, 16, DONE), (P1, 40, DONE)],
            decode=[(D1, D_FAILED), (D2, STARTED)],
        ),
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            "pick-prefill bidirectional",
            "prefill p1 read h1 32",
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p1 [pull M=16 C=32 L=16]",
            "retry decode_error",
            "pick-prefill",
            "prefill p1",
            "pick-decode d2 holder=d1",
            "decode d2 via p1 [recompute M=0 C=32 L=?]",
        ],
        "answered p1->d2 [recompute M=0 C=32 L=?]",
    ),
    (
        "every D fails before its first byte: 502, the handle was spent by P",
        World(
            [fresh(H1)],
            prefill=[(P1, None, DONE)] * 3,
            decode=[(D1, D_FAILED), (D2, D_FAILED), (D1, D_FAILED)],
        ),
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            "pick-prefill bidirectional",
            "prefill p1 read h1 32",
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p1 [pull M=32 C=32 L=?]",
            "retry decode_error",
            "pick-prefill",
            "prefill p1",
            "pick-decode d2 holder=d1",
            "decode d2 via p1 [recompute M=0 C=32 L=?]",
            "retry decode_error",
            "pick-prefill",
            "prefill p1",
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p1 [recompute M=0 C=32 L=?]",
            "retry decode_error",
        ],
        "fail 502 No decode instance answered.",
    ),
    (
        "no healthy D: 503 (P accepted: nothing to put back)",
        World([fresh(H1)], prefill=[(P1, None, DONE)], decode=[(None, None)]),
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            "pick-prefill bidirectional",
            "prefill p1 read h1 32",
            "pick-decode d1,d2 holder=d1",
        ],
        "fail 503 No healthy decode instance.",
    ),
    (
        "D refuses (4xx): its error passes, no retry",
        World(
            [fresh(H1)],
            prefill=[(P1, None, DONE)],
            decode=[(D2, core.DecodeRefused(422, b"bad"))],
        ),
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            "pick-prefill bidirectional",
            "prefill p1 read h1 32",
            "pick-decode d1,d2 holder=d1",
            "decode d2 via p1 [pull M=32 C=32 L=?]",
        ],
        "fail 422 bad",
    ),
    (
        "an expired handle is discarded unread, never taken",
        World([fresh(H1, OLD)], prefill=[(P1, None, DONE)], decode=[(D1, STARTED)]),
        {},
        [
            "resolve",
            "candidates",
            "discard h1",
            "pick-prefill",
            "prefill p1",
            "pick-decode d1,d2 holder=-",
            "decode d1 via p1 [expired M=0 C=0 L=?]",
        ],
        "answered p1->d1 [expired M=0 C=0 L=?]",
    ),
    (
        "a handle of a restarted D is dropped; the next candidate is read",
        World(
            [fresh(H1), fresh(H2)],
            engines={D1: "d1-restarted", D2: "d2"},
            prefill=[(P1, None, DONE)],
            decode=[(D2, STARTED)],
        ),
        {},
        [
            "resolve",
            "candidates",
            "discard h1 restarted",
            "take h2",
            "pick-prefill bidirectional",
            "prefill p1 read h2 24",
            "pick-decode d1,d2 holder=d2",
            "decode d2 via p1 [pull M=24 C=24 L=?]",
        ],
        "answered p1->d2 [pull M=24 C=24 L=?]",
    ),
    (
        "a handle of a D gone from the configuration is dropped too",
        World(
            [fresh(H1)],
            engines={D2: "d2"},
            prefill=[(P1, None, DONE)],
            decode=[(D2, STARTED)],
        ),
        {"decode_urls": (D2,)},
        [
            "resolve",
            "candidates",
            "discard h1 restarted",
            "pick-prefill",
            "prefill p1",
            "pick-decode d2 holder=-",
            "decode d2 via p1 [miss M=0 C=0 L=?]",
        ],
        "answered p1->d2 [miss M=0 C=0 L=?]",
    ),
    (
        "a handle of a D not identified now waits in the store",
        World(
            [fresh(H1)],
            engines={D1: None, D2: "d2"},
            prefill=[(P1, None, DONE)],
            decode=[(D2, STARTED)],
        ),
        {},
        [
            "resolve",
            "candidates",
            "pick-prefill",
            "prefill p1",
            "pick-decode d1,d2 holder=-",
            "decode d2 via p1 [miss M=0 C=0 L=?]",
        ],
        "answered p1->d2 [miss M=0 C=0 L=?]",
    ),
    (
        "another replica took the best handle first: the next candidate",
        World(
            [fresh(H1), fresh(H2)],
            lost_races={"h1"},
            prefill=[(P1, None, DONE)],
            decode=[(D2, STARTED)],
        ),
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            "take h2",
            "pick-prefill bidirectional",
            "prefill p1 read h2 24",
            "pick-decode d1,d2 holder=d2",
            "decode d2 via p1 [pull M=24 C=24 L=?]",
        ],
        "answered p1->d2 [pull M=24 C=24 L=?]",
    ),
    (
        "every candidate lost to other replicas: a miss",
        World(
            [fresh(H1), fresh(H2)],
            lost_races={"h1", "h2"},
            prefill=[(P1, None, DONE)],
            decode=[(D1, STARTED)],
        ),
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            "take h2",
            "pick-prefill",
            "prefill p1",
            "pick-decode d1,d2 holder=-",
            "decode d1 via p1 [miss M=0 C=0 L=?]",
        ],
        "answered p1->d1 [miss M=0 C=0 L=?]",
    ),
    (
        "a lease is renewed before the handle is taken",
        World([fresh(H1)], prefill=[(P1, None, DONE)], decode=[(D1, STARTED)]),
        {"lease_s": 30.0},
        [
            "resolve",
            "renew 30",
            "candidates",
            "take h1",
            "pick-prefill bidirectional",
            "prefill p1 read h1 32",
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p1 [pull M=32 C=32 L=?]",
        ],
        "answered p1->d1 [pull M=32 C=32 L=?]",
    ),
    (
        "without a conversation: no store, no lease",
        World(prefill=[(P1, None, DONE)], decode=[(D1, STARTED)]),
        {"key": None, "lease_s": 30.0},
        [
            "resolve",
            "pick-prefill",
            "prefill p1",
            "pick-decode d1,d2 holder=-",
            "decode d1 via p1 [miss M=0 C=0 L=?]",
        ],
        "answered p1->d1 [miss M=0 C=0 L=?]",
    ),
    (
        "the client rewrote history past the handle: P only notifies D (release-only plan)",
        World(
            [fresh(handle("h1", [*PROMPT[:4], *range(9, 37)], epoch=0))],
            prefill=[(P1, None, DONE)],
            decode=[(D1, STARTED)],
        ),
        {"epoch": 1},
        [
            "resolve",
            "candidates",
            "take h1 releases=stale",
            "pick-prefill bidirectional",
            "prefill p1 release h1",
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p1 [stale M=0 C=4 L=? rewrite]",
        ],
        "answered p1->d1 [stale M=0 C=4 L=? rewrite]",
    ),
    (
        "a release-only request failing (500) loses the handle, unreleased; P recomputes",
        World(
            [fresh(handle("h1", [*PROMPT[:4], *range(9, 37)], epoch=0))],
            prefill=[(P1, None, core.PrefillFailed(500)), (P1, None, DONE)],
            decode=[(D1, STARTED)],
        ),
        {"epoch": 1},
        [
            "resolve",
            "candidates",
            "take h1 releases=stale",
            "pick-prefill bidirectional",
            "prefill p1 release h1",
            "retry handle_failed",
            "pick-prefill",
            "prefill p1",
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p1 [recompute M=0 C=4 L=? rewrite]",
        ],
        "answered p1->d1 [recompute M=0 C=4 L=? rewrite]",
    ),
    (
        "after a rewrite P holds the verified part itself: D is only notified",
        World(
            [fresh(handle("h1", [*PROMPT[:20], *range(9, 21)], epoch=0))],
            prefill=[(P1, 20, DONE)],
            decode=[(D1, STARTED)],
        ),
        {"epoch": 1},
        [
            "resolve",
            "candidates",
            "take h1",
            "pick-prefill bidirectional",
            "prefill p1 release h1",
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p1 [local M=0 C=20 L=20 rewrite]",
        ],
        "answered p1->d1 [local M=0 C=20 L=20 rewrite]",
    ),
    (
        "another branch's handle that P covers itself is put back for its branch",
        World(
            [fresh(handle("h1", [*PROMPT[:20], *range(9, 21)], epoch=0))],
            prefill=[(P1, 20, DONE)],
            decode=[(D1, STARTED)],
        ),
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            "pick-prefill bidirectional",
            "restore h1",
            "prefill p1",
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p1 [local M=0 C=20 L=20 drift]",
        ],
        "answered p1->d1 [local M=0 C=20 L=20 drift]",
    ),
    (
        "a prompt past the context length is refused before any handle is taken",
        World([fresh(H1)]),
        {"context_limit": 32},
        ["resolve"],
        "fail 400 This model's maximum context length is 32 tokens. However, your prompt "
        "contains 40 input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt.",
    ),
    (
        "max_tokens past the context length too",
        World([fresh(H1)]),
        {"context_limit": 64, "max_tokens": 30},
        ["resolve"],
        "fail 400 This model's maximum context length is 64 tokens. However, you requested 30 "
        "output tokens and your prompt contains 40 input tokens, for a total of 70 tokens. "
        "Please reduce the length of the input prompt or the number of requested output tokens.",
    ),
    (
        "messages without kept ids are tokenized",
        World(prefill=[(P1, None, DONE)], decode=[(D1, STARTED)]),
        {"prompt_ids": None},
        [
            "resolve",
            "tokenize",
            "candidates",
            "pick-prefill",
            "prefill p1",
            "pick-decode d1,d2 holder=-",
            "decode d1 via p1 [miss M=0 C=0 L=?]",
        ],
        "answered p1->d1 [miss M=0 C=0 L=?]",
    ),
]


@pytest.mark.parametrize(
    ("world", "turn", "actions", "end"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_turn(world: World, turn: dict[str, Any], actions: list[str], end: str) -> None:
    assert run(world, **turn) == (actions, end)


# -- each turn's path (config ``paths``): decode in place on the D that holds the handle ---------
CHOOSE = CFG.model_copy(update={"paths": CFG.paths.model_copy(update={"mode": "choose"})})
FORCED = CFG.model_copy(update={"paths": CFG.paths.model_copy(update={"mode": "decode"})})
SMALL = CFG.model_copy(
    update={"paths": CFG.paths.model_copy(update={"mode": "choose", "decode_max_new_tokens": 4})}
)
SLOW_D = Curves(prefill_d_s_per_token=0.01)
"""A D whose prefill is slow enough that reading back wins."""
IN_PLACE = ["resolve", "candidates", "take h1", "reserve d1 8"]
"""H1 holds 32 of the 40 tokens: D prefills 8."""
PULL = ["pick-prefill bidirectional", "prefill p1 read h1 32"]

EXPIRED = fresh(H1, OLD)
"""Past the router's TTL: D has freed its blocks."""
TO_CPU = ["resolve", "candidates", "discard h1", "cpu-held", "reserve d2 8"]
"""The handle is gone; D2's CPU tier holds 32 of the 40 tokens: D2 loads them, prefills 8."""
CPU_TURN = "decode d2 in place [cpu M=0 C=0 L=? next=recompute]"
RECOMPUTE = ["pick-prefill", "prefill p1", "pick-decode d1 holder=-"]
"""D2 failed: P recomputes, for the other D."""
CPU_ROWS: list[tuple[str, World, RouterConfig, dict[str, Any], list[str], str]] = [
    (
        "handle expired, a D's CPU tier holds the prefix: straight to the D holding the most",
        World([EXPIRED], decode=[(D2, STARTED)], reserve=[True], cpu={D1: 16, D2: 32}),
        CHOOSE,
        {},
        [*TO_CPU, CPU_TURN],
        "answered in place->d2 [cpu M=0 C=0 L=? next=recompute]",
    ),
    (
        'paths = "decode": to the CPU copy whenever D\'s budget allows, whatever the estimates',
        World([EXPIRED], decode=[(D2, STARTED)], reserve=[True], cpu={D2: 32}),
        FORCED,
        {"curves": SLOW_D},
        [*TO_CPU, CPU_TURN],
        "answered in place->d2 [cpu M=0 C=0 L=? next=recompute]",
    ),
    (
        "a CPU copy with more new tokens than D's budget takes: P recomputes",
        World([EXPIRED], prefill=[(P1, 0, DONE)], decode=[(D1, STARTED)], cpu={D2: 32}),
        SMALL,
        {},
        [
            "resolve",
            "candidates",
            "discard h1",
            "cpu-held",
            "pick-prefill",
            "prefill p1",
            "pick-decode d1,d2 holder=-",
            "decode d1 via p1 [expired M=0 C=0 L=0]",
        ],
        "answered p1->d1 [expired M=0 C=0 L=0]",
    ),
    (
        "the CPU copy's D out of rotation: P recomputes",
        World(
            [EXPIRED],
            prefill=[(P1, 0, DONE)],
            decode=[(D1, STARTED)],
            cpu={D2: 32},
            unhealthy=frozenset({D2}),
        ),
        CHOOSE,
        {},
        [
            "resolve",
            "candidates",
            "discard h1",
            "cpu-held",
            "pick-prefill",
            "prefill p1",
            "pick-decode d1,d2 holder=-",
            "decode d1 via p1 [expired M=0 C=0 L=0]",
        ],
        "answered p1->d1 [expired M=0 C=0 L=0]",
    ),
    (
        "the CPU copy's D budget filled before the reservation: P recomputes",
        World(
            [EXPIRED],
            prefill=[(P1, 0, DONE)],
            decode=[(D1, STARTED)],
            reserve=[False],
            cpu={D2: 32},
        ),
        CHOOSE,
        {},
        [
            *TO_CPU,
            "retry decode_budget",
            "pick-prefill",
            "prefill p1",
            "pick-decode d1,d2 holder=-",
            "decode d1 via p1 [expired M=0 C=0 L=0]",
        ],
        "answered p1->d1 [expired M=0 C=0 L=0]",
    ),
    (
        "the CPU copy's D refuses (4xx): its error passes",
        World(
            [EXPIRED],
            decode=[(D2, core.DecodeRefused(422, b"bad"))],
            reserve=[True],
            cpu={D2: 32},
        ),
        CHOOSE,
        {},
        [*TO_CPU, CPU_TURN],
        "fail 422 bad",
    ),
    *[
        (
            f"the CPU copy's D fails ({why}): P recomputes, for the other D",
            World(
                [EXPIRED],
                prefill=[(P1, 0, DONE)],
                decode=[(D2, core.DecodeFailed(why)), (D1, STARTED)],
                reserve=[True],
                cpu={D2: 32},
            ),
            CHOOSE,
            {},
            [
                *TO_CPU,
                CPU_TURN,
                "retry decode_in_place",
                *RECOMPUTE,
                "decode d1 via p1 [expired M=0 C=0 L=0]",
            ],
            "answered p1->d1 [expired M=0 C=0 L=0]",
        )
        for why in ("status", "unreachable", "deadline")
    ],
    (
        'paths = "pull": a CPU copy is never asked for',
        World([EXPIRED], prefill=[(P1, 0, DONE)], decode=[(D1, STARTED)], cpu={D2: 32}),
        CFG,
        {},
        [
            "resolve",
            "candidates",
            "discard h1",
            "pick-prefill",
            "prefill p1",
            "pick-decode d1,d2 holder=-",
            "decode d1 via p1 [expired M=0 C=0 L=0]",
        ],
        "answered p1->d1 [expired M=0 C=0 L=0]",
    ),
]

PATH_ROWS: list[tuple[str, World, RouterConfig, dict[str, Any], list[str], str]] = [
    (
        "few new tokens: straight to the D that holds them; the spent handle is freed",
        World([fresh(H1)], decode=[(D1, STARTED)], reserve=[True]),
        CHOOSE,
        {},
        [
            *IN_PLACE,
            "decode d1 in place [decode M=0 C=32 L=? next=recompute]",
            "release h1 superseded",
        ],
        "answered in place->d1 [decode M=0 C=32 L=? next=recompute]",
    ),
    (
        "a handle verified in part (drift): D prefills what follows its verified blocks",
        World(
            [fresh(handle("h1", [*PROMPT[:20], *range(9, 21)]))],
            decode=[(D1, STARTED)],
            reserve=[True],
        ),
        CHOOSE,
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            "reserve d1 20",
            "decode d1 in place [decode M=0 C=20 L=? drift next=recompute]",
            "release h1 superseded",
        ],
        "answered in place->d1 [decode M=0 C=20 L=? drift next=recompute]",
    ),
    (
        "more new tokens than D's budget takes: pull",
        World([fresh(H1)], prefill=[(P1, 0, DONE)], decode=[(D1, STARTED)]),
        SMALL,
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            *PULL,
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p1 [pull M=32 C=32 L=0 next=recompute]",
        ],
        "answered p1->d1 [pull M=32 C=32 L=0 next=recompute]",
    ),
    (
        "D's budget full of other turns' tokens in flight: pull",
        World([fresh(H1)], prefill=[(P1, 0, DONE)], decode=[(D1, STARTED)], in_flight={D1: 8190}),
        CHOOSE,
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            *PULL,
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p1 [pull M=32 C=32 L=0 next=recompute]",
        ],
        "answered p1->d1 [pull M=32 C=32 L=0 next=recompute]",
    ),
    (
        "400 streams on D: what its 8 new tokens delay them is the budget's to bound, not "
        "a cost: in place",
        World([fresh(H1)], decode=[(D1, STARTED)], reserve=[True], running={D1: 400}),
        CHOOSE,
        {},
        [
            *IN_PLACE,
            "decode d1 in place [decode M=0 C=32 L=? next=recompute]",
            "release h1 superseded",
        ],
        "answered in place->d1 [decode M=0 C=32 L=? next=recompute]",
    ),
    (
        "400 streams on the other D, and P's queue long: in place on the D that holds the handle",
        World(
            [fresh(H1)],
            decode=[(D1, STARTED)],
            reserve=[True],
            running={D2: 400},
            p_queued=100_000,
        ),
        CHOOSE,
        {},
        [
            *IN_PLACE,
            "decode d1 in place [decode M=0 C=32 L=? next=recompute]",
            "release h1 superseded",
        ],
        "answered in place->d1 [decode M=0 C=32 L=? next=recompute]",
    ),
    (
        "D's budget filled between the choice and the reservation: pull, the handle unspent",
        World([fresh(H1)], prefill=[(P1, 0, DONE)], decode=[(D1, STARTED)], reserve=[False]),
        CHOOSE,
        {},
        [
            *IN_PLACE,
            "retry decode_budget",
            *PULL,
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p1 [pull M=32 C=32 L=0]",
        ],
        "answered p1->d1 [pull M=32 C=32 L=0]",
    ),
    (
        "D refuses (4xx): its error passes, the handle is put back unspent",
        World([fresh(H1)], decode=[(D1, core.DecodeRefused(422, b"bad"))], reserve=[True]),
        CHOOSE,
        {},
        [*IN_PLACE, "decode d1 in place [decode M=0 C=32 L=? next=recompute]", "restore h1"],
        "fail 422 bad",
    ),
    (
        "D answers 5xx or 429: its KV is still readable, P pulls it for another D",
        World(
            [fresh(H1)],
            prefill=[(P1, 0, DONE)],
            decode=[(D1, core.DecodeFailed("status")), (D2, STARTED)],
            reserve=[True],
        ),
        CHOOSE,
        {},
        [
            *IN_PLACE,
            "decode d1 in place [decode M=0 C=32 L=? next=recompute]",
            "retry decode_in_place",
            *PULL,
            "pick-decode d2 holder=d1",
            "decode d2 via p1 [pull M=32 C=32 L=0]",
        ],
        "answered p1->d2 [pull M=32 C=32 L=0]",
    ),
    (
        "D unreachable: the handle is released (no read from it either), P recomputes",
        World(
            [fresh(H1)],
            prefill=[(P1, 0, DONE)],
            decode=[(D1, core.DecodeFailed("unreachable")), (D2, STARTED)],
            reserve=[True],
        ),
        CHOOSE,
        {},
        [
            *IN_PLACE,
            "decode d1 in place [decode M=0 C=32 L=? next=recompute]",
            "retry decode_in_place",
            "release h1 decode_failed",
            "pick-prefill",
            "prefill p1",
            "pick-decode d2 holder=d1",
            "decode d2 via p1 [recompute M=0 C=32 L=0]",
        ],
        "answered p1->d2 [recompute M=0 C=32 L=0]",
    ),
    (
        "D silent past its first-byte deadline: the same, on another D",
        World(
            [fresh(H1)],
            prefill=[(P2, None, DONE)],
            decode=[(D1, core.DecodeFailed("deadline")), (D2, STARTED)],
            reserve=[True],
        ),
        CHOOSE,
        {},
        [
            *IN_PLACE,
            "decode d1 in place [decode M=0 C=32 L=? next=recompute]",
            "retry decode_in_place",
            "release h1 decode_failed",
            "pick-prefill",
            "prefill p2",
            "pick-decode d2 holder=d1",
            "decode d2 via p2 [recompute M=0 C=32 L=?]",
        ],
        "answered p2->d2 [recompute M=0 C=32 L=?]",
    ),
    (
        "D out of rotation: its handle is read back through P, for another D",
        World(
            [fresh(H1)],
            prefill=[(P1, 0, DONE)],
            decode=[(D2, STARTED)],
            unhealthy=frozenset({D1}),
        ),
        CHOOSE,
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            *PULL,
            "pick-decode d1,d2 holder=d1",
            "decode d2 via p1 [pull M=32 C=32 L=0]",
        ],
        "answered p1->d2 [pull M=32 C=32 L=0]",
    ),
    (
        "D is another engine now: its handle is dropped unread, never decoded in place",
        World(
            [fresh(H1)],
            engines={D1: "d1-restarted", D2: "d2"},
            prefill=[(P1, None, DONE)],
            decode=[(D1, STARTED)],
        ),
        CHOOSE,
        {},
        [
            "resolve",
            "candidates",
            "discard h1 restarted",
            "cpu-held",
            "pick-prefill",
            "prefill p1",
            "pick-decode d1,d2 holder=-",
            "decode d1 via p1 [miss M=0 C=0 L=?]",
        ],
        "answered p1->d1 [miss M=0 C=0 L=?]",
    ),
    (
        'paths = "pull": through P, as before',
        World([fresh(H1)], prefill=[(P1, 0, DONE)], decode=[(D1, STARTED)]),
        CFG,
        {},
        [
            "resolve",
            "candidates",
            "take h1",
            *PULL,
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p1 [pull M=32 C=32 L=0]",
        ],
        "answered p1->d1 [pull M=32 C=32 L=0]",
    ),
    (
        "a D slow to prefill: through P, which reads back (the handle rules decide, as before)",
        World([fresh(H1)], prefill=[(P1, 0, DONE)], decode=[(D1, STARTED)]),
        CHOOSE,
        {"curves": SLOW_D},
        [
            "resolve",
            "candidates",
            "take h1",
            *PULL,
            "pick-decode d1,d2 holder=d1",
            "decode d1 via p1 [pull M=32 C=32 L=0 next=recompute]",
        ],
        "answered p1->d1 [pull M=32 C=32 L=0 next=recompute]",
    ),
    (
        'paths = "decode": in place whenever D\'s budget allows, whatever the estimates',
        World([fresh(H1)], decode=[(D1, STARTED)], reserve=[True]),
        FORCED,
        {"curves": SLOW_D},
        [
            *IN_PLACE,
            "decode d1 in place [decode M=0 C=32 L=? next=recompute]",
            "release h1 superseded",
        ],
        "answered in place->d1 [decode M=0 C=32 L=? next=recompute]",
    ),
    (
        "a first turn has no handle: through P",
        World(prefill=[(P1, None, DONE)], decode=[(D1, STARTED)]),
        FORCED,
        {},
        [
            "resolve",
            "candidates",
            "cpu-held",
            "pick-prefill",
            "prefill p1",
            "pick-decode d1,d2 holder=-",
            "decode d1 via p1 [miss M=0 C=0 L=?]",
        ],
        "answered p1->d1 [miss M=0 C=0 L=?]",
    ),
    *CPU_ROWS,
]


@pytest.mark.parametrize(
    ("world", "cfg", "turn", "actions", "end"),
    [r[1:] for r in PATH_ROWS],
    ids=[r[0] for r in PATH_ROWS],
)
def test_path(
    world: World, cfg: RouterConfig, turn: dict[str, Any], actions: list[str], end: str
) -> None:
    assert run(world, cfg, **turn) == (actions, end)


def test_decode_in_place_receipt_carries_the_estimates() -> None:
    """The receipt's estimates are the cost model's for this turn: decode's, and the cheapest
    other path's (on a 40-token prompt, recomputing beats reading 32 tokens back: a transfer's
    fixed cost is 16 ms, a token's prefill 22 µs)."""
    world = World([fresh(H1)], decode=[(D1, STARTED)], reserve=[True])
    inp = core.TurnInput(KEY, 0, "m", None, (D1, D2), prompt_ids=list(PROMPT))
    _, end = drive(core.turn_plan(inp, CHOOSE), world)
    assert isinstance(end, core.Answered) and end.prefill_url is None
    choice = choose(TurnState(40, handle_tokens=32, d_cached_tokens=32, recompute_threshold=8))
    assert (choice.path, choice.runner_up) == ("decode", "recompute")
    r = end.receipt
    assert (r.estimate_s, r.runner_up, r.runner_up_s) == (
        choice.ttft_s,
        "recompute",
        choice.runner_up_ttft_s,
    )
    headers = r.headers()
    assert headers["X-AgentKV-Decision"] == "decode"
    assert "X-AgentKV-Estimated" not in headers  # no P, no L to estimate
    assert headers["X-AgentKV-Runner-Up"] == "recompute"
    assert float(headers["X-AgentKV-Runner-Up-Estimate-Ms"]) > float(
        headers["X-AgentKV-Path-Estimate-Ms"]
    )


def test_a_restore_that_displaces_releases_the_displaced_handle() -> None:
    other = handle("h9", PROMPT[:8], d=D2, engine="d2")
    NAMES[other.id] = "h9"
    world = World(
        [fresh(H1)], prefill=[(P1, None, core.PrefillRefused(404, b"no"))], displaced=[other]
    )
    seen, end = run(world)
    assert seen[-2:] == ["restore h1", "release h9 displaced"]
    assert end == "fail 404 no"


def test_the_actions_in_full() -> None:
    """The first-turn row as the dataclasses themselves: nothing is hidden by ``show``."""
    world = World(prefill=[(P1, 12, DONE)], decode=[(D2, STARTED)])
    inp = core.TurnInput(KEY, 0, "m", None, (D1, D2), prompt_ids=list(PROMPT))
    plan = core.turn_plan(inp, CFG)
    actions: list[core.Action] = []
    answer: Any = None
    answers = iter(
        [
            world.resolved,
            core.Found([], world.engines, True),
            core.PrefillChoice(P1, 12),
            DONE,
            D2,
            STARTED,
        ]
    )
    with pytest.raises(StopIteration) as stop:
        while True:
            actions.append(plan.send(answer))
            answer = next(answers)
    receipt = Receipt("miss", 0, 0, 12, None)
    decode = actions[5]
    assert isinstance(decode, core.Decode)
    assert actions == [
        core.Resolve(),
        core.Candidates(KEY),
        core.PickPrefill(False, PROMPT),
        core.Prefill(P1, PROMPT, KVTransferParams.for_prefill().to_wire(), False, False),
        core.PickDecode((D1, D2), None),
        core.Decode(D2, P_HANDLE, receipt, P1, {}, decode.remember),
    ]
    assert decode.remember.key == KEY and decode.remember.prompt.root == ROOT
    assert stop.value.value == core.Answered(receipt, P1, D2, PROMPT)


# -- what D's answer leaves behind --------------------------------------------------------------
def d_handle(num: int, request: str = "new", engine: str = "d1") -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_block_ids": [list(range(num // BS + 1))],
        "remote_engine_id": engine,
        "remote_request_id": request,
        "remote_host": "localhost",
        "remote_port": 5600,
        "remote_num_tokens": num,
    }


PENDING = Pending(KEY, 3, b"h", b"c", frozenset())


def remember(
    captured: Captured,
    *,
    key: Any = KEY,
    pending: Pending | None = None,
    displaced: Sequence[StoredHandle] = (),
) -> tuple[list[str], Any, list[core.Action]]:
    job = core.RememberJob(key, 2, PromptHashes(PROMPT, BS, ROOT), pending)
    plan = core.remember_plan(job, captured, "http://10.1.2.3:8200", None)
    actions: list[core.Action] = []
    answer: Any = None
    while True:
        try:
            action = plan.send(answer)
        except StopIteration as stop:
            return [show(a) for a in actions], stop.value, actions
        actions.append(action)
        answer = list(displaced) if isinstance(action, core.Store) else None


OUTPUT = [7, 8, 9, 10, 11]


@pytest.mark.parametrize(
    ("captured", "kw", "actions", "kept"),
    [
        (
            Captured(d_handle(44), OUTPUT),
            {},
            ["identify 10.1.2.3:8200 as d1", "store new@10.1.2.3:8200"],
            "stored",
        ),
        (
            Captured(d_handle(44), OUTPUT),
            {"displaced": [H2]},
            ["identify 10.1.2.3:8200 as d1", "store new@10.1.2.3:8200", "release h2 displaced"],
            "stored",
        ),
        (
            Captured(d_handle(44), OUTPUT),
            {"key": None},
            ["identify 10.1.2.3:8200 as d1", "release new@10.1.2.3:8200 anonymous"],
            "released",
        ),
        (
            Captured(d_handle(44), OUTPUT),
            {"pending": PENDING},
            ["record 40+5", "identify 10.1.2.3:8200 as d1", "store new@10.1.2.3:8200"],
            "stored",
        ),
        (Captured(None, OUTPUT), {"pending": PENDING}, ["record 40+5"], "none"),
        (Captured({"remote_num_tokens": 4}, OUTPUT), {}, [], "none"),
        (Captured({"remote_block_ids": "nope"}, OUTPUT), {}, [], "unknown"),
    ],
    ids=["stored", "displaces", "anonymous", "identity", "no-handle", "no-blocks", "bad-shape"],
)
def test_remember(captured: Captured, kw: dict[str, Any], actions: list[str], kept: str) -> None:
    seen, result, _ = remember(captured, **kw)
    assert (seen, result) == (actions, kept)


def test_remembered_handle_verifies_for_the_next_prompt() -> None:
    """The stored handle holds the prompt + output's first 44 tokens, reachable at D's host."""
    _, _, actions = remember(Captured(d_handle(44), OUTPUT))
    store = actions[-1]
    assert isinstance(store, core.Store)
    stored = store.handle
    assert stored.params["remote_host"] == "10.1.2.3" and stored.decode_url.endswith(":8200")
    assert (stored.num_tokens, stored.epoch, stored.block_size) == (44, 2, BS)
    expected = held_record([], 44, PromptHashes([*PROMPT, *OUTPUT], BS, ROOT))
    assert (stored.block_hashes, stored.tail_tokens) == (expected.digests, expected.tail)
    assert (stored.root, stored.prefix_digest) == (ROOT, expected.prefix)


def test_store_down_releases_the_new_handle() -> None:
    """A store that did not take the handle gives it back: it is released at once."""
    job = core.RememberJob(KEY, 0, PromptHashes(PROMPT, BS, ROOT), None)
    plan = core.remember_plan(job, Captured(d_handle(44), OUTPUT), D1, None)
    assert isinstance(next(plan), core.Identify)
    store = plan.send(None)
    assert isinstance(store, core.Store)
    release = plan.send([store.handle])
    assert release == core.Release(store.handle, "store_down")
