"""The P/D protocol rules of reference/vllm-protocol.md §2, one behaviour per test.

P and D run in-process (httpx ASGI transport) with zero simulated delays and a shared manual
clock, so TTLs and expiry margins are tested without sleeping.
"""

from __future__ import annotations

import asyncio
import copy
import math
from typing import Any

import pytest

from tests._support.cluster import D_PORT, P_PORT, Cluster, make_cluster, openai_error

pytestmark = pytest.mark.anyio

BS = 16
PROMPT = [1000 + i for i in range(200)]  # 200 tokens: 12 full blocks + 8
TAIL = [3000 + i for i in range(30)]


async def prefill(c: Cluster, ids: list[int], handle: dict[str, Any] | None = None, **kw: Any):
    body = {
        "prompt": ids,
        "max_tokens": 1,
        "return_token_ids": True,
        "kv_transfer_params": handle if handle is not None else {"do_remote_decode": True},
        **kw,
    }
    return await c.post(P_PORT, "/v1/completions", body)


async def decode(c: Cluster, ids: list[int], p_params: dict[str, Any], n_out: int = 40, **kw: Any):
    body = {
        "prompt": ids,
        "max_tokens": n_out,
        "ignore_eos": True,
        "return_token_ids": True,
        "kv_transfer_params": p_params,
        **kw,
    }
    return await c.post(D_PORT, "/v1/completions", body)


async def turn1(
    c: Cluster, ids: list[int] = PROMPT, n_out: int = 40
) -> tuple[list[int], dict[str, Any]]:
    """P then D; returns D's output ids and D's handle."""
    p = await prefill(c, ids)
    assert p.status_code == 200, p.text
    d = await decode(c, ids, p.json()["kv_transfer_params"], n_out)
    assert d.status_code == 200, d.text
    body = d.json()
    return body["choices"][0]["token_ids"], body["kv_transfer_params"]


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


EXT = "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
LOCAL = "vllm:prompt_tokens_by_source_total[local_cache_hit]"
WRONG = "agentkv_sim_wrong_kv_tokens_total"
RETAINED = "agentkv_sim_retained_blocks"


async def test_prefill_returns_its_handle():
    c = make_cluster()
    p = await prefill(c, PROMPT)
    params = p.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_num_tokens"] == len(PROMPT)
    assert len(params["remote_block_ids"][0]) == math.ceil(len(PROMPT) / BS)
    assert params["remote_block_ids"][0][0] == 1  # block 0 is the null block
    assert params["remote_blocks_expiry_time"] is None
    assert params["remote_engine_id"] == c.p.config.engine_id
    assert params["remote_port"] == P_PORT and params["remote_host"] == "localhost"
    assert params["transfer_mode"] == "pull" and params["remote_prefill_cached_tokens"] == 0
    assert p.json()["choices"][0]["finish_reason"] == "length"


async def test_decode_pulls_prompt_and_returns_retained_handle():
    c = make_cluster()
    out, handle = await turn1(c)
    assert len(out) == 40
    assert handle["do_remote_decode"] is True and handle["do_remote_prefill"] is False
    assert handle["remote_num_tokens"] == len(PROMPT) + 40 - 1
    assert len(handle["remote_block_ids"][0]) == math.ceil(handle["remote_num_tokens"] / BS)
    assert handle["remote_blocks_expiry_time"] == pytest.approx(c.d.engine.clock.now() + 480)
    assert "remote_prefill_cached_tokens" not in handle
    dm = await c.metrics(D_PORT)
    assert dm[EXT] == len(PROMPT) and dm[RETAINED] == len(handle["remote_block_ids"][0])
    assert c.p.engine.retained == {}  # D's read freed P's blocks


async def test_d_reports_p_cached_tokens():
    c = make_cluster()
    await turn1(c)
    p = await prefill(c, PROMPT)  # P's cache now holds 12 full blocks (prompt-1 capped)
    params = p.json()["kv_transfer_params"]
    assert params["remote_prefill_cached_tokens"] == 192
    d = await decode(c, PROMPT, params, 4)
    assert d.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 192


async def test_turn2_pull_counts_and_frees_d():
    c = make_cluster(p={"prefix_caching": False})
    out, handle = await turn1(c)
    before = await c.metrics(P_PORT)
    ids2 = PROMPT + out + TAIL
    r = await prefill(c, ids2, copy.deepcopy(handle))
    assert r.status_code == 200
    after = await c.metrics(P_PORT)
    assert delta(after, before, EXT) == handle["remote_num_tokens"] == 239
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 239
    assert delta(after, before, "vllm:nixl_xfer_time_seconds_count") == 1
    assert delta(after, before, WRONG) == 0
    assert c.d.engine.retained == {}
    assert (await c.metrics(D_PORT))[RETAINED] == 0


async def test_turn2_with_local_prefix_cache_pulls_only_the_delta():
    c = make_cluster()
    out, handle = await turn1(c, n_out=120)
    await prefill(c, PROMPT, {})  # warm P's cache with the turn-1 prompt (no connector)
    before = await c.metrics(P_PORT)
    r = await prefill(c, PROMPT + out + TAIL, copy.deepcopy(handle))
    after = await c.metrics(P_PORT)
    local = 192  # 12 full blocks of the 200-token prompt
    assert delta(after, before, LOCAL) == local
    assert delta(after, before, EXT) == handle["remote_num_tokens"] - local
    assert r.headers["x-agentkv-sim-wrong-kv-tokens"] == "0"


@pytest.mark.parametrize(
    ("threshold", "n_out", "pulls"),
    [(64, 56, False), (64, 57, True), (0, 2, True), (64, 2, False)],
    ids=["M=63<64", "M=64>=64", "threshold-0-disables", "tiny-M"],
)
async def test_recompute_threshold_edges(threshold, n_out, pulls):
    c = make_cluster(p={"kv_recompute_threshold": threshold})
    out, handle = await turn1(c, n_out=n_out)
    await prefill(c, PROMPT, {})  # L = 192 on P
    before = await c.metrics(P_PORT)
    await prefill(c, PROMPT + out + TAIL, copy.deepcopy(handle))
    after = await c.metrics(P_PORT)
    m = handle["remote_num_tokens"] - 192
    assert delta(after, before, EXT) == (m if pulls else 0)
    assert c.d.engine.retained == {}  # pulled or not, D was notified and freed its blocks


async def test_release_only_handle_frees_d_without_reading():
    c = make_cluster()
    out, handle = await turn1(c)
    before = await c.metrics(P_PORT)
    handle["remote_num_tokens"] = 0
    r = await prefill(c, PROMPT + out + TAIL, handle)
    after = await c.metrics(P_PORT)
    assert r.status_code == 200
    assert delta(after, before, EXT) == 0
    assert delta(after, before, "vllm:nixl_xfer_time_seconds_count") == 0
    assert c.d.engine.retained == {}


@pytest.mark.parametrize(
    ("age", "declined"),
    [(480 - 5.01, False), (480 - 5.0, True)],
    ids=["before-margin", "at-margin"],
)
async def test_expiry_margin_uses_clock_offset(age, declined):
    c = make_cluster(p={"kv_load_failure_policy": "recompute", "prefix_caching": False})
    out, handle = await turn1(c)
    c.clock.advance(age)
    before = await c.metrics(P_PORT)
    r = await prefill(c, PROMPT + out + TAIL, copy.deepcopy(handle))
    after = await c.metrics(P_PORT)
    assert r.status_code == 200
    assert delta(after, before, "vllm:nixl_num_kv_expired_reqs_total") == (1 if declined else 0)
    assert delta(after, before, EXT) == (0 if declined else handle["remote_num_tokens"])


async def test_expired_read_under_fail_policy_is_http_500():
    c = make_cluster(p={"kv_load_failure_policy": "fail", "prefix_caching": False})
    out, handle = await turn1(c)
    c.clock.advance(476)
    r = await prefill(c, PROMPT + out + TAIL, handle)
    assert r.status_code == 500
    assert r.json()["error"] == openai_error("Internal server error", "InternalServerError", 500)


async def test_d_reaps_blocks_at_ttl_and_counts_block_seconds():
    c = make_cluster(d={"decoder_kv_blocks_ttl": 30})
    _, handle = await turn1(c)
    c.clock.advance(29)
    assert await c.d.engine.reap() == 0
    c.clock.advance(2)
    assert await c.d.engine.reap() == 1
    dm = await c.metrics(D_PORT)
    assert dm[RETAINED] == 0
    assert dm["vllm:nixl_num_kv_expired_reqs_total"] == 1
    nblocks = len(handle["remote_block_ids"][0])
    assert dm["agentkv_sim_retained_block_seconds_total"] == pytest.approx(nblocks * 31)


@pytest.mark.parametrize(
    ("compat", "policy", "status", "read_twice"),
    [("0.33", "fail", 500, False), ("0.33", "recompute", 200, False), ("0.32", "fail", 200, True)],
)
async def test_handle_is_single_use(compat, policy, status, read_twice):
    c = make_cluster(p={"kv_load_failure_policy": policy}, d={"compat": compat})
    out, handle = await turn1(c)
    ids2 = PROMPT + out + TAIL
    c.p.engine.pool.reset_prefix_cache()
    await prefill(c, ids2, copy.deepcopy(handle))
    c.p.engine.pool.reset_prefix_cache()
    before = await c.metrics(P_PORT)
    r = await prefill(c, ids2, copy.deepcopy(handle))
    after = await c.metrics(P_PORT)
    assert r.status_code == status
    assert delta(after, before, EXT) == (handle["remote_num_tokens"] if read_twice else 0)
    assert (await c.metrics(D_PORT))["vllm:nixl_num_notifications_after_expiry_total"] == 1


async def test_stale_handle_on_rewritten_history_reads_wrong_kv_and_poisons_cache():
    c = make_cluster()
    out, handle = await turn1(c)
    rewritten = PROMPT[:100] + [7] * 60 + PROMPT[160:] + out + TAIL  # same length, middle changed
    r = await prefill(c, rewritten, copy.deepcopy(handle))
    wrong = int(r.headers["x-agentkv-sim-wrong-kv-tokens"])
    assert wrong > 0
    pm = await c.metrics(P_PORT)
    assert pm[WRONG] == wrong
    again = await prefill(c, rewritten, {})  # no handle: the prefix cache was poisoned
    assert int(again.headers["x-agentkv-sim-wrong-kv-tokens"]) > 0


async def test_trimmed_handle_on_rewritten_history_is_exact():
    c = make_cluster()
    out, handle = await turn1(c)
    rewritten = PROMPT[:100] + [7] * 60 + PROMPT[160:] + out + TAIL
    k = 100 // BS
    trimmed = {
        **handle,
        "remote_block_ids": [handle["remote_block_ids"][0][:k]],
        "remote_num_tokens": k * BS,
    }
    c2 = make_cluster(p={"kv_recompute_threshold": 0})
    c2.d, c2.apps[D_PORT] = c.d, c.apps[D_PORT]
    r = await prefill(c2, rewritten, trimmed)
    assert r.headers["x-agentkv-sim-wrong-kv-tokens"] == "0"
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == k * BS
    assert c.d.engine.retained == {}  # the partial read still freed every block


async def test_shorter_prompt_end_trims_d_blocks_into_wrong_positions():
    c = make_cluster()
    out, handle = await turn1(c)
    shorter = PROMPT[:50] + PROMPT[90:] + out + TAIL[:5]  # 40 tokens dropped: N < C
    assert len(shorter) < handle["remote_num_tokens"]
    r = await prefill(c, shorter, copy.deepcopy(handle))
    # P pulls the whole prompt; D's first blocks are end-trimmed onto shifted positions
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(shorter)
    assert int(r.headers["x-agentkv-sim-wrong-kv-tokens"]) > len(shorter) // 2


async def test_non_bidirectional_decode_returns_no_handle():
    c = make_cluster(d={"bidirectional_kv_xfer": False})
    p = await prefill(c, PROMPT)
    d = await decode(c, PROMPT, p.json()["kv_transfer_params"])
    assert d.json()["kv_transfer_params"] is None
    assert c.d.engine.retained == {}


async def streamed_decode(c: Cluster, **options: Any):
    """D streams five tokens of PROMPT on P's handle."""
    p = await prefill(c, PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "stream": True, **options}
    body["kv_transfer_params"] = p.json()["kv_transfer_params"]
    return await c.post(D_PORT, "/v1/completions", body)


async def test_streamed_decode_puts_handle_on_finish_chunk():
    c = make_cluster()
    r = await streamed_decode(c, stream_options={"include_usage": True})
    chunks = sse_chunks(r.text)
    assert r.text.endswith("data: [DONE]\n\n")
    finish = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["kv_transfer_params"]["do_remote_decode"] is True
    others = [ch for ch in chunks if ch is not finish[0]]
    assert all(ch.get("kv_transfer_params") is None for ch in others)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


async def test_compat_032_streams_carry_no_handle_but_d_still_pins_blocks():
    c = make_cluster(d={"compat": "0.32"})
    r = await streamed_decode(c)
    assert all(ch.get("kv_transfer_params") is None for ch in sse_chunks(r.text))
    assert len(c.d.engine.retained) == 1


def sse_chunks(text: str) -> list[dict[str, Any]]:
    import json

    return [
        json.loads(line[6:])
        for line in text.split("\n\n")
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


async def test_compat_032_expired_handle_never_answers_and_leaks_blocks():
    c = make_cluster(
        p={"compat": "0.32", "prefix_caching": False, "kv_load_failure_policy": "recompute"}
    )
    out, handle = await turn1(c)
    c.clock.advance(476)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(prefill(c, PROMPT + out + TAIL, handle), 0.5)
    assert c.p.engine.pool.num_used == math.ceil(len(PROMPT + out + TAIL) / BS)  # leaked
    assert (await c.metrics(P_PORT))["vllm:nixl_num_kv_expired_reqs_total"] == 1


async def test_prefill_without_bidirectional_waits_forever_for_a_read_it_never_starts():
    c = make_cluster(p={"bidirectional_kv_xfer": False, "prefix_caching": False})
    out, handle = await turn1(c)
    task = asyncio.create_task(prefill(c, PROMPT + out + TAIL, handle))
    await asyncio.sleep(0.3)
    assert not task.done()
    c.p.engine.shutdown()  # a stopping server releases parked requests
    r = await asyncio.wait_for(task, 5)
    assert r.status_code == 503
    assert len(c.d.engine.retained) == 1  # D was never notified: blocks held until the TTL


async def test_prefill_without_bidirectional_ignores_handle_below_threshold():
    c = make_cluster(p={"bidirectional_kv_xfer": False})
    out, handle = await turn1(c, n_out=10)
    await prefill(c, PROMPT, {})
    r = await prefill(c, PROMPT + out + TAIL, handle)
    assert r.status_code == 200
    assert len(c.d.engine.retained) == 1


async def test_cost_model_sets_the_model_ttft():
    from agentkv.sim.costmodel import PRESETS

    c = make_cluster(p={"prefix_caching": False})
    cost = PRESETS["qwen3-32b-p5en"]
    c.p.engine.cost = cost
    out, handle = await turn1(c)
    ids2 = PROMPT + out + TAIL
    r = await prefill(c, ids2, handle)
    model_ms = float(r.headers["x-agentkv-sim-model-ttft-ms"])
    reused = handle["remote_num_tokens"]
    want = cost.overhead_s + cost.transfer_s(reused) + cost.prefill_s(len(ids2) - reused, reused)
    assert model_ms == pytest.approx(want * 1000, abs=1e-3)
