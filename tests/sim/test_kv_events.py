"""The simulator's KV cache events: vLLM 0.33's wire format, from a real ``agentkv sim`` process.

A ZMQ subscriber on 127.0.0.1 receives ``[topic, seq, payload]`` frames and decodes them with
the structs of ``vllm/distributed/kv_events.py`` (copied in :mod:`agentkv.protocol.kv_events`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from agentkv.protocol.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    external_block_hash,
)
from agentkv.sim.blocks import BlockPool, block_hashes
from agentkv.sim.kv_events import ZmqEventPublisher
from agentkv.sim.launch import SimProcess, free_port, start_sim

pytestmark = [pytest.mark.e2e]

BS = 4

# vLLM 0.33.0's own structs (vllm/distributed/kv_events.py, exec'd from the wheel) encode this
# batch to exactly these bytes; msgspec.msgpack.Encoder is what ZmqEventPublisher uses.
VLLM_GOLDEN = bytes.fromhex(
    "93cb3ff800000000000094de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865"
    "7392cfffffffffffffffff05b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401"
    "020304aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e61"
    "6d65c0aa65787472615f6b6579739291a473616c74c0a967726f75705f69647800de000aa474797065ab42"
    "6c6f636b53746f726564ac626c6f636b5f6861736865739107b1706172656e745f626c6f636b5f68617368"
    "05a9746f6b656e5f696473920909aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3"
    "475055a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f6964780084a4747970"
    "65ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739105a66d656469756da3475055a96772"
    "6f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400"
)


def test_structs_encode_like_vllm() -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(
                block_hashes=[2**64 - 1, 5],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=2,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[("salt",), None],
                group_idx=0,
            ),
            BlockStored(
                block_hashes=[7],
                parent_block_hash=5,
                token_ids=[9, 9],
                block_size=2,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None],
                group_idx=0,
            ),
            BlockRemoved(block_hashes=[5], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    assert msgspec.msgpack.encode(batch) == VLLM_GOLDEN
    assert msgspec.msgpack.decode(VLLM_GOLDEN, type=KVEventBatch) == batch
    raw = msgspec.msgpack.decode(VLLM_GOLDEN)
    assert raw[0] == 1.5 and raw[2] == 0  # array_like: [ts, events, data_parallel_rank]
    assert raw[1][0]["type"] == "BlockStored"  # tagged maps
    assert "kv_cache_spec_kind" not in raw[1][0]  # omit_defaults


def test_config_defaults_like_vllm() -> None:
    assert KVEventsConfig().publisher == "null"
    on = KVEventsConfig(enable_kv_cache_events=True)
    assert on.publisher == "zmq" and on.endpoint == "tcp://*:5557" and on.active
    assert (on.buffer_steps, on.hwm, on.max_queue_size, on.topic) == (10_000, 100_000, 100_000, "")
    with pytest.raises(ValueError):
        KVEventsConfig.model_validate({"enable_kv_cache_events": True, "endpont": "x"})


def test_pool_events() -> None:
    pool = BlockPool(4, BS, kv_events=True)
    ids = list(range(100, 100 + 3 * BS))
    hashes = block_hashes(ids, BS, cache_salt="s")
    blocks = pool.allocate(3)
    pool.cache_full_blocks(blocks[:1], hashes[:1], ids, "s")
    pool.cache_full_blocks(blocks, hashes, ids, "s")  # block 0 already cached: one new run
    first, second = pool.take_events()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.parent_block_hash is None and first.extra_keys == [("s",)]
    assert first.token_ids == ids[:BS]
    assert second.parent_block_hash == external_block_hash(hashes[0])
    assert second.block_hashes == [external_block_hash(h) for h in hashes[1:]]
    assert second.token_ids == ids[BS:] and second.extra_keys == [None, None]
    pool.free(blocks)
    pool.allocate(1)  # evicts the tail block first
    (removed,) = pool.take_events()
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [external_block_hash(hashes[2])]
    pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]


# -- a real process --------------------------------------------------------------------------


class Subscriber:
    """A plain zmq subscriber, as a vLLM consumer writes one: SUB when it connects; XSUB
    sending its own subscription when it binds (a bound SUB's subscription never reaches a
    connecting PUB with libzmq 4.3.5 here; see agentkv.router.kv_subscriber)."""

    def __init__(self, address: str, *, bind: bool, topic: bytes) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XSUB if bind else zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.monitor: zmq.Socket[bytes] | None = None
        if bind:
            self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self.sock.bind(address)
        else:
            self.sock.setsockopt(zmq.SUBSCRIBE, topic)
            self.sock.connect(address)
        self.topic = topic
        self.seqs: list[int] = []

    def wait_connected(self, timeout_s: float = 10.0) -> None:
        """(bound) Wait for the publisher's connection, then subscribe on it."""
        assert self.monitor is not None
        assert self.monitor.poll(timeout_s * 1000), "the publisher never connected"
        self.monitor.recv_multipart()
        self.sock.send(b"\x01" + self.topic)
        time.sleep(0.1)

    def events(
        self, timeout_s: float = 5.0, *, until: type | None = None, root: bool = False
    ) -> list[Any]:
        """Decode batches until one holds an ``until`` event (a root ``BlockStored`` with
        ``root``), or the timeout."""
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.sock.poll(50):
                if until is None and out:
                    return out
                continue
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == self.topic and len(seq) == 8
            self.seqs.append(int.from_bytes(seq, "big"))
            batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
            assert batch.data_parallel_rank == 0 and batch.ts > 0
            out.extend(batch.events)
            if until is not None and any(
                isinstance(e, until) and (not root or e.parent_block_hash is None) for e in out
            ):
                return out
        return out

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(0)
        self.sock.close(0)
        self.ctx.term()


def _chat(client: httpx.Client, sim: SimProcess, text: str, **extra: Any) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 3,
        "return_token_ids": True,
        **extra,
    }
    r = client.post(f"{sim.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


@pytest.fixture
def connected_sim() -> Iterator[tuple[SimProcess, Subscriber]]:
    """A sim whose endpoint is not a wildcard: it connects, the subscriber binds."""
    port = free_port()
    sub = Subscriber(f"tcp://127.0.0.1:{port}", bind=True, topic=b"kv")
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "topic": "kv",
    }
    try:
        with start_sim(
            "--block-size", str(BS), "--num-blocks", "40", "--time-scale", "0",
            "--kv-events-config", json.dumps(config),
        ) as sim:  # fmt: skip
            sub.wait_connected()
            yield sim, sub
    finally:
        sub.close()


def test_sim_publishes_stored_removed_cleared(connected_sim: tuple[SimProcess, Subscriber]) -> None:
    sim, sub = connected_sim
    with httpx.Client(trust_env=False) as client:
        sources = client.get(f"{sim.url}/kv_event_sources").json()
        assert sources["0"]["endpoint"].startswith("tcp://127.0.0.1:")
        assert sources["0"]["topic"] == "kv" and sources["0"]["enable_kv_cache_events"] is True

        data = _chat(client, sim, "hello there, how are the kv events today?")
        prompt = data["prompt_token_ids"]
        events = sub.events(until=BlockStored, root=True)
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert stored, events
        first = stored[0]
        assert first.parent_block_hash is None and first.block_size == BS
        assert first.medium == "GPU" and first.lora_id is None and first.group_idx == 0
        n_full = len(prompt) // BS
        assert first.token_ids == prompt[: n_full * BS]
        want = [external_block_hash(h) for h in block_hashes(prompt, BS)]
        assert first.block_hashes == want
        assert first.extra_keys == [None] * n_full
        # Every stored run chains onto a block stored before it.
        seen = set(first.block_hashes)
        for ev in stored[1:]:
            assert ev.parent_block_hash in seen
            seen.update(ev.block_hashes)

        # A salted prompt: the salt is in the first block's extra keys.
        _chat(client, sim, "a salted request, long enough to fill blocks", cache_salt="t1")
        later = sub.events(until=BlockStored, root=True)
        salted = [e for e in later if isinstance(e, BlockStored) and e.parent_block_hash is None]
        assert salted[0].extra_keys is not None and salted[0].extra_keys[0] == ("t1",)

        # Fill the 39-block pool with other prompts: cached blocks get evicted.
        for i in range(12):
            _chat(client, sim, f"filler {i} " + "lorem ipsum dolor sit amet " * 3)
        later = sub.events(timeout_s=5.0, until=BlockRemoved)
        removed = [h for e in later if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert removed and set(removed) & (seen | set(salted[0].block_hashes))

        assert client.post(f"{sim.url}/reset_prefix_cache").status_code == 200
        assert any(isinstance(e, AllBlocksCleared) for e in sub.events(until=AllBlocksCleared))
    assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))


def test_sim_binds_wildcard_and_replays() -> None:
    """``tcp://*:0``: the sim binds (an OS port, reported by /kv_event_sources); the replay
    ROUTER answers from a start sequence number, then the end marker."""
    config = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://*:0",
        "replay_endpoint": "tcp://*:0",
    }
    with (
        start_sim(
            "--block-size",
            str(BS),
            "--time-scale",
            "0",
            "--kv-events-config",
            json.dumps(config),
        ) as sim,  # fmt: skip
        httpx.Client(trust_env=False) as client,
    ):
        sources = client.get(f"{sim.url}/kv_event_sources").json()
        source = KVEventsConfig.model_validate(sources["0"])
        assert source.publisher == "zmq" and source.endpoint.startswith("tcp://127.0.0.1:")
        assert source.replay_endpoint is not None and source.replay_endpoint != source.endpoint
        sub = Subscriber(source.endpoint, bind=False, topic=b"")
        try:
            time.sleep(0.3)
            _chat(client, sim, "one request whose events a late joiner replays")
            assert sub.events(until=BlockStored)
        finally:
            sub.close()
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(source.replay_endpoint)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            replayed: list[int] = []
            while True:
                assert dealer.poll(5000)
                empty, topic, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == END_SEQ:
                    assert (topic, payload) == (b"", b"")
                    break
                replayed.append(int.from_bytes(seq, "big"))
                msgspec.msgpack.decode(payload, type=KVEventBatch)
            assert replayed and replayed[0] == 0
        finally:
            dealer.close(0)
            ctx.term()


def test_sim_rejects_bad_config() -> None:
    bad = '{"enable_kv_cache_events": true, "endpont": 1}'
    with pytest.raises(RuntimeError, match="exited"), start_sim("--kv-events-config", bad):
        pass


def test_sources_empty_without_events() -> None:
    with start_sim("--time-scale", "0") as sim, httpx.Client(trust_env=False) as client:
        assert client.get(f"{sim.url}/kv_event_sources").json() == {}


def test_publish_never_blocks_the_engine() -> None:
    """A full queue drops batches (counted) instead of waiting, unlike vLLM's ``put``."""
    port = free_port()  # nobody listens: the PUB socket connects and keeps retrying
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}", max_queue_size=1
    )
    publisher = ZmqEventPublisher(config)
    try:
        start = time.perf_counter()
        for _ in range(2000):
            publisher.publish([AllBlocksCleared()])
        assert time.perf_counter() - start < 1.0
        assert publisher.dropped > 0
        assert publisher.dropped + publisher.sent <= 2000
    finally:
        publisher.shutdown()
