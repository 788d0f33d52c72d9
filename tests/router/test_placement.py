"""Placement on its own: which P a turn's prefill goes to (rendezvous affinity, a load cap,
bidirectional transfer) and which D decodes it (least busy, the holder unless much busier)."""

from __future__ import annotations

import pytest

from agentkv.router.config import Backend
from agentkv.router.upstream import Upstream, load, pick_decode, pick_prefill


def engine(
    url: str,
    *,
    role: str = "prefill",
    healthy: bool = True,
    tokens: int = 0,
    requests: int = 0,
    bidirectional: bool = True,
) -> Upstream:
    # placement reads the backend and the load only: no client is ever called
    e = Upstream(role, Backend(url=url, bidirectional=bidirectional), None, None)  # type: ignore[arg-type]
    e.healthy, e.outstanding_tokens, e.outstanding_requests = healthy, tokens, requests
    return e


PS = [engine(f"http://p{i}:8000") for i in range(4)]


def test_a_conversation_keeps_its_p_and_conversations_spread() -> None:
    chosen = {
        key: pick_prefill(PS, key, cap_tokens=10_000, need_bidirectional=True)
        for key in (f"conv-{i}" for i in range(200))
    }
    for key, p in chosen.items():
        assert pick_prefill(PS, key, cap_tokens=10_000, need_bidirectional=True) is p
    counts = {p.url: sum(1 for c in chosen.values() if c is p) for p in PS}
    assert all(20 <= n <= 80 for n in counts.values()), counts  # 50 each, give or take


def test_removing_a_p_moves_only_its_own_conversations() -> None:
    keys = [f"conv-{i}" for i in range(200)]
    before = {k: pick_prefill(PS, k, cap_tokens=10**9, need_bidirectional=True) for k in keys}
    gone = PS[1]
    rest = [p for p in PS if p is not gone]
    after = {k: pick_prefill(rest, k, cap_tokens=10**9, need_bidirectional=True) for k in keys}
    moved = [k for k in keys if before[k] is not after[k]]
    assert moved and all(before[k] is gone for k in moved)


def test_an_overloaded_preferred_p_yields_to_the_least_loaded() -> None:
    ps = [engine(f"http://p{i}:8000") for i in range(3)]
    preferred = pick_prefill(ps, "c", cap_tokens=1_000, need_bidirectional=True)
    assert preferred is not None
    preferred.outstanding_tokens = 1_001
    others = [p for p in ps if p is not preferred]
    others[0].outstanding_tokens, others[1].outstanding_tokens = 500, 200
    assert pick_prefill(ps, "c", cap_tokens=1_000, need_bidirectional=True) is others[1]
    preferred.outstanding_tokens = 1_000  # at the cap is not over it
    assert pick_prefill(ps, "c", cap_tokens=1_000, need_bidirectional=True) is preferred


def test_no_key_goes_to_the_least_loaded() -> None:
    ps = [engine("http://a:1", tokens=30), engine("http://b:1", tokens=10), engine("http://c:1")]
    ps[2].outstanding_tokens = 20
    assert pick_prefill(ps, None, cap_tokens=0, need_bidirectional=False) is ps[1]


def test_a_pull_needs_a_bidirectional_p_and_ejected_ps_are_tried_last() -> None:
    plain = engine("http://plain:1", bidirectional=False)
    both = engine("http://both:1", healthy=False)
    assert pick_prefill([plain, both], "c", cap_tokens=10, need_bidirectional=True) is both
    assert pick_prefill([plain], "c", cap_tokens=10, need_bidirectional=True) is None
    # a healthy one wins over an ejected one; all ejected: tried anyway
    assert pick_prefill([plain, both], "c", cap_tokens=10, need_bidirectional=False) is plain
    plain.healthy = False
    assert pick_prefill([plain, both], "c", cap_tokens=10, need_bidirectional=False) in (
        plain,
        both,
    )
    assert pick_prefill([], "c", cap_tokens=10, need_bidirectional=False) is None


@pytest.mark.parametrize(
    ("holder_load", "least_load", "slack", "expect_holder"),
    [(0, 0, 2, True), (2, 0, 2, True), (3, 0, 2, False), (5, 5, 0, True), (1, 0, 0, False)],
)
def test_the_holder_decodes_unless_much_busier(
    holder_load: int, least_load: int, slack: int, expect_holder: bool
) -> None:
    holder = engine("http://d0:1", role="decode", requests=holder_load)
    other = engine("http://d1:1", role="decode", requests=least_load)
    chosen = pick_decode([other, holder], holder.url, slack=slack)
    assert chosen is (holder if expect_holder else other)


def test_decode_without_a_holder_and_when_ejected() -> None:
    ds = [engine(f"http://d{i}:1", role="decode", requests=r) for i, r in enumerate((3, 1, 2))]
    assert pick_decode(ds, None) is ds[1]
    ds[1].healthy = False
    assert pick_decode(ds, None) is ds[2]
    assert pick_decode(ds, ds[1].url) is ds[2]  # an ejected holder is not preferred
    for d in ds:
        d.healthy = False
    assert pick_decode(ds, None) is ds[1]  # all ejected: the least busy is tried anyway
    assert pick_decode([], None) is None


def test_the_load_the_path_cost_model_reads() -> None:
    """Each D's requests running; the prompt tokens the least loaded healthy P computes (a
    request's prompt less what it reads back), not its whole prompt."""
    d1, d2 = engine("http://d1", role="decode", requests=3), engine("http://d2", role="decode")
    d2.healthy = False
    p1, p2, p3 = (engine(f"http://p{i}") for i in (1, 2, 3))
    p1.count_prefill(5000, 200)  # a read back of 4,800 tokens: P computes 200
    p2.count_prefill(1000, 1000)
    p3.count_prefill(10, 10)
    p3.healthy = False
    assert load([d1, d2], [p1, p2, p3]) == (
        frozenset({"http://d2"}),
        {"http://d1": 3, "http://d2": 0},
        200,
    )
    p1.count_prefill(-5000, -200)
    assert (p1.outstanding_tokens, p1.prefill_tokens) == (0, 0)
    assert load([], [p3])[2] == 0  # no healthy P: nothing known
