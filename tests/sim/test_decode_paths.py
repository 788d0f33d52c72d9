"""Real simulator processes on loopback: a turn that runs on D itself (no remote prefill), its
interference with D's running streams, and D's CPU tier (docs/paths.md)."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv.protocol import (
    HEADER_SIM_CACHED_TOKENS,
    HEADER_SIM_COMPUTED_TOKENS,
    HEADER_SIM_CPU_TOKENS,
)
from agentkv.protocol.promtext import parse_metrics
from agentkv.sim.launch import SimProcess, start_sims

pytestmark = pytest.mark.e2e

BS = 16
# A non-empty ``kv_transfer_params`` that asks for no transfer: vLLM 0.33 treats the request as a
# D request and returns D's handle at its end (pull_scheduler.request_finished).
KEEP = {"do_remote_prefill": False, "do_remote_decode": False}


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 60000) for _ in range(n)]


def complete(
    client: httpx.Client, sim: SimProcess, prompt: list[int], **body: Any
) -> httpx.Response:
    r = client.post(f"{sim.url}/v1/completions", json={"prompt": prompt, **body})
    assert r.status_code == 200, r.text
    return r


def metrics(client: httpx.Client, sim: SimProcess) -> dict[str, float]:
    return parse_metrics(client.get(f"{sim.url}/metrics").text)


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def by_source(source: str) -> str:
    return f"vllm:prompt_tokens_by_source_total[{source}]"


def cached_by_source(source: str) -> str:
    return f"vllm:prompt_tokens_cached_by_source_total[{source}]"


def series(name: str) -> str:
    return name


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    """An HTTP client for the simulators (loopback: no proxy from the environment)."""
    with httpx.Client(timeout=30, trust_env=False) as c:
        yield c


@pytest.fixture(scope="module")
def pd() -> Iterator[tuple[SimProcess, SimProcess]]:
    common = ["--time-scale", "0", "--block-size", str(BS)]
    p, d = start_sims([["--role", "prefill", *common], ["--role", "decode", *common]])
    try:
        yield p, d
    finally:
        assert p.stop() in (0, -signal.SIGTERM) and d.stop() in (0, -signal.SIGTERM)


def test_a_turn_sent_straight_to_d_is_prefilled_there_from_its_prefix_cache(
    pd: tuple[SimProcess, SimProcess], client: httpx.Client
) -> None:
    p, d = pd
    first = ids(600, 1)
    pr = complete(client, p, first, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    dr = complete(
        client,
        d,
        first,
        max_tokens=12,
        ignore_eos=True,
        return_token_ids=True,
        kv_transfer_params=pr.json()["kv_transfer_params"],
    )
    out = dr.json()["choices"][0]["token_ids"]
    assert dr.json()["kv_transfer_params"]["remote_num_tokens"] == 600 + 12 - 1

    second = first + out + ids(128, 2)
    before = metrics(client, d)
    r = complete(client, d, second, max_tokens=4, kv_transfer_params=dict(KEEP))
    after = metrics(client, d)
    body = r.json()
    n = len(second)
    # D's own prefix cache covers turn 1's prompt and answer, in whole blocks; the rest is
    # computed on D: vLLM reports the local hit as cached_tokens (no P figure to take)
    hit = (600 + 12 - 1) // BS * BS
    assert int(r.headers[HEADER_SIM_CACHED_TOKENS]) == hit
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
    assert int(r.headers[HEADER_SIM_COMPUTED_TOKENS]) == n - hit
    assert int(r.headers[HEADER_SIM_CPU_TOKENS]) == 0
    assert delta(after, before, by_source("local_compute")) == n - hit
    assert delta(after, before, by_source("local_cache_hit")) == hit
    assert delta(after, before, by_source("external_kv_transfer")) == 0
    # a non-empty kv_transfer_params keeps the next turn pullable: D's handle comes back
    handle = body["kv_transfer_params"]
    assert handle["do_remote_decode"] is True and handle["remote_num_tokens"] == n + 4 - 1

    # without kv_transfer_params D computes the same way but keeps nothing for a reader
    r = complete(client, d, [*second, *ids(40, 3)], max_tokens=2)
    assert r.json().get("kv_transfer_params") is None
    assert int(r.headers[HEADER_SIM_CACHED_TOKENS]) == n // BS * BS


def _stream_gaps(
    url: str, body: dict[str, Any], gaps: list[float], started: threading.Event
) -> None:
    with (
        httpx.Client(timeout=60, trust_env=False) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as r,
    ):
        last: float | None = None
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if not json.loads(line[6:]).get("choices"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
                if len(gaps) >= 3:
                    started.set()
            last = now


@pytest.mark.parametrize("slowdown", [0.0, 1e-4])
def test_a_prefill_on_d_slows_its_running_streams(
    tmp_path: Path, slowdown: float, client: httpx.Client
) -> None:
    """A 4,000-token prefill on D (0.4 s) shares steps with a running stream: each of its decode
    steps grows by ``slowdown`` x the 2,048 tokens of one step's chunk (0.2 s); without the term
    none is slowed."""
    costs = tmp_path / "costs.json"
    costs.write_text(
        json.dumps(
            {
                "prefill_s_per_token": 1e-4,
                "decode_s_per_token": 0.02,
                "decode_slowdown_s_per_prefill_token": slowdown,
            }
        )
    )
    argv = ["--costs", str(costs), "--block-size", str(BS), "--max-num-batched-tokens", "2048"]
    (d,) = start_sims([["--role", "decode", *argv]])
    try:
        gaps: list[float] = []
        started = threading.Event()
        body = {"prompt": ids(64, 4), "max_tokens": 60, "ignore_eos": True, "stream": True}
        reader = threading.Thread(target=_stream_gaps, args=(d.url, body, gaps, started))
        reader.start()
        assert started.wait(30)
        before = metrics(client, d)
        r = complete(client, d, ids(4000, 5), max_tokens=1)
        after = metrics(client, d)
        reader.join(60)
        assert int(r.headers[HEADER_SIM_COMPUTED_TOKENS]) == 4000
        added = delta(after, before, series("agentkv_sim_decode_slowdown_seconds_total"))
        steps = delta(after, before, series("agentkv_sim_slowed_decode_steps_total"))
        if slowdown:
            assert max(gaps) > 0.15, gaps
            # each slowed step gained one chunk's worth: 2,048 tokens x 0.1 ms
            assert steps >= 1 and added / steps == pytest.approx(0.2048)
        else:
            # (no bound on the wall clock here: other jobs on the machine can stall a step)
            assert added == 0 and steps == 0
    finally:
        d.stop()


def test_prefills_queue_and_steps_are_in_the_inter_token_histogram(
    tmp_path: Path, client: httpx.Client
) -> None:
    """Two 2,000-token prefills sent together to one instance (0.2 s of compute each): one
    computes while the other waits, and the wait is in the second's modelled TTFT and the queue
    counter. A 10-token answer's 9 later steps (20 ms each) are the inter-token histogram's."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"prefill_s_per_token": 1e-4, "decode_s_per_token": 0.02}))
    (d,) = start_sims([["--role", "decode", "--costs", str(costs), "--block-size", str(BS)]])
    itl = "agentkv_sim_model_inter_token_seconds"
    try:
        before = metrics(client, d)
        ttfts: list[float] = []

        def send(seed: int) -> None:
            with httpx.Client(timeout=30, trust_env=False) as c:
                r = complete(c, d, ids(2000, seed), max_tokens=1)
                ttfts.append(float(r.headers["X-AgentKV-Sim-Model-TTFT-Ms"]) / 1000)

        threads = [threading.Thread(target=send, args=(s,)) for s in (7, 8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        middle = metrics(client, d)
        complete(client, d, ids(64, 9), max_tokens=10, ignore_eos=True)
        after = metrics(client, d)
        first, second = sorted(ttfts)
        assert first == pytest.approx(0.2, abs=0.01)
        waited = delta(middle, before, "agentkv_sim_prefill_queue_seconds_total")
        assert second == pytest.approx(0.2 + waited, abs=0.01) and waited > 0.1
        assert delta(after, middle, f"{itl}_count") == 9
        assert delta(after, middle, f"{itl}_sum") == pytest.approx(9 * 0.02)
        assert delta(middle, before, f"{itl}_count") == 0  # a 1-token answer has no later step
    finally:
        d.stop()


@pytest.fixture(scope="module")
def offload() -> Iterator[tuple[SimProcess, SimProcess]]:
    """Two D's with 64 GPU blocks (1,024 tokens) and a CPU tier of 256 blocks; the second's saves
    all fail."""
    common = ["--role", "decode", "--time-scale", "0", "--block-size", str(BS)]
    common += ["--num-blocks", "65", "--cpu-offload-blocks", "256"]
    common += ["--decoder-kv-blocks-ttl", "0.5"]
    ok, failing = start_sims([common, [*common, "--cpu-save-failure-rate", "1"]])
    try:
        yield ok, failing
    finally:
        ok.stop()
        failing.stop()


def _evict_gpu(client: httpx.Client, d: SimProcess, seed: int) -> None:
    """Fill D's 64 GPU blocks with other prompts, so nothing of an earlier one stays cached."""
    for i in range(2):
        complete(client, d, ids(900, seed + i), max_tokens=1)


def test_a_turn_whose_gpu_blocks_are_gone_loads_its_prefix_from_d_cpu_tier(
    offload: tuple[SimProcess, SimProcess], client: httpx.Client
) -> None:
    d, failing = offload
    prompt = ids(480, 10)
    r = complete(
        client,
        d,
        prompt,
        max_tokens=8,
        ignore_eos=True,
        return_token_ids=True,
        kv_transfer_params=KEEP,
    )
    assert r.json()["kv_transfer_params"]["remote_num_tokens"] == 487
    out = r.json()["choices"][0]["token_ids"]
    time.sleep(1.0)  # D's TTL passes: the handle's blocks are released
    _evict_gpu(client, d, 20)

    again = [*prompt, *out, *ids(40, 11)]
    before = metrics(client, d)
    r = complete(client, d, again, max_tokens=2)
    after = metrics(client, d)
    # the first turn's prompt and answer, whole blocks of them, come back from the CPU tier
    loaded = 487 // BS * BS
    assert int(r.headers[HEADER_SIM_CACHED_TOKENS]) == 0
    assert int(r.headers[HEADER_SIM_CPU_TOKENS]) == loaded
    assert int(r.headers[HEADER_SIM_COMPUTED_TOKENS]) == len(again) - loaded
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == loaded
    assert delta(after, before, cached_by_source("host")) == loaded
    assert delta(after, before, series("agentkv_sim_cpu_loaded_tokens_total")) == loaded
    assert after[series("agentkv_sim_cpu_blocks")] <= 256

    # LRU: enough other prompts push it out of the 256-block tier as well
    for i in range(3):
        _evict_gpu(client, d, 30 + 2 * i)
    r = complete(client, d, again, max_tokens=2)
    assert int(r.headers[HEADER_SIM_CPU_TOKENS]) == 0
    assert metrics(client, d)[series("agentkv_sim_cpu_evictions_total")] > 0

    # saves are best effort: where every save fails, nothing comes back
    complete(client, failing, prompt, max_tokens=8, ignore_eos=True)
    _evict_gpu(client, failing, 20)
    r = complete(client, failing, again, max_tokens=2)
    assert int(r.headers[HEADER_SIM_CPU_TOKENS]) == 0
    assert int(r.headers[HEADER_SIM_COMPUTED_TOKENS]) == len(again)
    failed = metrics(client, failing)[series("agentkv_sim_cpu_save_failures_total")]
    assert failed >= 480 // BS
