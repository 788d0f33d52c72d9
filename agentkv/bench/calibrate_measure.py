"""The measuring half of ``agentkv calibrate`` (:mod:`agentkv.bench.calibrate` says what each
kind of turn is and fits the cost model): turns through the router's ``/v1/completions`` with
token-id prompts of words that are single tokens, fresh for every request, and, with a decode
instance's own URL, prefills straight on D and the slowdown they cause D's streams."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from agentkv.bench.calibrate import CalibrationError, Measurement, Timing
from agentkv.bench.content import WORDS
from agentkv.protocol import (
    HEADER_CONVERSATION_ID,
    HEADER_REUSED_TOKENS,
    HEADER_SIM_MODEL_TTFT_MS,
)

__all__ = [
    "measure",
    "measure_curve",
    "measure_decode_side",
    "run_measure",
    "run_measure_decode_side",
]


@dataclass
class _Client:
    http: httpx.AsyncClient
    model: str | None
    timing: Timing
    word_ids: list[int]
    rng: random.Random

    def prompt(self, n: int) -> list[int]:
        return [self.rng.choice(self.word_ids) for _ in range(n)]

    def body(self, prompt: list[int], **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt": prompt, **extra}
        if self.model:
            body["model"] = self.model
        return body

    async def ttft(
        self, prompt: list[int], headers: dict[str, str], **extra: Any
    ) -> tuple[float, httpx.Headers]:
        body = self.body(prompt, max_tokens=1, stream=True, **extra)
        started = time.perf_counter()
        async with self.http.stream("POST", "completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                raise CalibrationError(f"completions answered {r.status_code}: {await r.aread()!r}")
            first: float | None = None
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: ") and line != "data: [DONE]":
                    first = time.perf_counter() - started
            if first is None:
                raise CalibrationError("the stream carried no token")
            if self.timing == "model":
                if HEADER_SIM_MODEL_TTFT_MS not in r.headers:
                    raise CalibrationError(
                        "--timing model needs agentkv's simulator behind agentkv's router "
                        f"({HEADER_SIM_MODEL_TTFT_MS} is missing)"
                    )
                first = float(r.headers[HEADER_SIM_MODEL_TTFT_MS]) / 1000
            return first, r.headers


async def _word_ids(http: httpx.AsyncClient, model: str | None) -> list[int]:
    body: dict[str, Any] = {"prompt": " " + " ".join(WORDS), "add_special_tokens": False}
    if model:
        body["model"] = model
    r = await http.post("../tokenize", json=body)
    if r.status_code != 200:
        raise CalibrationError(f"/tokenize answered {r.status_code}: {r.text[:200]}")
    ids = [int(t) for t in r.json()["tokens"]]
    if len(ids) < 64:
        raise CalibrationError("/tokenize returned too few ids")
    return ids


@contextlib.asynccontextmanager
async def _connected(
    base: str, model: str | None, timing: Timing, seed: int
) -> AsyncIterator[_Client]:
    """A client of the API at ``base`` (its ``/v1/`` URL); without ``model``, for the first
    model ``/models`` lists (none when it lists none)."""
    async with httpx.AsyncClient(base_url=base, timeout=600, trust_env=False) as http:
        if model is None:
            r = await http.get("models")
            if r.status_code == 200 and r.json().get("data"):
                model = str(r.json()["data"][0]["id"])
        yield _Client(http, model, timing, await _word_ids(http, model), random.Random(seed))


async def _recompute(c: _Client, n: int) -> Measurement:
    seconds, _ = await c.ttft(c.prompt(n), {}, cache_salt=uuid.uuid4().hex)
    return Measurement("recompute", n, 0, seconds)


async def _pull(c: _Client, n: int, reused: int) -> Measurement:
    """Turn 1: ``reused`` tokens and one generated (D holds ``reused``); turn 2: those, the
    generated token and new ones, ``n`` in all."""
    conv = f"calibrate-{uuid.uuid4().hex}"
    headers = {HEADER_CONVERSATION_ID: conv}
    salt = uuid.uuid4().hex
    first = c.prompt(max(1, min(reused, n - 2)))
    body = c.body(first, max_tokens=1, ignore_eos=True, return_token_ids=True, cache_salt=salt)
    r = await c.http.post("completions", json=body, headers=headers)
    if r.status_code != 200:
        raise CalibrationError(f"completions answered {r.status_code}: {r.text[:200]}")
    out = list(r.json()["choices"][0].get("token_ids") or [])
    if not out:
        raise CalibrationError("the router returned no token ids (return_token_ids)")
    second = first + out + c.prompt(n - len(first) - len(out))
    seconds, h = await c.ttft(second, headers, cache_salt=salt)
    reused = int(h.get(HEADER_REUSED_TOKENS) or 0)
    if reused <= 0:
        raise CalibrationError(
            f"the second turn read nothing back (decision {h.get('x-agentkv-decision')!r}): "
            "calibrate needs agentkv's router in front of bidirectional P/D"
        )
    return Measurement("pull", len(second), reused, seconds)


async def _decode(c: _Client, n: int, tokens: int) -> Measurement:
    body = c.body(
        c.prompt(n), max_tokens=tokens, ignore_eos=True, stream=True, cache_salt=uuid.uuid4().hex
    )
    times: list[float] = []
    async with c.http.stream("POST", "completions", json=body) as r:
        if r.status_code != 200:
            raise CalibrationError(f"completions answered {r.status_code}: {await r.aread()!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    if choice.get("text") or choice.get("token_ids"):
                        times.append(time.perf_counter())
    if len(times) < 3:
        raise CalibrationError("the decode stream carried fewer than 3 tokens")
    # the last token arrives with the end of the request: use the steps between the others
    steps = [b - a for a, b in itertools.pairwise(times)]
    return Measurement("decode", n + tokens // 2, 0, statistics.median(steps))


async def measure(
    endpoint: str,
    *,
    contexts: Sequence[int] = (512, 1024, 2048, 4096, 8192),
    repeats: int = 3,
    new_tokens: int = 64,
    decode_tokens: int = 24,
    model: str | None = None,
    timing: Timing = "wall",
    seed: int = 0,
    on_step: Callable[[str], None] | None = None,
) -> list[Measurement]:
    """Run the calibration turns against the router at ``endpoint`` (its ``/v1`` base URL)."""
    base = endpoint.rstrip("/") + "/"
    notify = on_step or (lambda _s: None)
    async with _connected(base, model, timing, seed) as c:
        out: list[Measurement] = []
        for n in contexts:
            for _ in range(repeats):
                notify(f"recompute {n}")
                out.append(await _recompute(c, n))
                notify(f"pull {n}")
                out.append(await _pull(c, n, n - 1 - min(new_tokens, max(1, n // 4))))
                notify(f"decode {n}")
                out.append(await _decode(c, n, decode_tokens))
        return out


async def measure_curve(
    endpoint: str, sizes: Sequence[int], *, model: str | None = None, seed: int = 0
) -> list[tuple[int, float, float]]:
    """(prompt tokens, recompute TTFT s, reuse TTFT s) per size, from the simulator's modelled
    TTFT: the published benchmark's two scenarios, "recompute" (the whole prompt prefilled) and
    "reuse" (all but the last 10 % pulled back from D), as real P/D turns through the router."""
    from agentkv.sim.costmodel import reused_tokens_for

    base = endpoint.rstrip("/") + "/"
    out: list[tuple[int, float, float]] = []
    async with httpx.AsyncClient(base_url=base, timeout=600, trust_env=False) as http:
        c = _Client(http, model, "model", await _word_ids(http, model), random.Random(seed))
        for n in sizes:
            recompute = await _recompute(c, n)
            reused = reused_tokens_for(n)
            pull = await _pull(c, n, reused)
            if pull.reused_tokens != reused:
                raise CalibrationError(
                    f"reuse at {n} tokens read {pull.reused_tokens} tokens, not {reused}"
                )
            out.append((n, recompute.seconds, pull.seconds))
    return out


def run_measure(endpoint: str, **kwargs: Any) -> list[Measurement]:
    return asyncio.run(measure(endpoint, **kwargs))


async def _stream_arrivals(
    http: httpx.AsyncClient, body: dict[str, Any], arrivals: list[float], tick: asyncio.Event
) -> None:
    async with http.stream("POST", "completions", json=body) as r:
        if r.status_code != 200:
            raise CalibrationError(f"D's completions answered {r.status_code}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if any(c.get("text") or c.get("token_ids") for c in chunk.get("choices") or []):
                    arrivals.append(time.perf_counter())
                    tick.set()


async def _until(done: Callable[[], bool], tick: asyncio.Event, task: asyncio.Task[None]) -> None:
    """Wait until ``done()``, re-checking at each streamed token, or until the stream ends."""
    while not done() and not task.done():
        tick.clear()
        waiter = asyncio.ensure_future(tick.wait())
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()


async def _slowdown(c: _Client, n: int, stream_tokens: int) -> Measurement:
    """One ``n``-token prefill on D while a stream runs there: the longest step of the stream
    that starts during it, less the stream's median step before it."""
    arrivals: list[float] = []
    tick = asyncio.Event()
    body = c.body(
        c.prompt(16),
        max_tokens=stream_tokens,
        ignore_eos=True,
        stream=True,
        cache_salt=uuid.uuid4().hex,
    )
    task = asyncio.create_task(_stream_arrivals(c.http, body, arrivals, tick))
    try:
        await _until(lambda: len(arrivals) >= 8, tick, task)
        if task.done():
            await task
            raise CalibrationError("D's stream ended before the prefill could start")
        t0 = time.perf_counter()
        await c.ttft(c.prompt(n), {}, cache_salt=uuid.uuid4().hex)
        t1 = time.perf_counter()
        await _until(lambda: arrivals[-1] > t1, tick, task)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await task
    gaps = list(itertools.pairwise(arrivals))
    before = [b - a for a, b in gaps if b <= t0]
    during = [b - a for a, b in gaps if t0 <= a < t1]
    if len(before) < 3 or not during:
        raise CalibrationError(
            f"no step of D's stream ran during a {n}-token prefill: use longer --decode-contexts"
        )
    return Measurement("slowdown", n, 0, max(0.0, max(during) - statistics.median(before)))


async def measure_decode_side(
    decode_url: str,
    *,
    contexts: Sequence[int] = (1024, 2048, 4096),
    repeats: int = 3,
    stream_tokens: int = 400,
    model: str | None = None,
    timing: Timing = "wall",
    seed: int = 0,
    on_step: Callable[[str], None] | None = None,
) -> list[Measurement]:
    """Run the turns on D itself (its engine URL, not the router's): prefill on D and the
    slowdown it causes D's running streams, at each context length."""
    base = decode_url.rstrip("/")
    base = (base if base.endswith("/v1") else base + "/v1") + "/"
    notify = on_step or (lambda _s: None)
    async with _connected(base, model, timing, seed + 1) as c:
        out: list[Measurement] = []
        for n in contexts:
            for _ in range(repeats):
                notify(f"prefill on D {n}")
                seconds, _ = await c.ttft(c.prompt(n), {}, cache_salt=uuid.uuid4().hex)
                out.append(Measurement("decode_prefill", n, 0, seconds))
                notify(f"slowdown on D {n}")
                out.append(await _slowdown(c, n, stream_tokens))
        return out


def run_measure_decode_side(decode_url: str, **kwargs: Any) -> list[Measurement]:
    return asyncio.run(measure_decode_side(decode_url, **kwargs))
