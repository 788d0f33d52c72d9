"""Each turn's path between real processes (docs/paths.md): with ``paths = "choose"`` a turn that
adds a few tokens to what D holds goes straight to that D, which prefills only them from its own
prefix cache (P is not asked); a turn with many new tokens goes through P, which reads D's KV
back (``paths = "pull"``, which never decodes in place: ``test_paths_inprocess.py``). The
simulator checks every block's KV content: no turn runs on wrong KV."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from agentkv.router.config import PathSettings
from agentkv.sim.launch import SimProcess
from tests._support.stack import MODEL, Stack, held_after, stack

pytestmark = pytest.mark.e2e

BS = 16
FIRST = list(range(1000, 1300))  # 300 tokens
COMPUTED = "vllm:prompt_tokens_by_source_total[local_compute]"
PROMPT = "vllm:prompt_tokens_total"


def turn(url: str, conv: str, ids: list[int], *, stream: bool = False) -> httpx.Response:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 20,
            "kv_transfer_params": {"prompt_token_ids": ids},
            "return_token_ids": True,
            "stream": stream,
        },
        headers={"X-Conversation-Id": conv},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r


def held_by_d(r: httpx.Response, ids: list[int]) -> list[int]:
    """What D holds after answering ``r`` (streamed or not) to a prompt of ``ids``."""
    if not r.headers["content-type"].startswith("text/event-stream"):
        return held_after(r, ids)
    out: list[int] = []
    for line in r.text.split("\n\n"):
        if line.startswith("data: {"):
            choices = json.loads(line[6:])["choices"]
            out += choices[0].get("token_ids") or [] if choices else []
    return [*ids, *out]


def counts(s: Stack, sim: SimProcess) -> tuple[float, float]:
    """(prompt tokens, prompt tokens computed) ``sim`` has processed."""
    m = s.metrics(sim)
    return m.get(PROMPT, 0.0), m.get(COMPUTED, 0.0)


def settled(s: Stack, d: SimProcess, n: int) -> None:
    """Wait for ``d`` to retain ``n`` handles (a superseded one is released in the background)."""
    deadline = time.monotonic() + 10
    while s.retained(d) != n:
        assert time.monotonic() < deadline, s.retained(d)
        time.sleep(0.05)


def test_few_new_tokens_decode_in_place_and_many_pull(tmp_path):
    with stack(
        tmp_path,
        p_args=(("--no-prefix-caching",),),
        d_args=((), ()),
        # a budget of 48 tokens in flight: the second decode-in-place turn runs only if the
        # first one's tokens were given back when its stream's first bytes came
        router={
            "paths": {"mode": "choose", "decode_max_new_tokens": 256, "decode_tokens_in_flight": 48}
        },
    ) as s:
        p = s.prefill[0]
        url = s.router.url
        r = turn(url, "c", FIRST)
        assert r.headers["x-agentkv-decision"] == "miss"
        held = held_after(r, FIRST)
        holder = next(d for d in s.decode if s.retained(d) == 1)
        other = next(d for d in s.decode if d is not holder)

        # twice: a decode-in-place turn leaves a handle for the next one
        for new, stream in ((30, True), (5, False)):
            ids = [*held, *range(2000, 2000 + new)]
            before_p, before_d, before_o = counts(s, p), counts(s, holder), counts(s, other)
            r = turn(url, "c", ids, stream=stream)
            h = r.headers
            cached = (len(held) - 1) // BS * BS  # D's verified full blocks (vLLM: full only)
            assert h["x-agentkv-decision"] == "decode", dict(h)
            assert h["x-agentkv-reused-tokens"] == "0"
            assert int(h["x-agentkv-verified-prefix-tokens"]) == len(held) - 1
            assert int(h["x-agentkv-decode-cached-tokens"]) == cached
            if not stream:
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
            assert h["x-agentkv-runner-up"] in ("pull", "recompute")
            assert float(h["x-agentkv-runner-up-estimate-ms"]) > float(
                h["x-agentkv-path-estimate-ms"]
            )
            # the D that held the history prefilled exactly the new tokens; P and the other D
            # never saw the prompt (P may have had the 1-token notify freeing the old handle)
            now = counts(s, holder)
            assert (now[0] - before_d[0], now[1] - before_d[1]) == (len(ids), len(ids) - cached)
            assert counts(s, other) == before_o
            assert counts(s, p)[0] - before_p[0] <= 1
            settled(s, holder, 1)  # the old handle was freed: D holds only the new one
            held = held_by_d(r, ids)

        # many new tokens (over decode_max_new_tokens): P reads D's KV back
        ids = [*held, *range(3000, 3400)]
        before_p = counts(s, p)
        r = turn(url, "c", ids)
        assert r.headers["x-agentkv-decision"] == "pull", dict(r.headers)
        assert int(r.headers["x-agentkv-reused-tokens"]) == len(held) - 1
        assert "x-agentkv-decode-cached-tokens" not in r.headers
        assert counts(s, p)[0] - before_p[0] == len(ids)

        assert s.wrong_kv() == 0


def test_the_default_router_decodes_a_short_turn_in_place_and_sends_a_long_one_through_p(
    tmp_path,
):
    """No ``[paths]`` at all: the default ``choose`` decodes a follow-up turn of a few tokens
    on the D that holds the history, and a turn of more new tokens than the default
    ``decode_max_new_tokens`` goes through P, which reads D's KV back. No wrong KV."""
    limit = PathSettings().decode_max_new_tokens
    assert PathSettings().mode == "choose"
    with stack(tmp_path, p_args=(("--no-prefix-caching",),)) as s:
        p, d = s.prefill[0], s.decode[0]
        url = s.router.url
        r = turn(url, "default", FIRST)
        assert r.headers["x-agentkv-decision"] == "miss"
        held = held_after(r, FIRST)

        ids = [*held, *range(2000, 2020)]
        before_p, before_d = counts(s, p), counts(s, d)
        r = turn(url, "default", ids)
        assert r.headers["x-agentkv-decision"] == "decode", dict(r.headers)
        cached = (len(held) - 1) // BS * BS
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        now = counts(s, d)
        assert (now[0] - before_d[0], now[1] - before_d[1]) == (len(ids), len(ids) - cached)
        assert counts(s, p)[0] - before_p[0] <= 1  # at most the old handle's 1-token release
        settled(s, d, 1)
        held = held_after(r, ids)

        ids = [*held, *range(5000, 5000 + limit + 100)]
        before_p = counts(s, p)
        r = turn(url, "default", ids)
        assert r.headers["x-agentkv-decision"] == "pull", dict(r.headers)
        assert int(r.headers["x-agentkv-reused-tokens"]) == len(held) - 1
        assert counts(s, p)[0] - before_p[0] == len(ids)

        assert s.wrong_kv() == 0
