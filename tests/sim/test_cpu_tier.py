"""D's CPU tier (agentkv.sim.cpu_tier) evicts as vLLM 0.33's LRU offloading manager does: a touch
walks a sequence from its last block to its first, so a full tier gives up a sequence's tail and
what stays is a prefix a later turn can still load."""

from __future__ import annotations

from agentkv.sim.blocks import KVContent
from agentkv.sim.cpu_tier import CpuTier


def seq(name: str, n: int) -> tuple[list[bytes], list[KVContent | None]]:
    hashes = [f"{name}{i}".encode() for i in range(n)]
    return hashes, [KVContent(b"", i * 16, (i,) * 16) for i in range(n)]


def test_a_full_tier_evicts_the_older_sequences_tail_first() -> None:
    tier = CpuTier(6)
    a, a_kv = seq("a", 4)
    b, b_kv = seq("b", 4)
    tier.save(a, a_kv)
    result = tier.save(b, b_kv)
    assert result.evicted == 2
    # a keeps its first two blocks: a prefix that still loads
    assert len(tier.lookup(a)) == 2
    assert len(tier.lookup(b)) == 4


def test_a_lookup_makes_the_prefix_it_read_the_most_recent() -> None:
    tier = CpuTier(6)
    a, a_kv = seq("a", 3)
    b, b_kv = seq("b", 3)
    tier.save(a, a_kv)
    tier.save(b, b_kv)
    assert len(tier.lookup(a)) == 3  # a is now more recent than b
    c, c_kv = seq("c", 2)
    tier.save(c, c_kv)
    # b, the least recently used, loses its tail; a and c are whole
    assert [len(tier.lookup(x)) for x in (a, b, c)] == [3, 1, 2]


def test_a_failed_save_leaves_a_hole_that_ends_the_prefix() -> None:
    tier = CpuTier(8, failure_rate=1.0)
    a, a_kv = seq("a", 3)
    assert tier.save(a, a_kv).failed == 3
    assert tier.lookup(a) == []
