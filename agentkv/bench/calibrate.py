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

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

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


def _or(measured: float | None, otherwise: float) -> float:
    """``measured``, or ``otherwise`` where it was not measured."""
    return otherwise if measured is None else measured


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
        prefill_d_s_per_token=_or(side.prefill_s_per_token, fitted.prefill_s_per_token),
        prefill_d_s_per_token_ctx=_or(side.prefill_s_per_token_ctx, fitted.prefill_s_per_token_ctx),
        decode_s_per_token=fitted.decode_s_per_token,
        decode_s_per_token_ctx=fitted.decode_s_per_token_ctx,
        slowdown_s_per_prefill_token=_or(
            side.slowdown_s_per_prefill_token, defaults.slowdown_s_per_prefill_token
        ),
        cpu_load_s_per_token=defaults.cpu_load_s_per_token,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    return asdict(curves)


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
