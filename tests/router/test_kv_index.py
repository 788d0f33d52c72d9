"""The router's view of P's prefix cache from KV events: index math (salts, removals, gaps) and a
subscriber against a real ``agentkv sim`` process (L equals the simulator's own local hit)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
import zmq

from agentkv.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
)
from agentkv.protocol.promtext import parse_metrics
from agentkv.router.kv_index import KVEventSubscriber, PrefixIndex, subscriber_endpoint
from agentkv.router.verify import chain_hashes
from agentkv.sim.kv_events import ZmqEventPublisher
from agentkv.sim.launch import free_port, start_sim

pytestmark = pytest.mark.anyio

BS = 4


def stored(
    hashes: Sequence[int],
    tokens: Sequence[int],
    parent: int | None = None,
    *,
    salt: str | None = None,
    extra: list[tuple[Any, ...] | None] | str | None = "auto",
    **kw: Any,
) -> BlockStored:
    if extra == "auto":
        extra = [
            (salt,) if i == 0 and salt and parent is None else None for i in range(len(hashes))
        ]
    assert not isinstance(extra, str)
    fields: dict[str, Any] = {
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        **kw,
    }
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        extra_keys=extra,
        **fields,
    )


def removed(*hashes: int, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=0)


IDS = list(range(1000, 1000 + 5 * BS))  # five blocks


def test_lookup_is_block_aligned_and_capped() -> None:
    index = PrefixIndex(BS)
    index.apply(stored([1, 2, 3], IDS[: 3 * BS]))
    assert index.local_prefix_tokens(IDS) == 3 * BS
    assert index.local_prefix_tokens(IDS[: 3 * BS + 1]) == 3 * BS
    # vLLM computes the last prompt token: a prompt of exactly 3 blocks hits 2.
    assert index.local_prefix_tokens(IDS[: 3 * BS]) == 2 * BS
    assert index.local_prefix_tokens(IDS[:BS]) == 0
    assert index.local_prefix_tokens([]) == 0
    other = [7, *IDS[1:]]
    assert index.local_prefix_tokens(other) == 0
    # The router's own hashes (verify.chain_hashes) give the same answer.
    assert index.local_prefix_tokens_from_hashes(chain_hashes(IDS, BS), len(IDS)) == 3 * BS


def test_children_chain_through_parents_and_orphans_wait() -> None:
    index = PrefixIndex(BS)
    index.apply(stored([3], IDS[2 * BS : 3 * BS], parent=2))  # arrives before its parent
    assert index.local_prefix_tokens(IDS) == 0
    index.apply(stored([1], IDS[:BS]))
    index.apply(stored([2], IDS[BS : 2 * BS], parent=1))
    assert index.local_prefix_tokens(IDS) == 3 * BS


def test_salts_never_mix() -> None:
    index = PrefixIndex(BS)
    index.apply(stored([11, 12], IDS[: 2 * BS], salt="a"))
    assert index.local_prefix_tokens(IDS, "a") == 2 * BS
    assert index.local_prefix_tokens(IDS) == 0
    assert index.local_prefix_tokens(IDS, "b") == 0
    # The same tokens under salt b: vLLM hashes differ, the router hash is the same.
    index.apply(stored([21, 22, 23], IDS[: 3 * BS], salt="b"))
    assert index.local_prefix_tokens(IDS, "b") == 3 * BS
    assert index.local_prefix_tokens(IDS, "a") == 2 * BS  # b's third block is not a's
    index.apply(removed(11))
    assert index.local_prefix_tokens(IDS, "a") == 0
    assert index.local_prefix_tokens(IDS, "b") == 3 * BS
    assert index.local_prefix_tokens(IDS, "") == 0  # "" is no salt, as in vLLM


def test_missing_salt_and_uncountable_blocks() -> None:
    index = PrefixIndex(BS)
    index.apply(stored([1, 2], IDS[: 2 * BS], extra=None))  # no extra_keys: salt unknown
    assert index.local_prefix_tokens(IDS) == 0
    assert index.local_prefix_tokens(IDS, "x") == 0
    trusting = PrefixIndex(BS, missing_salt="unsalted")
    trusting.apply(stored([1, 2], IDS[: 2 * BS], extra=None))
    assert trusting.local_prefix_tokens(IDS) == 2 * BS
    assert trusting.local_prefix_tokens(IDS, "x") == 0
    # A multimodal block (an (mm_identifier, offset) pair): tokens do not decide its KV.
    mm = PrefixIndex(BS)
    mm.apply(stored([1, 2, 3], IDS[: 3 * BS], extra=[None, (("img", 0),), None]))
    assert mm.local_prefix_tokens(IDS) == BS
    assert mm.stats.uncountable_blocks == 2
    # LoRA: its own namespace.
    lora = PrefixIndex(BS)
    lora.apply(stored([1], IDS[:BS], extra=[("ad1",)], lora_name="ad1", lora_id=1))
    assert lora.local_prefix_tokens(IDS) == 0
    assert lora.local_prefix_tokens(IDS, lora_name="ad1") == BS


def test_removal_clear_and_foreign_events() -> None:
    index = PrefixIndex(BS)
    index.apply(stored([1, 2, 3, 4], IDS[: 4 * BS]))
    index.apply(removed(3, medium="CPU"))  # another tier: not P's device cache
    assert index.local_prefix_tokens(IDS) == 4 * BS
    index.apply(removed(3))
    assert index.local_prefix_tokens(IDS) == 2 * BS
    index.apply(removed(3))  # again: harmless
    index.apply(stored([3], IDS[2 * BS : 3 * BS], parent=2))  # stored again
    assert index.local_prefix_tokens(IDS) == 4 * BS
    index.apply(stored([9], IDS[:8], block_size=8))  # another block size
    index.apply(stored([9], IDS[:BS], group_idx=1))  # another KV cache group
    assert index.stats.skipped_events == 3
    index.apply(AllBlocksCleared())
    assert index.local_prefix_tokens(IDS) == 0 and len(index) == 0


def test_max_blocks_ages_out_oldest() -> None:
    index = PrefixIndex(BS, max_blocks=3)
    index.apply(stored([1, 2, 3, 4], IDS[: 4 * BS]))
    assert index.stats.evicted_blocks == 1
    assert index.local_prefix_tokens(IDS) == 0  # block 1 is gone, so nothing after it counts
    assert len(index) == 3


def test_subscriber_endpoint_semantics() -> None:
    # vLLM connects to a plain tcp endpoint: the subscriber binds it.
    assert subscriber_endpoint("tcp://127.0.0.1:5557", "10.0.0.9") == ("tcp://127.0.0.1:5557", True)
    # vLLM binds a wildcard: the subscriber connects to the engine's host.
    assert subscriber_endpoint("tcp://*:5557", "10.0.0.9") == ("tcp://10.0.0.9:5557", False)
    assert subscriber_endpoint("tcp://*:5557", "::1") == ("tcp://[::1]:5557", False)
    assert subscriber_endpoint("ipc:///tmp/kv", "h") == ("ipc:///tmp/kv", False)


# -- the subscriber, on real sockets ---------------------------------------------------------


async def _until(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _payload(*events: Any) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=list(events)))


async def test_gaps_duplicates_and_restarts() -> None:
    """A raw PUB that binds (``tcp://*:PORT`` in vLLM's terms) and sends chosen sequence
    numbers."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = PrefixIndex(BS)
    sub = KVEventSubscriber(f"tcp://*:{port}", "kv", index, host="127.0.0.1")

    def send(seq: int, *events: Any) -> None:
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), _payload(*events)])

    try:
        await sub.start()
        # Slow joiner: send a harmless batch until the subscription is through.
        while sub.stats.batches == 0:
            send(0, removed(999))
            await asyncio.sleep(0.05)
        await _until(lambda: sub.stats.last_seq == 0)
        send(1, stored([1, 2], IDS[: 2 * BS]))
        send(1, stored([1, 2], IDS[: 2 * BS]))  # a duplicate
        send(3, stored([3], IDS[2 * BS : 3 * BS], parent=2))  # batch 2 lost
        pub.send_multipart([b"other", b"x"])  # another topic: not subscribed
        await _until(lambda: sub.stats.last_seq == 3)
        assert (sub.stats.gaps, sub.stats.missed_batches, sub.stats.unrecovered_gaps) == (1, 1, 1)
        assert sub.stats.duplicates >= 1
        assert index.local_prefix_tokens(IDS) == 3 * BS
        send(0, stored([7], IDS[:BS]))  # a new engine: its sequence starts again
        await _until(lambda: sub.stats.restarts == 1)
        assert index.local_prefix_tokens(IDS) == BS
        pub.send_multipart([b"kv", (1).to_bytes(8, "big"), b"\xc1garbage"])
        await _until(lambda: sub.stats.decode_errors == 1)
        send(2, removed(7))
        await _until(lambda: index.local_prefix_tokens(IDS) == 0)
    finally:
        await sub.aclose()
        pub.close(0)
        ctx.term()


async def test_late_subscriber_bootstraps_and_fills_gaps_from_replay() -> None:
    """The simulator's publisher (vLLM's replay protocol): a subscriber that starts late gets
    the buffered history from the replay socket."""
    port, replay = free_port(), free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay}",
        topic="kv",
    )
    publisher = ZmqEventPublisher(config)
    index = PrefixIndex(BS)
    sub = KVEventSubscriber.from_config(config, index, host="127.0.0.1")
    try:
        publisher.publish([stored([1, 2], IDS[: 2 * BS])])
        publisher.publish([stored([3], IDS[2 * BS : 3 * BS], parent=2)])
        await asyncio.sleep(0.2)  # sent before anyone listens: only the replay has them
        await sub.start()
        await _until(lambda: index.local_prefix_tokens(IDS) == 3 * BS)
        assert sub.stats.replayed_batches == 2 and sub.stats.last_seq == 1
        # Live events follow; a restart of the index from replay is not needed.
        await asyncio.sleep(0.3)
        publisher.publish([removed(3)])
        await _until(lambda: index.local_prefix_tokens(IDS) == 2 * BS)
    finally:
        await sub.aclose()
        publisher.shutdown()


# -- end to end: a real simulator ------------------------------------------------------------


@pytest.mark.e2e
async def test_index_predicts_the_sims_local_hit() -> None:
    """vLLM's non-wildcard endpoint: the sim connects, the subscriber binds. After a request,
    L for the next prompt with the same prefix equals the local hit the sim then reports."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "topic": "kv"}
    index = PrefixIndex(BS)
    sub = KVEventSubscriber(endpoint, "kv", index)
    await sub.start()
    try:
        with start_sim(
            "--block-size", str(BS), "--time-scale", "0",
            "--kv-events-config", json.dumps(config),
        ) as sim:  # fmt: skip
            async with httpx.AsyncClient(trust_env=False, base_url=sim.url, timeout=30) as client:

                async def complete(ids: list[int], salt: str | None = None) -> tuple[int, int]:
                    body: dict[str, Any] = {"prompt": ids, "max_tokens": 2}
                    if salt:
                        body["cache_salt"] = salt
                    before = parse_metrics((await client.get("/metrics")).text)
                    r = await client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    after = parse_metrics((await client.get("/metrics")).text)
                    key = "vllm:prompt_tokens_by_source_total[local_cache_hit]"
                    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                    return int(after[key] - before[key]), cached

                history = list(range(500, 500 + 10 * BS + 3))
                await _until(lambda: sub._monitor is not None)
                # The sim connects at start-up and gets the subscription right away.
                assert await complete(history) == (0, 0)
                for turn in range(1, 4):
                    nxt = [*history, *range(9000 + turn * 10, 9000 + turn * 10 + BS + 1)]
                    # Events are asynchronous: wait until the last turn's prompt blocks are in.
                    held = len(history) // BS * BS
                    await _until(lambda nxt=nxt, held=held: index.local_prefix_tokens(nxt) >= held)
                    predicted = index.local_prefix_tokens(nxt)
                    local, cached = await complete(nxt)
                    assert predicted == local == cached > 0, (turn, predicted, local)
                    history = nxt
                # Another salt never counts, although the sim holds the same tokens.
                assert index.local_prefix_tokens(history, "tenant-x") == 0
                assert await complete(history, "tenant-x") == (0, 0)
                await _until(lambda: index.local_prefix_tokens(history, "tenant-x") > 0)
                assert (await client.post("/reset_prefix_cache")).status_code == 200
                await _until(lambda: index.stats.clears == 1)
                assert index.local_prefix_tokens(history) == 0
                assert sub.stats.gaps == 0 and sub.stats.decode_errors == 0
    finally:
        await sub.aclose()


@pytest.mark.e2e
async def test_wildcard_port_zero_discovered_from_kv_event_sources() -> None:
    """``tcp://*:0``: the sim binds an OS port; the router reads it from ``GET
    /kv_event_sources`` and connects (``bind=False``: the reported address has no wildcard)."""
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "topic": "kv"}
    with start_sim(
        "--block-size", str(BS), "--time-scale", "0", "--kv-events-config", json.dumps(config)
    ) as sim:  # fmt: skip
        async with httpx.AsyncClient(trust_env=False, base_url=sim.url, timeout=30) as client:
            source = KVEventsConfig.model_validate(
                (await client.get("/kv_event_sources")).json()["0"]
            )
            index = PrefixIndex(BS)
            async with KVEventSubscriber.from_config(source, index, bind=False) as sub:
                # A SUB that connects joins late (ZMQ slow joiner) and a cached prompt is not
                # stored again: send new prompts until one is heard.
                for attempt in range(50):
                    ids = list(range(300 + attempt * 100, 300 + attempt * 100 + 6 * BS))
                    r = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1})
                    assert r.status_code == 200
                    await asyncio.sleep(0.1)
                    if sub.stats.batches:
                        break
                await _until(lambda: index.local_prefix_tokens([*ids, 1]) == 6 * BS)
