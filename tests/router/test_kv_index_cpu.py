"""D's CPU tier from its KV events (``medium: "CPU"``, vLLM 0.33's OffloadingConnector with
``self_describing_kv_events``): the index math, and a subscriber against a real ``agentkv sim``
D whose CPU tier stores and evicts (its events as vLLM publishes them)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from agentkv.protocol.kv_events import AllBlocksCleared, BlockStored
from agentkv.router.kv_index import PrefixIndex
from agentkv.router.kv_subscriber import KVEventSubscriber
from agentkv.sim.launch import free_port, start_sim
from tests.router.test_kv_index import BS, IDS, _until, removed, stored

pytestmark = pytest.mark.anyio


def cpu_stored(hashes: list[int], tokens: list[int], parent: int | None = None) -> BlockStored:
    """A CPU store as vLLM 0.33 publishes it: self-describing, no extra keys."""
    return stored(hashes, tokens, parent, extra=None, medium="CPU")


def offloaded(index: PrefixIndex, blocks: int, first: int = 0) -> None:
    """The CPU copies of blocks ``first..blocks-1`` of IDS (hash ``i + 1``), one event each."""
    for i in range(first, blocks):
        index.apply(cpu_stored([i + 1], IDS[i * BS : (i + 1) * BS], i or None))


def test_a_cpu_index_counts_cpu_blocks_only_under_the_gpu_roots_salt() -> None:
    index = PrefixIndex(BS, medium="CPU", in_sync=True)
    # GPU stores are not the CPU tier's ...
    index.apply(stored([1, 2, 3], IDS[: 3 * BS], salt="s"))
    assert index.local_prefix_tokens(IDS, "s") == 0
    # ... but they say the root's salt, which vLLM's CPU events leave out
    offloaded(index, 3)
    assert index.local_prefix_tokens(IDS, "s") == 3 * BS
    assert index.local_prefix_tokens(IDS) == 0  # never under another salt
    assert index.stats.root_hints == 1
    # a GPU eviction leaves the CPU copy; a CPU one (the tier's LRU evicts a tail) shortens it
    index.apply(removed(1, 2, 3))
    assert index.local_prefix_tokens(IDS, "s") == 3 * BS
    index.apply(removed(3, medium="CPU"))
    assert index.local_prefix_tokens(IDS, "s") == 2 * BS
    # a prefix-cache reset is the GPU's: the CPU tier keeps its blocks
    index.apply(AllBlocksCleared())
    assert index.local_prefix_tokens(IDS, "s") == 2 * BS
    # the P-side index is not fooled by CPU events
    gpu = PrefixIndex(BS, in_sync=True)
    offloaded(gpu, 3)
    assert gpu.local_prefix_tokens(IDS) == 0


def test_cpu_roots_without_a_known_salt_never_count() -> None:
    index = PrefixIndex(BS, medium="CPU", in_sync=True)
    offloaded(index, 2)  # no GPU root seen: its salt is unknown
    assert index.local_prefix_tokens(IDS) == 0
    trusting = PrefixIndex(BS, medium="CPU", missing_salt="unsalted", in_sync=True)
    offloaded(trusting, 2)
    assert trusting.local_prefix_tokens(IDS) == 2 * BS
    # vLLM's placeholder without self_describing_kv_events: no tokens, block_size 0
    index.apply(stored([1], [], None, extra=None, medium="CPU", block_size=0))
    assert index.local_prefix_tokens(IDS) == 0 and index.stats.skipped_events >= 1
    # a block whose parent was never saved (a failed save) waits: no hole in a prefix
    holes = PrefixIndex(BS, medium="CPU", missing_salt="unsalted", in_sync=True)
    offloaded(holes, 3, first=1)
    assert holes.local_prefix_tokens(IDS) == 0
    offloaded(holes, 1)
    assert holes.local_prefix_tokens(IDS) == 3 * BS


@pytest.mark.e2e
async def test_cpu_index_follows_the_sims_cpu_tier() -> None:
    """A sim D with a CPU tier of 6 blocks and KV events: the CPU index holds what the tier
    loads on the next request, and a tail the tier evicted is gone from it too."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "topic": "kv"}
    index = PrefixIndex(BS, medium="CPU")
    sub = KVEventSubscriber(endpoint, "kv", index)
    await sub.start()
    try:
        with start_sim(
            "--role", "decode", "--block-size", str(BS), "--time-scale", "0",
            "--cpu-offload-blocks", "6", "--kv-events-config", json.dumps(config),
        ) as sim:  # fmt: skip
            async with httpx.AsyncClient(trust_env=False, base_url=sim.url, timeout=30) as client:

                async def complete(ids: list[int]) -> httpx.Response:
                    body: dict[str, Any] = {"prompt": ids, "max_tokens": 1}
                    r = await client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    return r

                a = list(range(500, 500 + 4 * BS + 1))  # 4 full blocks
                await complete(a)
                await _until(lambda: index.in_sync and index.local_prefix_tokens(a) == 4 * BS)
                await client.post("/reset_prefix_cache")  # GPU only: the next hit is the CPU's
                r = await complete(a)
                assert r.headers["x-agentkv-sim-cpu-tokens"] == str(4 * BS)
                # another 4 blocks: the 6-block tier evicts a's least recently used, its tail
                b = list(range(7000, 7000 + 4 * BS + 1))
                await complete(b)
                await _until(lambda: index.local_prefix_tokens(b) == 4 * BS)
                await _until(lambda: index.local_prefix_tokens(a) == 2 * BS)
                await client.post("/reset_prefix_cache")
                r = await complete(a)
                assert r.headers["x-agentkv-sim-cpu-tokens"] == str(2 * BS)
    finally:
        await sub.aclose()
