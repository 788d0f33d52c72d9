"""``agentkv calibrate``: measure a live P/D deployment and fit the simulator's cost model.

Three kinds of turns go through the router's ``/v1/completions`` with token-id prompts (words
that are single tokens, fresh for every request so no prefix cache helps):

* **recompute** at ``N`` tokens: a turn without a conversation id (nothing is read back);
  its time to first token is ``overhead + prefill(N, 0) + transfer(N) [P→D] + decode(1, N)``;
* **pull** at ``N``: a two-turn conversation; the second turn's prompt repeats what D held
  (``R`` tokens, the router's ``X-AgentKV-Reused-Tokens``) and adds new ones. Its TTFT is
  ``overhead + prefill(N − R, R) + transfer(R) [D→P] + transfer(N − L) [P→D] + decode(1, N)``
  where ``L`` (whole blocks of ``R``) is what D's own prefix cache still has of the first turn;
* **decode** at ``N``: ``decode_tokens`` tokens (``ignore_eos``) streamed; the time per token
  after the first is ``decode_s_per_token + decode_s_per_token_ctx × context``.

TTFT is the wall-clock time to the first streamed chunk (``--timing wall``), or the
simulator's own modelled TTFT header (``--timing model``: exact, for checking the fit; decode
is still timed by the wall clock). The decode terms come from the decode turns; the other five
constants of :class:`~agentkv.sim.costmodel.CostModel` are a non-negative least-squares fit of
the recompute and pull turns.

With a decode instance's own URL (``--decode-url``), two more kinds go straight to it, bypassing
the router (docs/paths.md, the ``decode`` path):

* **prefill on D** at ``N``: a fresh prompt with no ``kv_transfer_params``, prefilled on D; its
  TTFT is ``overhead + prefillD(N, 0)``, with the overhead of the router's fit;
* **slowdown** at ``N``: while a stream of ``ignore_eos`` tokens runs on D, an ``N``-token
  prompt is prefilled there; the longest step of the stream that starts during that prefill, less
  the stream's median step before it, is what one decode step gains from ``min(N,
  max_num_batched_tokens)`` prompt tokens in flight (always the wall clock).

The cost file is JSON: ``{"cost_model": {...}, "curves": {...}, "measurements": [...], ...}``:
``agentkv sim --costs`` and ``agentkv plan --costs`` read its cost model, the path cost model
(:func:`agentkv.router.paths.curves_from`) its curves: transfer time per token, prefill per
token on P and on D, D's slowdown per prefill token in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import random
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from agentkv.bench.content import WORDS
from agentkv.protocol import (
    HEADER_CONVERSATION_ID,
    HEADER_REUSED_TOKENS,
    HEADER_SIM_MODEL_TTFT_MS,
)
from agentkv.router.paths import Curves
from agentkv.sim.costmodel import CostModel

__all__ = [
    "CalibrationError",
    "DecodeSide",
    "Measurement",
    "curves_for",
    "describe",
    "fit_cost_model",
    "fit_decode_side",
    "fit_rows",
    "measure",
    "measure_curve",
    "measure_decode_side",
    "nnls",
    "predicted_s",
    "write_cost_file",
]

Timing = Literal["wall", "model"]


class CalibrationError(RuntimeError):
    """The deployment did not answer as a P/D deployment behind agentkv's router should."""


@dataclass(frozen=True)
class Measurement:
    kind: Literal["recompute", "pull", "decode", "decode_prefill", "slowdown"]
    prompt_tokens: int
    reused_tokens: int
    seconds: float
    """TTFT (recompute, pull, decode_prefill), seconds per generated token after the first
    (decode), or what one decode step of D's stream gained while ``prompt_tokens`` prefilled on D
    (slowdown)."""


# -- least squares -----------------------------------------------------------------------------
def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (small, well-scaled systems)."""
    n = len(b)
    m = [[*row[:], b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            continue
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] if abs(m[i][i]) > 1e-12 else 0.0 for i in range(n)]


def nnls(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Least squares ``rows · x ≈ y`` with ``x ≥ 0``: columns scaled to unit norm, then the
    most negative coefficient is fixed at zero and the rest re-solved until none is negative."""
    k = len(rows[0])
    norms = [math.sqrt(sum(r[j] ** 2 for r in rows)) or 1.0 for j in range(k)]
    scaled = [[r[j] / norms[j] for j in range(k)] for r in rows]
    active = [j for j in range(k) if norms[j] > 0 and any(r[j] for r in rows)]
    while True:
        ata = [[sum(r[i] * r[j] for r in scaled) for j in active] for i in active]
        aty = [sum(r[i] * v for r, v in zip(scaled, y, strict=True)) for i in active]
        sol = _solve(ata, aty) if active else []
        worst = min(range(len(active)), key=lambda i: sol[i], default=None)
        if worst is None or sol[worst] >= 0:
            break
        del active[worst]
    out = [0.0] * k
    for j, v in zip(active, sol, strict=True):
        out[j] = v / norms[j]
    return out


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) if tokens > 0 else 0


def _medians(measurements: Sequence[Measurement]) -> list[Measurement]:
    groups: dict[tuple[str, int, int], list[float]] = {}
    for m in measurements:
        groups.setdefault((m.kind, m.prompt_tokens, m.reused_tokens), []).append(m.seconds)
    return [
        Measurement(kind, n, r, statistics.median(v))  # type: ignore[arg-type]
        for (kind, n, r), v in groups.items()
    ]


def fit_cost_model(
    measurements: Sequence[Measurement],
    block_size: int,
    kv_bytes_per_token: int = 0,
    *,
    max_num_batched_tokens: int = 8192,
) -> CostModel:
    """The :class:`CostModel` that best explains ``measurements`` (see the module docstring).
    Repeated measurements of the same turn are reduced to their median first (a loaded machine
    adds outliers, never negative noise)."""
    measurements = _medians(measurements)
    decode = [m for m in measurements if m.kind == "decode"]
    d1 = dctx = 0.0
    if len(decode) >= 2 and len({m.prompt_tokens for m in decode}) >= 2:
        d1, dctx = nnls(
            [[1.0, float(m.prompt_tokens)] for m in decode], [m.seconds for m in decode]
        )
    elif decode:
        d1 = statistics.fmean(m.seconds for m in decode)
    rows: list[list[float]] = []
    y: list[float] = []
    for m in measurements:
        n, r = m.prompt_tokens, m.reused_tokens
        if m.kind == "recompute":
            rows.append([1.0, n, n * (n + 1) / 2, 1.0, _blocks(n, block_size)])
        elif m.kind == "pull":
            new = n - r
            local = r // block_size * block_size
            rows.append(
                [
                    1.0,
                    new,
                    new * r + new * (new + 1) / 2,
                    (r > 0) + (n - local > 0),
                    _blocks(r, block_size) + _blocks(n - local, block_size),
                ]
            )
        else:
            continue
        y.append(m.seconds - (d1 + dctx * n))
    if len(rows) < 5:
        raise CalibrationError("too few recompute and pull turns to fit (need 5 or more)")
    overhead, p1, p2, tb, tpb = nnls(rows, y)
    side = fit_decode_side(
        measurements, overhead_s=overhead, max_num_batched_tokens=max_num_batched_tokens
    )
    return CostModel(
        overhead_s=overhead,
        prefill_s_per_token=p1,
        prefill_s_per_token_ctx=p2,
        transfer_s_base=tb,
        transfer_s_per_block=tpb,
        block_size=block_size,
        decode_s_per_token=d1,
        decode_s_per_token_ctx=dctx,
        kv_bytes_per_token=kv_bytes_per_token,
        decode_slowdown_s_per_prefill_token=side.slowdown_s_per_prefill_token or 0.0,
    )


@dataclass(frozen=True)
class DecodeSide:
    """What the measurements on D itself say (None: not measured)."""

    prefill_s_per_token: float | None
    prefill_s_per_token_ctx: float | None
    slowdown_s_per_prefill_token: float | None


def fit_decode_side(
    measurements: Sequence[Measurement], *, overhead_s: float, max_num_batched_tokens: int = 8192
) -> DecodeSide:
    """D's prefill per token (and per token pair) from its ``decode_prefill`` TTFTs (with an
    intercept of its own from three lengths on, else less the router's ``overhead_s``), and its
    slowdown per prefill token in flight from the ``slowdown`` turns (a line through the origin:
    no prefill, no slowdown)."""
    measurements = _medians(measurements)
    prefill = [m for m in measurements if m.kind == "decode_prefill"]
    p1 = p2 = None
    sizes = {m.prompt_tokens for m in prefill}
    if len(sizes) >= 3:  # D's own overhead too
        _, p1, p2 = nnls(
            [
                [1.0, float(m.prompt_tokens), m.prompt_tokens * (m.prompt_tokens + 1) / 2]
                for m in prefill
            ],
            [m.seconds for m in prefill],
        )
    elif len(sizes) == 2:
        p1, p2 = nnls(
            [
                [float(m.prompt_tokens), m.prompt_tokens * (m.prompt_tokens + 1) / 2]
                for m in prefill
            ],
            [m.seconds - overhead_s for m in prefill],
        )
    elif prefill:
        p1, p2 = statistics.fmean((m.seconds - overhead_s) / m.prompt_tokens for m in prefill), 0.0
    slow = [m for m in measurements if m.kind == "slowdown"]
    s = None
    if slow:
        xs = [float(min(m.prompt_tokens, max_num_batched_tokens)) for m in slow]
        s = max(
            0.0, sum(x * m.seconds for x, m in zip(xs, slow, strict=True)) / sum(x * x for x in xs)
        )
    return DecodeSide(p1, p2, s)


def curves_for(
    fitted: CostModel,
    measurements: Sequence[Measurement] = (),
    *,
    max_num_batched_tokens: int = 8192,
) -> dict[str, Any]:
    """The path cost model's curves (:class:`agentkv.router.paths.Curves`' fields) from a fit:
    P's terms and the transfer from the router's turns, D's from the turns on D (D's prefill is
    P's where D was not measured, the slowdown the published default); the CPU load is not
    measured (the default)."""
    side = fit_decode_side(
        measurements, overhead_s=fitted.overhead_s, max_num_batched_tokens=max_num_batched_tokens
    )
    defaults = Curves()
    curves = Curves(
        overhead_s=fitted.overhead_s,
        transfer_s_base=fitted.transfer_s_base,
        transfer_s_per_token=fitted.transfer_s_per_block / fitted.block_size,
        prefill_p_s_per_token=fitted.prefill_s_per_token,
        prefill_p_s_per_token_ctx=fitted.prefill_s_per_token_ctx,
        prefill_d_s_per_token=(
            fitted.prefill_s_per_token
            if side.prefill_s_per_token is None
            else side.prefill_s_per_token
        ),
        prefill_d_s_per_token_ctx=(
            fitted.prefill_s_per_token_ctx
            if side.prefill_s_per_token_ctx is None
            else side.prefill_s_per_token_ctx
        ),
        decode_s_per_token=fitted.decode_s_per_token,
        decode_s_per_token_ctx=fitted.decode_s_per_token_ctx,
        slowdown_s_per_prefill_token=(
            defaults.slowdown_s_per_prefill_token
            if side.slowdown_s_per_prefill_token is None
            else side.slowdown_s_per_prefill_token
        ),
        cpu_load_s_per_token=defaults.cpu_load_s_per_token,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    return asdict(curves)


# -- measuring ---------------------------------------------------------------------------------
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


def write_cost_file(
    path: Path, model: CostModel, measurements: Sequence[Measurement], **meta: Any
) -> None:
    """The cost file ``agentkv sim --costs`` and ``agentkv plan --costs`` read."""
    data = {
        "cost_model": model.model_dump(),
        **meta,
        "measurements": [asdict(m) for m in measurements],
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


def predicted_s(fitted: CostModel, m: Measurement, block_size: int) -> float:
    """What the fitted cost model says measurement ``m`` should have taken."""
    if m.kind == "recompute":
        return fitted.ttft_s(m.prompt_tokens, 0)
    if m.kind == "pull":
        local = m.reused_tokens // block_size * block_size
        return (
            fitted.overhead_s
            + fitted.prefill_s(m.prompt_tokens - m.reused_tokens, m.reused_tokens)
            + fitted.transfer_s(m.reused_tokens)
            + fitted.transfer_s(m.prompt_tokens - local)
            + fitted.decode_s(1, m.prompt_tokens)
        )
    if m.kind == "decode_prefill":
        return fitted.overhead_s + fitted.prefill_s(m.prompt_tokens, 0)
    if m.kind == "slowdown":
        return fitted.interference_s(m.prompt_tokens)
    return fitted.decode_s(1, m.prompt_tokens)


def fit_rows(
    fitted: CostModel, measurements: Sequence[Measurement], block_size: int
) -> list[list[str]]:
    """Each measurement against the fit, as a table (the first row: the header)."""
    rows = [["measurement", "prompt tokens", "reused", "seconds", "model"]]
    for m in measurements:
        rows.append(
            [
                m.kind,
                f"{m.prompt_tokens:,}",
                f"{m.reused_tokens:,}",
                f"{m.seconds:.4f}",
                f"{predicted_s(fitted, m, block_size):.4f}",
            ]
        )
    return rows


def describe(f: CostModel, block_size: int) -> str:
    """The fitted costs in one line, in the units they are measured in."""
    return (
        f"prefill {f.prefill_s_per_token * 1e6:.2f} µs/token + "
        f"{f.prefill_s_per_token_ctx * 1e12:.3f} ps per (token × context token); "
        f"pull {f.transfer_s_base * 1000:.2f} ms + "
        f"{f.transfer_s_per_block * 1e6:.2f} µs per {block_size}-token block; decode "
        f"{f.decode_s_per_token * 1000:.2f} ms/token + {f.decode_s_per_token_ctx * 1e9:.3f} ns per "
        f"context token; overhead {f.overhead_s * 1000:.1f} ms; D's steps "
        f"+{f.decode_slowdown_s_per_prefill_token * 1e6:.2f} µs per prefill token in flight"
    )
