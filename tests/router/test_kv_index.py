"""The router's view of P's prefix cache from KV events: index math (salts, removals, gaps) and a
subscriber against a real ``agentkv sim`` process (L equals the simulator's own local hit)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio

from agentkv.protocol.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
)
from agentkv.protocol.promtext import parse_metrics
from agentkv.router.kv_index import PrefixIndex
from agentkv.router.kv_subscriber import KVEventSubscriber, subscriber_endpoint
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
    index = PrefixIndex(BS, in_sync=True)
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
    index = PrefixIndex(BS, in_sync=True)
    index.apply(stored([3], IDS[2 * BS : 3 * BS], parent=2))  # arrives before its parent
    assert index.local_prefix_tokens(IDS) == 0
    index.apply(stored([1], IDS[:BS]))
    index.apply(stored([2], IDS[BS : 2 * BS], parent=1))
    assert index.local_prefix_tokens(IDS) == 3 * BS


def test_salts_never_mix() -> None:
    index = PrefixIndex(BS, in_sync=True)
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
    index = PrefixIndex(BS, in_sync=True)
    index.apply(stored([1, 2], IDS[: 2 * BS], extra=None))  # no extra_keys: salt unknown
    assert index.local_prefix_tokens(IDS) == 0
    assert index.local_prefix_tokens(IDS, "x") == 0
    trusting = PrefixIndex(BS, missing_salt="unsalted", in_sync=True)
    trusting.apply(stored([1, 2], IDS[: 2 * BS], extra=None))
    assert trusting.local_prefix_tokens(IDS) == 2 * BS
    assert trusting.local_prefix_tokens(IDS, "x") == 0
    # A multimodal block (an (mm_identifier, offset) pair): tokens do not decide its KV.
    mm = PrefixIndex(BS, in_sync=True)
    mm.apply(stored([1, 2, 3], IDS[: 3 * BS], extra=[None, (("img", 0),), None]))
    assert mm.local_prefix_tokens(IDS) == BS
    assert mm.stats.uncountable_blocks == 2
    # LoRA: its own namespace.
    lora = PrefixIndex(BS, in_sync=True)
    lora.apply(stored([1], IDS[:BS], extra=[("ad1",)], lora_name="ad1", lora_id=1))
    assert lora.local_prefix_tokens(IDS) == 0
    assert lora.local_prefix_tokens(IDS, lora_name="ad1") == BS


def test_removal_clear_and_foreign_events() -> None:
    index = PrefixIndex(BS, in_sync=True)
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
    index = PrefixIndex(BS, max_blocks=3, in_sync=True)
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


# -- the subscriber, on real sockets: the sync state ----------------------------------------


async def _until(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _payload(*events: Any, rank: int | None = None) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(
        KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=rank)
    )


class RawPub:
    """A PUB socket that sends chosen sequence numbers (an engine, or a foreign process)."""

    def __init__(self, ctx: zmq.Context[Any], *, bind_port: int | None = None) -> None:
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if bind_port is not None:
            self.sock.bind(f"tcp://127.0.0.1:{bind_port}")

    def send(self, seq: int, *events: Any, rank: int | None = None, topic: bytes = b"kv") -> None:
        self.sock.send_multipart([topic, seq.to_bytes(8, "big"), _payload(*events, rank=rank)])

    def close(self) -> None:
        self.sock.close(0)


async def test_sync_from_the_engines_first_batch_lost_by_gaps_and_restarts() -> None:
    """No replay socket: the index answers only from the engine's first batch on, stops at a
    gap, is back after an ``AllBlocksCleared``, and starts again from a new engine's sequence
    0. The engine binds (``tcp://*:PORT``): the subscriber connects."""
    ctx: zmq.Context[Any] = zmq.Context()
    port = free_port()
    pub = RawPub(ctx, bind_port=port)
    index = PrefixIndex(BS)
    sub = KVEventSubscriber(f"tcp://*:{port}", "kv", index, host="127.0.0.1")
    try:
        await sub.start()
        assert index.local_prefix_tokens(IDS) is None  # what the engine holds: unknown
        # Slow joiner: send a harmless batch 0 until the subscription is through.
        while sub.stats.batches == 0:
            pub.send(0, removed(999))
            await asyncio.sleep(0.05)
        await _until(lambda: index.in_sync)
        assert index.local_prefix_tokens(IDS) == 0  # known empty, not unknown
        pub.send(1, stored([1, 2], IDS[: 2 * BS]))
        pub.send(1, stored([1, 2], IDS[: 2 * BS]))  # a duplicate
        pub.send(2, stored([5], IDS[:BS]), rank=1)  # another DP rank's batch: not ours
        pub.sock.send_multipart([b"other", b"x"])  # another topic: not subscribed
        await _until(lambda: sub.stats.foreign_batches == 1)
        assert index.local_prefix_tokens(IDS) == 2 * BS
        pub.send(3, stored([3], IDS[2 * BS : 3 * BS], parent=2))  # batch 2 lost
        await _until(lambda: sub.stats.last_seq == 3)
        assert (sub.stats.gaps, sub.stats.missed_batches, sub.stats.unrecovered_gaps) == (1, 1, 1)
        assert sub.stats.duplicates >= 1
        assert not index.in_sync and index.local_prefix_tokens(IDS) is None
        pub.send(4, stored([1, 2], IDS[: 2 * BS]))  # contiguous again, but what was lost is lost
        await _until(lambda: sub.stats.last_seq == 4)
        assert index.local_prefix_tokens(IDS) is None
        pub.send(5, AllBlocksCleared(), stored([1], IDS[:BS]))  # the engine's cache was reset
        await _until(lambda: index.in_sync)
        assert index.local_prefix_tokens(IDS) == BS
        pub.send(0, stored([7, 8], IDS[: 2 * BS]))  # a new engine: its sequence starts again
        await _until(lambda: sub.stats.restarts == 1)
        assert index.in_sync and index.local_prefix_tokens(IDS) == 2 * BS
        pub.sock.send_multipart([b"kv", (1).to_bytes(8, "big"), b"\xc1garbage"])
        await _until(lambda: sub.stats.decode_errors == 1)
        pub.send(2, removed(8))  # batch 1 was garbage: a gap
        await _until(lambda: sub.stats.last_seq == 2)
        assert index.local_prefix_tokens(IDS) is None
        assert (sub.stats.syncs, sub.stats.desyncs) == (3, 3)
    finally:
        await sub.aclose()
        pub.close()
        ctx.term()


async def test_losing_the_engine_clears_the_index() -> None:
    """The engine's publisher goes away (a restart): the index is cleared and out of sync at
    once, before the new engine sends anything; a later batch of the new engine that is not
    its first does not bring it back."""
    ctx: zmq.Context[Any] = zmq.Context()
    port = free_port()
    pub = RawPub(ctx, bind_port=port)
    index = PrefixIndex(BS)
    sub = KVEventSubscriber(f"tcp://*:{port}", "kv", index, host="127.0.0.1", heartbeat_s=0.2)
    try:
        await sub.start()
        while not index.in_sync:
            pub.send(0, stored([1, 2], IDS[: 2 * BS]))
            await asyncio.sleep(0.05)
        assert index.local_prefix_tokens(IDS) == 2 * BS
        pub.close()
        await _until(lambda: sub.stats.disconnects == 1)
        assert index.local_prefix_tokens(IDS) is None and len(index) == 0
        pub = RawPub(ctx, bind_port=port)  # the engine again, on the same port
        await _until(lambda: sub.stats.connects == 2)
        for _ in range(5):  # whatever the join delay, none of these is a first batch
            pub.send(7, stored([1, 2], IDS[: 2 * BS]))
            await asyncio.sleep(0.05)
        await _until(lambda: sub.stats.last_seq == 7)
        assert index.local_prefix_tokens(IDS) is None
    finally:
        await sub.aclose()
        pub.close()
        ctx.term()


@dataclass
class _Replaying:
    """An engine's publisher with a replay socket, and a subscriber's index of it."""

    config: KVEventsConfig
    publisher: ZmqEventPublisher
    index: PrefixIndex
    sub: KVEventSubscriber


@contextlib.asynccontextmanager
async def _replaying(buffer_steps: int = 10_000, **sub_kw: Any) -> AsyncIterator[_Replaying]:
    """vLLM's config with a replay socket, on free ports (the engine binds both), its publisher
    and a subscriber (not started) of it; both closed on the way out (``publisher`` may be
    replaced by a restarted one)."""
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{free_port()}",
        replay_endpoint=f"tcp://*:{free_port()}",
        topic="kv",
        buffer_steps=buffer_steps,
    )
    index = PrefixIndex(BS)
    engine = _Replaying(
        config,
        ZmqEventPublisher(config),
        index,
        KVEventSubscriber.from_config(config, index, host="127.0.0.1", **sub_kw),
    )
    try:
        yield engine
    finally:
        await engine.sub.aclose()
        engine.publisher.shutdown()


async def test_late_subscriber_bootstraps_and_fills_gaps_from_replay() -> None:
    """The simulator's publisher (vLLM's replay protocol): a subscriber that starts late (a
    router restart) gets the engine's whole history from the replay socket: in sync at once."""
    async with _replaying() as e:
        e.publisher.publish([stored([1, 2], IDS[: 2 * BS])])
        e.publisher.publish([stored([3], IDS[2 * BS : 3 * BS], parent=2)])
        await asyncio.sleep(0.2)  # sent before anyone listens: only the replay has them
        await e.sub.start()
        await _until(lambda: e.index.local_prefix_tokens(IDS) == 3 * BS)
        assert e.sub.stats.replayed_batches == 2 and e.sub.stats.last_seq == 1
        assert e.index.in_sync
        # Live events follow; a restart of the index from replay is not needed.
        await asyncio.sleep(0.3)
        e.publisher.publish([removed(3)])
        await _until(lambda: e.index.local_prefix_tokens(IDS) == 2 * BS)
        assert e.index.in_sync


@pytest.mark.parametrize("ends", [True, False], ids=["replay-ends", "replay-cut-short"])
async def test_an_index_is_in_sync_only_when_its_replay_has_ended(ends: bool) -> None:
    """A router restarted next to a busy engine: while the replay of the engine's history is
    still arriving the index holds only its start, so it says "unknown", never a short L (the
    chaos test caught a receipt of L=80 while P hit 336). A replay cut short leaves it out of
    sync and empty."""
    pub_port, replay_port = free_port(), free_port()
    pub = RawPub(zmq.Context.instance(), bind_port=pub_port)
    replay = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.bind(f"tcp://127.0.0.1:{replay_port}")
    batches = [
        _payload(stored([1, 2], IDS[: 2 * BS])),
        _payload(stored([3, 4], IDS[2 * BS : 4 * BS], parent=2)),
    ]

    async def serve() -> None:
        client, _, start = await replay.recv_multipart()
        assert int.from_bytes(start, "big") == 0
        await replay.send_multipart([client, b"", b"kv", (0).to_bytes(8, "big"), batches[0]])
        await asyncio.sleep(0.4)  # the rest of a long history still on its way
        if ends:
            await replay.send_multipart([client, b"", b"kv", (1).to_bytes(8, "big"), batches[1]])
            await replay.send_multipart([client, b"", b"", END_SEQ, b""])

    index = PrefixIndex(BS)
    sub = KVEventSubscriber(
        f"tcp://*:{pub_port}", "kv", index, replay_endpoint=f"tcp://*:{replay_port}"
    )
    server = asyncio.create_task(serve())
    try:
        await sub.start()
        await _until(lambda: sub.stats.replayed_batches == 1)
        assert not index.in_sync and index.local_prefix_tokens(IDS) is None
        await server
        if ends:
            await _until(lambda: index.in_sync)
            assert index.local_prefix_tokens(IDS) == 4 * BS
        else:
            await _until(lambda: "did not reach its end" in sub.stats.sync_state)
            assert not index.in_sync and len(index) == 0
    finally:
        server.cancel()
        await sub.aclose()
        replay.close(0)
        pub.close()


async def test_an_empty_replay_buffer_proves_an_empty_cache() -> None:
    """An engine that has published nothing holds nothing: L is 0 (not unknown) before its
    first batch; a restarted engine on the same ports is the same case, after a disconnect."""
    async with _replaying(heartbeat_s=0.2) as e:
        await e.sub.start()
        await _until(lambda: e.index.in_sync)
        assert e.index.local_prefix_tokens(IDS) == 0
        await _until(lambda: e.sub.stats.connects == 1)
        await asyncio.sleep(0.2)
        e.publisher.publish([stored([1, 2, 3], IDS[: 3 * BS])])
        await _until(lambda: e.index.local_prefix_tokens(IDS) == 3 * BS)
        e.publisher.shutdown()  # the engine restarts: its cache is gone
        await _until(lambda: e.sub.stats.disconnects == 1)
        assert e.index.local_prefix_tokens(IDS) is None
        e.publisher = ZmqEventPublisher(e.config)
        await _until(lambda: e.sub.stats.connects == 2)
        await _until(lambda: e.index.in_sync)
        assert e.index.local_prefix_tokens(IDS) == 0


async def test_a_wrapped_replay_buffer_is_not_a_history() -> None:
    """The buffer lost the engine's first batches: what it holds from before is unknown, until
    the engine's prefix cache is reset."""
    async with _replaying(buffer_steps=2) as e:
        e.publisher.publish([stored([1], IDS[:BS])])  # seq 0 leaves the buffer
        e.publisher.publish([stored([2], IDS[BS : 2 * BS], parent=1)])
        e.publisher.publish([stored([3], IDS[2 * BS : 3 * BS], parent=2)])
        await asyncio.sleep(0.2)
        await e.sub.start()
        await _until(lambda: e.sub.stats.replayed_batches == 2)
        assert not e.index.in_sync and e.index.local_prefix_tokens(IDS) is None
        await asyncio.sleep(0.2)
        e.publisher.publish([AllBlocksCleared()])
        await _until(lambda: e.index.in_sync)
        assert e.index.local_prefix_tokens(IDS) == 0


async def test_a_foreign_publisher_on_a_bound_subscriber_changes_nothing() -> None:
    """The engine connects (a plain ``tcp://127.0.0.1:PORT``) so the subscriber binds, and a
    foreign process connects too and publishes blocks the engine never stored. Without a replay
    socket the index goes out of sync while two publishers are connected (and stays out: what
    the engine sent meanwhile is unknown); with one it stays in sync with what the engine's own
    replay socket says, and the foreign blocks never count."""
    ctx: zmq.Context[Any] = zmq.Context()
    forged = list(range(7000, 7000 + 4 * BS))

    async def scenario(replay: bool) -> tuple[PrefixIndex, KVEventSubscriber]:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        config = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=endpoint,
            replay_endpoint=f"tcp://*:{free_port()}" if replay else None,
            topic="kv",
        )
        index = PrefixIndex(BS)
        sub = KVEventSubscriber.from_config(config, index, host="127.0.0.1")
        await sub.start()
        publisher = ZmqEventPublisher(config)
        foreign = RawPub(ctx)
        try:
            await _until(lambda: sub.stats.connects == 1)
            await asyncio.sleep(0.2)  # the subscription reaches the engine
            publisher.publish([stored([1, 2], IDS[: 2 * BS])])
            await _until(lambda: index.local_prefix_tokens(IDS) == 2 * BS)
            foreign.sock.connect(endpoint)
            await _until(lambda: sub.stats.connects == 2)
            await asyncio.sleep(0.2)
            for seq in (1, 2, 0):
                foreign.send(seq, stored([91, 92, 93], forged[: 3 * BS]))
            publisher.publish([stored([3], IDS[2 * BS : 3 * BS], parent=2)])
            await _until(lambda: sub.stats.unattributed_batches >= 4)
            assert index.local_prefix_tokens(forged) in (None, 0)
            if replay:
                await _until(lambda: index.local_prefix_tokens(IDS) == 3 * BS)
            foreign.close()
            await _until(lambda: sub.stats.disconnects == 1)
            await asyncio.sleep(0.2)
            publisher.publish([stored([4], IDS[3 * BS : 4 * BS], parent=3)])
            await _until(lambda: sub.stats.last_seq == 2)
            assert index.local_prefix_tokens(forged) in (None, 0)
            return index, sub
        finally:
            await sub.aclose()
            publisher.shutdown()
            foreign.close()

    try:
        index, sub = await scenario(replay=False)
        assert index.local_prefix_tokens(IDS) is None and not index.in_sync
        index, sub = await scenario(replay=True)
        assert index.in_sync and index.local_prefix_tokens(IDS) == 4 * BS
        assert sub.stats.replayed_batches >= 3
    finally:
        ctx.term()


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
                await _until(lambda: sub.stats.connects == 1)
                # The sim connects at start-up and gets the subscription right away. No replay
                # socket: what it holds is unknown until its first batch.
                assert index.local_prefix_tokens(history) is None
                assert await complete(history) == (0, 0)
                for turn in range(1, 4):
                    nxt = [*history, *range(9000 + turn * 10, 9000 + turn * 10 + BS + 1)]
                    # Events are asynchronous: wait until the last turn's prompt blocks are in.
                    held = len(history) // BS * BS
                    await _until(
                        lambda nxt=nxt, held=held: (index.local_prefix_tokens(nxt) or 0) >= held
                    )
                    predicted = index.local_prefix_tokens(nxt)
                    local, cached = await complete(nxt)
                    assert predicted == local == cached > 0, (turn, predicted, local)
                    history = nxt
                # Another salt never counts, although the sim holds the same tokens.
                assert index.local_prefix_tokens(history, "tenant-x") == 0
                assert await complete(history, "tenant-x") == (0, 0)
                await _until(lambda: (index.local_prefix_tokens(history, "tenant-x") or 0) > 0)
                assert (await client.post("/reset_prefix_cache")).status_code == 200
                await _until(lambda: index.stats.clears == 1)
                assert index.local_prefix_tokens(history) == 0
                assert sub.stats.gaps == 0 and sub.stats.decode_errors == 0
                assert index.in_sync and sub.stats.desyncs == 0
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
            held = list(range(100, 100 + 6 * BS))
            r = await client.post("/v1/completions", json={"prompt": held, "max_tokens": 1})
            assert r.status_code == 200
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
                # Joined late without a replay socket: the sim holds ``held`` and the index
                # cannot know it, so it does not answer (rather than answer 0).
                assert sub.stats.last_seq and not index.in_sync
                assert index.local_prefix_tokens([*held, 1]) is None
                # A prefix-cache reset makes the sim's cache known again (empty).
                assert (await client.post("/reset_prefix_cache")).status_code == 200
                await _until(lambda: index.in_sync)
                assert index.local_prefix_tokens([*held, 1]) == 0
                r = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1})
                await _until(lambda: index.local_prefix_tokens([*ids, 1]) == 6 * BS)
