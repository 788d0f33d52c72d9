from __future__ import annotations

import pytest

from agentkv.sim import blocks as kv
from agentkv.sim.blocks import BlockPool, KVContent, NoFreeBlocksError

BS = 4


def test_block_hashes_chain_and_salt():
    a = kv.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    b = kv.block_hashes([1, 2, 3, 4, 5, 6, 7, 0], BS)
    assert len(a) == 2  # only full blocks
    assert a[0] == b[0] and a[1] != b[1]
    assert kv.block_hashes([1, 2, 3, 4], BS, cache_salt="x") != a[:1]


def test_block_zero_is_null_and_allocation_is_lru():
    pool = BlockPool(5, BS)
    assert pool.num_usable == 4
    first = pool.allocate(2)
    assert [b.block_id for b in first] == [1, 2]
    pool.free(first)  # tail first: block 2 then block 1 join the queue
    again = pool.allocate(4)
    assert [b.block_id for b in again] == [3, 4, 2, 1]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)


def test_prefix_cache_hit_touch_and_eviction():
    pool = BlockPool(4, BS)
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    hashes = kv.block_hashes(ids, BS)
    blocks = pool.allocate(2)
    for b, h in zip(blocks, hashes, strict=True):
        pool.cache(b, h)
    pool.free(blocks)
    assert pool.longest_cached_prefix(hashes) == blocks
    pool.touch(blocks[:1])
    assert pool.num_free == 2
    pool.allocate(2)  # evicts the free cached block 2
    assert pool.longest_cached_prefix(hashes) == blocks[:1]


def test_no_prefix_caching_never_hits():
    pool = BlockPool(4, BS, prefix_caching=False)
    (b,) = pool.allocate(1)
    h = kv.block_hashes([1, 2, 3, 4], BS)
    pool.cache(b, h[0])
    assert pool.longest_cached_prefix(h) == []


def test_double_free_is_an_error():
    pool = BlockPool(3, BS)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([b])


def test_count_wrong_tokens():
    seq = list(range(10, 22))  # 12 tokens = 3 blocks
    truth = kv.contents_for(seq, BS, 0, 3, None)
    assert kv.count_wrong_tokens(seq, truth, BS, 12, None) == 0
    other = [*seq[:5], 99, *seq[6:]]
    # blocks computed for `other`: block 1 differs from position 5 on, block 2 by context
    assert kv.count_wrong_tokens(seq, kv.contents_for(other, BS, 0, 3, None), BS, 12, None) == 3 + 4
    shifted = [truth[1], truth[2], None]  # end-trimmed blocks placed one block early
    assert kv.count_wrong_tokens(seq, shifted, BS, 12, None) == 12
    partial = [truth[0], KVContent(truth[1].parent, 4, truth[1].tokens[:2]), None]
    assert kv.count_wrong_tokens(seq, partial, BS, 12, None) == 2 + 4
    assert kv.count_wrong_tokens(seq, truth, BS, 12, "salt") == 12
