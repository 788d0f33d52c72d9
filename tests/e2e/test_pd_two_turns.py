"""Real processes on loopback: a P and a D simulator, and this test acting as the router."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentkv.protocol.promtext import parse_metrics
from agentkv.sim.launch import SimProcess, start_sims

pytestmark = pytest.mark.e2e

SYSTEM = "You are a meticulous assistant. " + " ".join(
    f"Rule {i}: always answer politely and cite fact number {i}." for i in range(30)
)


def metrics(client: httpx.Client, sim: SimProcess) -> dict[str, float]:
    return parse_metrics(client.get(f"{sim.url}/metrics").text)


@pytest.fixture(scope="module")
def pd() -> Iterator[tuple[SimProcess, SimProcess]]:
    common = ["--time-scale", "0", "--block-size", "16", "--kv-load-failure-policy", "recompute"]
    p, d = start_sims(
        [["--role", "prefill", "--no-prefix-caching", *common], ["--role", "decode", *common]]
    )
    try:
        yield p, d
    finally:
        # uvicorn re-raises SIGTERM after a graceful shutdown
        assert p.stop() in (0, -signal.SIGTERM) and d.stop() in (0, -signal.SIGTERM)


def chat(
    client: httpx.Client, sim: SimProcess, messages: list[dict[str, Any]], **body: Any
) -> httpx.Response:
    r = client.post(f"{sim.url}/v1/chat/completions", json={"messages": messages, **body})
    assert r.status_code == 200, r.text
    return r


def turn(client, p, d, messages, handle=None, ids=None):
    kv: dict[str, Any] = dict(handle) if handle else {"do_remote_decode": True}
    if ids is not None:
        kv["prompt_token_ids"] = ids
    pr = chat(client, p, messages, max_tokens=1, return_token_ids=True, kv_transfer_params=kv)
    d_kv = dict(pr.json()["kv_transfer_params"], prompt_token_ids=pr.json()["prompt_token_ids"])
    dr = chat(client, d, messages, max_tokens=24, return_token_ids=True, kv_transfer_params=d_kv)
    return pr, dr


def test_two_turns_reuse_then_stale_handle_hazard(pd):
    p, d = pd
    with httpx.Client(timeout=30, trust_env=False) as client:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Explain P/D."}]
        p1, d1 = turn(client, p, d, msgs)
        ids1 = p1.json()["prompt_token_ids"]
        out1 = d1.json()["choices"][0]["token_ids"]
        handle = d1.json()["kv_transfer_params"]
        assert handle["remote_num_tokens"] == len(ids1) + len(out1) - 1

        # Turn 2: exact ids = turn-1 prompt + generated ids + the new message (ChatML tail).
        tail = client.post(
            f"{p.url}/tokenize",
            json={
                "prompt": "\n<|im_start|>user\nAnd KV reuse?<|im_end|>\n<|im_start|>assistant\n",
                "add_special_tokens": False,
            },
        ).json()["tokens"]
        ids2 = ids1 + out1 + tail
        msgs2 = [
            *msgs,
            {"role": "assistant", "content": d1.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And KV reuse?"},
        ]
        before = metrics(client, p)
        p2, d2 = turn(client, p, d, msgs2, handle=handle, ids=ids2)
        after = metrics(client, p)
        pulled = after["vllm:prompt_tokens_by_source_total[external_kv_transfer]"] - before.get(
            "vllm:prompt_tokens_by_source_total[external_kv_transfer]", 0.0
        )
        local = (
            after["vllm:prompt_tokens_by_source_total[local_cache_hit]"]
            - before["vllm:prompt_tokens_by_source_total[local_cache_hit]"]
        )
        assert pulled > 0 and local + pulled == handle["remote_num_tokens"]
        assert p2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == local + pulled
        assert (
            after["vllm:nixl_xfer_time_seconds_count"]
            == before.get("vllm:nixl_xfer_time_seconds_count", 0) + 1
        )
        assert p2.headers["x-agentkv-sim-wrong-kv-tokens"] == "0"
        assert metrics(client, d)["agentkv_sim_retained_requests"] == 1  # turn 2's handle only

        # The hazard: history rewritten (first answer dropped), old handle sent anyway.
        handle2 = d2.json()["kv_transfer_params"]
        rewritten = ids1[:40] + tail + d2.json()["choices"][0]["token_ids"] + tail
        client.post(f"{p.url}/reset_prefix_cache")
        turn(client, p, d, msgs2, handle=handle2, ids=rewritten)
        assert metrics(client, p)["agentkv_sim_wrong_kv_tokens_total"] > 0
