"""The cost presets reproduce the published 1P1D P5en TTFTs through the engine itself.

A P/D turn runs on in-process simulator instances (no delays, time_scale 0); the TTFT the cost
model assigns to the P request and the D request (``X-AgentKV-Sim-Model-TTFT-Ms``) add up to
the turn's TTFT, which must be within 15 % of every published point.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentkv.sim.costmodel import PRESETS, PUBLISHED_POINTS, reused_tokens_for
from tests._support.cluster import D_PORT, P_PORT, make_cluster

pytestmark = pytest.mark.anyio

TTFT_POINTS = [p for p in PUBLISHED_POINTS if p.measurement.startswith("ttft")]


def _ms(r: Any) -> float:
    assert r.status_code == 200, r.text
    return float(r.headers["x-agentkv-sim-model-ttft-ms"])


@pytest.mark.parametrize(
    "point", TTFT_POINTS, ids=[f"{p.preset}-{p.measurement}-{p.prompt_tokens}" for p in TTFT_POINTS]
)
async def test_published_ttft_through_the_engine(point):
    n = point.prompt_tokens
    big = {"num_blocks": 8192, "max_model_len": 65536, "prefix_caching": False}
    c = make_cluster(p=big, d=big)
    c.p.engine.cost = c.d.engine.cost = PRESETS[point.preset]
    ids = [1000 + (i * 7919) % 140000 for i in range(n)]
    handle: dict[str, Any] | None = None
    if point.measurement == "ttft_reuse":
        # turn 1 leaves D holding the first `reused` tokens (prompt + 1 generated token - 1)
        reused = reused_tokens_for(n)
        p1 = await c.post(
            P_PORT,
            "/v1/completions",
            {
                "prompt": ids[:reused],
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True},
            },
        )
        d1 = await c.post(
            D_PORT,
            "/v1/completions",
            {
                "prompt": ids[:reused],
                "max_tokens": 1,
                "ignore_eos": True,
                "return_token_ids": True,
                "kv_transfer_params": p1.json()["kv_transfer_params"],
            },
        )
        handle = d1.json()["kv_transfer_params"]
        ids = ids[:reused] + d1.json()["choices"][0]["token_ids"] + ids[reused + 1 :]
    p = await c.post(
        P_PORT,
        "/v1/completions",
        {
            "prompt": ids,
            "max_tokens": 1,
            "kv_transfer_params": handle or {"do_remote_decode": True},
        },
    )
    d = await c.post(
        D_PORT,
        "/v1/completions",
        {
            "prompt": ids,
            "max_tokens": 1,
            "ignore_eos": True,
            "kv_transfer_params": p.json()["kv_transfer_params"],
        },
    )
    ttft_ms = _ms(p) + _ms(d)
    assert ttft_ms == pytest.approx(point.seconds * 1000, rel=0.15)
