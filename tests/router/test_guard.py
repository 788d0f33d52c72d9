"""GuardedStore on a real redis-server: an outage (the server stopped) degrades to misses behind
the breaker and recovers when the server is back; a bug (a wrong argument reaching the store) is
not an outage: it propagates and leaves the breaker alone."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from agentkv.router.guard import GuardedStore
from agentkv.router.redis_store import RedisStore
from agentkv.router.store import StoredHandle, StoreKey
from tests._support.clock import FakeClock
from tests._support.redis_server import _INSTALL, _unavailable, start_redis

pytestmark = pytest.mark.anyio

K: StoreKey = ("tenant-a", "conv-1")


def handle() -> StoredHandle:
    """A D handle shaped like vLLM 0.33's (NixlConnector) response kv_transfer_params."""
    return StoredHandle(
        params={
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[10, 11, 12]],
            "remote_engine_id": "engine-0",
            "remote_request_id": "req-0",
            "remote_host": "10.0.0.2",
            "remote_port": 5600,
            "remote_num_tokens": 40,
            "tp_size": 1,
        },
        block_hashes=b"\x01" * 16 + b"\x02" * 16,
        tail_tokens=[7, 8],
        num_tokens=40,
        block_size=16,
        epoch=0,
        decode_url="http://10.0.0.2:8200",
    )


class Harness:
    def __init__(self, binary: str, workdir: Path, server: Any) -> None:
        self.binary, self.workdir, self.server = binary, workdir, server
        self.port: int = server.port
        self.clock = FakeClock()
        self.errors: list[str] = []
        self.store = GuardedStore(
            RedisStore(f"redis://127.0.0.1:{self.port}/0", prefix=f"g-{uuid.uuid4().hex}:"),
            failures_to_open=2,
            open_s=5.0,
            on_error=self.errors.append,
            clock=self.clock,
        )

    def stop(self) -> None:
        self.server.stop(5)

    def restart(self) -> None:
        self.server = start_redis(self.binary, self.workdir, port=self.port, timeout_s=20)


@pytest.fixture
async def h(tmp_path: Path, anyio_backend: str) -> AsyncIterator[Harness]:
    """A redis-server of this test's own (it is stopped and restarted) and a guarded store on it."""
    binary = shutil.which("redis-server")
    if binary is None:
        _unavailable(f"redis-server is not installed: {_INSTALL}")
    assert binary is not None
    harness = Harness(binary, tmp_path, start_redis(binary, tmp_path, timeout_s=20))
    try:
        yield harness
    finally:
        await harness.store.aclose()
        harness.stop()


async def test_a_redis_outage_is_a_miss_and_the_store_comes_back(h: Harness) -> None:
    assert await h.store.put(K, handle(), 60) == []
    assert len(await h.store.candidates(K)) == 1
    h.stop()
    # reads miss, a write comes back to be released, the metric callback sees each op
    assert await h.store.candidates(K) == []
    assert await h.store.put(K, handle(), 60) == [handle()]
    assert h.errors == ["candidates", "put"] and not h.store.healthy
    # the breaker is open: the store is not called at all
    assert await h.store.take(K) is None
    assert h.errors[-1] == "open"
    h.restart()  # an empty server: the handles were in memory only
    h.clock.now += 5.0  # half-open: one call goes through, and succeeds
    assert await h.store.put(K, handle(), 60) == []
    assert h.store.healthy
    assert len(await h.store.candidates(K)) == 1


async def test_a_programming_error_is_not_swallowed(h: Harness) -> None:
    # a wrong argument reaching the real store: a bug in the router, not a store outage
    with pytest.raises(AttributeError):
        await h.store.put(K, cast(StoredHandle, object()), 60)
    with pytest.raises(TypeError):
        await h.store.take(cast(StoreKey, None))
    assert h.errors == [] and h.store.healthy
    assert await h.store.put(K, handle(), 60) == []  # the store itself is fine
