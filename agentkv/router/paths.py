"""Which path a turn takes: each path's estimated time to first token, and the cheapest one
within D's interference budget (docs/paths.md). Pure functions, no I/O.

A turn's prompt has ``N`` tokens. What is already held, in tokens from the prompt's start
(block-aligned, as the engines count them):

* ``h``: what the conversation's D handle holds of this prompt (verified), for a read back;
* ``l``: P's own prefix-cache hit;
* ``g``: the conversation's D's GPU prefix cache (its handle's blocks, or what is still cached);
* ``c``: that D's CPU tier (offload profile), a prefix that includes ``g``'s.

The paths (``o`` the per-request overhead, ``t(n)`` a KV transfer of ``n`` tokens,
``pP``/``pD`` prefill on P/on D of ``new`` tokens over ``ctx`` cached ones, ``d`` D's first
decode step over the prompt):

* ``pull``: ``o + t(h − l) + pP(N − max(h, l), max(h, l)) + t(N − g) + d``: P reads D's KV back,
  computes the rest, D reads the prompt from P (what its own cache lacks);
* ``local``: ``o + pP(N − l, l) + t(N − g) + d``;
* ``recompute``: ``o + pP(N, 0) + t(N − g) + d``;
* ``decode``: ``o + pD(N − g, g)``: straight to the D, which prefills the new tokens itself
  (vLLM: no connector load, the first token comes out of the prefill step);
* ``cpu``: ``o + load(c − g) + pD(N − c, c)``: straight to the D, which loads the prefix from its
  CPU tier first.

A vLLM engine always computes at least the last prompt token, so every cached count is capped at
``N − 1``; a read back of fewer than ``upstream.kv_recompute_threshold`` tokens is not one
(P recomputes).

Load: a prefill waits for the prompt tokens its engine is already prefilling (one GPU's compute),
so a P path adds ``qP × P's per-token prefill`` (``qP``: the prompt tokens queued on P) to P's
part. D's queue (``qD × D's per-token prefill``, ``qD``: D's prompt tokens in flight) drains while
a turn does what comes before D's compute: a P path's first decode step starts at
``max(P's part + t(N − g), D's queue)``, a decode-side path's prefill at ``max(o + load, D's
queue)`` (as the simulator schedules them).

The decode-side paths (``decode``, ``cpu``) prefill on D, which slows D's running streams: each
of their steps is longer by ``slowdown × min(tokens in flight, max_num_batched_tokens)`` while the
prefill runs, and each of D's ``S`` running streams waits ``slowdown × new`` longer in all. That
interference is D's budget, a constraint, not a cost: a decode-side path is allowed only when its
new tokens are at most ``budget.max_new_tokens`` and D's prompt tokens in flight, these included,
stay within ``budget.tokens_in_flight``. The allowed path with the lowest estimated TTFT wins.

The router's turn core (:mod:`agentkv.router.turn`) calls :func:`choose` on every turn with a
verified handle (config ``paths.mode``); :class:`InFlight` is its per-D count of tokens in flight.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path as FilePath
from typing import Any, Literal

__all__ = [
    "PATHS",
    "Choice",
    "Curves",
    "DecodeBudget",
    "Estimate",
    "InFlight",
    "Path",
    "TurnState",
    "choose",
    "curves_from",
    "estimate",
    "load_curves",
]

Path = Literal["pull", "decode", "local", "recompute", "cpu"]
PATHS: tuple[Path, ...] = ("pull", "decode", "local", "recompute", "cpu")


@dataclass(frozen=True)
class Curves:
    """The deployment's measured costs, in seconds; what ``agentkv calibrate`` writes under
    ``curves`` in its cost file.

    The defaults are published figures: the simulator's ``qwen3-32b-p5en`` preset, a fit of
    vLLM's bidirectional-KV blog post (1P1D Qwen3-32B on AWS P5en, H200: TTFT 158 → 778 ms
    recomputing 2k → 24k tokens, 122 → 460 ms reading 90 % back, KV transfer 29 → 130 ms;
    within 10 % of each point, ``agentkv/sim/costmodel.py``). D's prefill is P's (the same GPUs);
    the slowdown per prefill token in flight is the prefill time per token (a step's compute grows
    by its chunk's); a CPU load moves 262,144 bytes a token at 50 GB/s (PCIe Gen5 x16); the
    per-step budget is vLLM 0.33's ``max_num_batched_tokens`` for the OpenAI server on an
    H100/H200, 8,192 (``engine/arg_utils.py``).
    """

    overhead_s: float = 0.061
    transfer_s_base: float = 0.016
    """Fixed cost of one KV transfer."""
    transfer_s_per_token: float = 8.2e-5 / 16
    """Per token moved over NIXL (the preset's 82 µs per 16-token block)."""
    prefill_p_s_per_token: float = 2.2e-5
    prefill_p_s_per_token_ctx: float = 3e-10
    """Per (new token, cached token it attends over) pair, on P."""
    prefill_d_s_per_token: float = 2.2e-5
    prefill_d_s_per_token_ctx: float = 3e-10
    decode_s_per_token: float = 0.015
    decode_s_per_token_ctx: float = 5e-8
    slowdown_s_per_prefill_token: float = 2.2e-5
    """What one decode step of D's running streams gains per prompt token prefilling beside it."""
    cpu_load_s_per_token: float | None = 5.2e-6  # 262,144 bytes at 50 GB/s
    """Per token loaded from D's CPU tier; None: D has no CPU tier (no ``cpu`` path)."""
    max_num_batched_tokens: int = 8192
    """vLLM's per-step token budget: the largest prefill chunk that shares a decode step."""

    def queue_p_s(self, tokens: int) -> float:
        """What a prefill on P waits for the ``tokens`` P is prefilling already."""
        return self.prefill_p_s_per_token * max(0, tokens)

    def queue_d_s(self, tokens: int) -> float:
        """What a prefill on D waits for the ``tokens`` D is prefilling already."""
        return self.prefill_d_s_per_token * max(0, tokens)

    def streams_delay_s(self, new: int, streams: int) -> float:
        """What ``new`` prompt tokens prefilled on D add to the latency of its ``streams``
        running streams, summed over them: every step they share grows by the chunk's share."""
        return self.slowdown_s_per_prefill_token * max(0, new) * max(0, streams)

    def transfer_s(self, tokens: int) -> float:
        return 0.0 if tokens <= 0 else self.transfer_s_base + self.transfer_s_per_token * tokens

    def prefill_p_s(self, new: int, ctx: int) -> float:
        return _prefill(self.prefill_p_s_per_token, self.prefill_p_s_per_token_ctx, new, ctx)

    def prefill_d_s(self, new: int, ctx: int) -> float:
        return _prefill(self.prefill_d_s_per_token, self.prefill_d_s_per_token_ctx, new, ctx)

    def first_decode_s(self, ctx: int) -> float:
        return self.decode_s_per_token + self.decode_s_per_token_ctx * ctx

    def itl_added_s(self, prefill_tokens_in_flight: int) -> float:
        """What each decode step of D's streams gains while these prompt tokens prefill."""
        chunk = min(max(0, prefill_tokens_in_flight), self.max_num_batched_tokens)
        return self.slowdown_s_per_prefill_token * chunk


def _prefill(per_token: float, per_pair: float, new: int, ctx: int) -> float:
    if new <= 0:
        return 0.0
    return per_token * new + per_pair * (new * ctx + new * (new + 1) / 2)


def curves_from(data: Mapping[str, Any], *, cpu_tier: bool = True) -> Curves:
    """:class:`Curves` from a cost file's content (its ``curves`` object, else its top level);
    fields it lacks keep their defaults. ``cpu_tier=False``: D has no CPU tier.

    Raises ``ValueError`` on an unknown field or a value that is not a non-negative number."""
    raw = data.get("curves", data)
    if not isinstance(raw, Mapping):
        raise ValueError("curves must be an object")
    known = {f.name for f in fields(Curves)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise ValueError(f"unknown curve {key!r}")
        if value is None and key == "cpu_load_s_per_token":
            values[key] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"curve {key!r} must be a non-negative number, got {value!r}")
        values[key] = int(value) if key == "max_num_batched_tokens" else float(value)
    if not cpu_tier:
        values["cpu_load_s_per_token"] = None
    return Curves(**values)


def load_curves(path: str | None) -> Curves:
    """The curves of a cost file (``agentkv calibrate --out``); the defaults when ``path`` is
    None. Raises ``ValueError`` on a file that is not one."""
    if path is None:
        return Curves()
    try:
        data = json.loads(FilePath(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"paths.costs {path!r}: {exc}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"paths.costs {path!r}: not a JSON object")
    return curves_from(data)


@dataclass(frozen=True)
class DecodeBudget:
    """How much decode-side prefill one D takes.

    ``max_new_tokens`` defaults to Dynamo's conditional-disaggregation threshold (a turn with at
    most 2,048 uncached tokens is prefilled on the decode worker); ``tokens_in_flight`` to one
    step's budget (``Curves.max_num_batched_tokens``): more would stretch the slowdown over more
    steps without making any step slower."""

    max_new_tokens: int = 2048
    tokens_in_flight: int = 8192


@dataclass(frozen=True)
class TurnState:
    """What is known of one turn when its path is chosen (tokens)."""

    prompt_tokens: int
    handle_tokens: int = 0
    """``h``: what the conversation's D handle holds of this prompt, verified; 0: no handle."""
    p_cached_tokens: int = 0
    """``l``: P's prefix-cache hit."""
    d_cached_tokens: int = 0
    """``g``: the conversation's D's GPU prefix cache; 0: nothing there (or no such D)."""
    d_cpu_tokens: int = 0
    """``c``: the prefix D's CPU tier holds (offload profile)."""
    d_in_flight_tokens: int = 0
    """Prompt tokens already prefilling on that D (``qD``; the router's count of its
    decode-in-place turns until D's first bytes)."""
    d_running_streams: int = 0
    """``S``: requests running on that D (the router's count of its requests there, from the
    request until the answer's end): each is slowed by a prefill on D."""
    p_queued_tokens: int = 0
    """``qP``: prompt tokens the P this turn would go to is prefilling already (the router's
    count of what the least loaded P computes for its requests in flight: each prompt less what
    it reads back)."""
    recompute_threshold: int = 64
    """P's ``upstream.kv_recompute_threshold``: a smaller read back is not made."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must not be negative")
        if self.prompt_tokens < 1:
            raise ValueError("a prompt has at least one token")


@dataclass(frozen=True)
class Estimate:
    path: Path
    ttft_s: float
    computed_tokens: int
    """Prompt tokens the path prefills."""
    transferred_tokens: int
    """Tokens moved over NIXL (both directions) or loaded from the CPU tier."""
    d_itl_added_s: float = 0.0
    """What each step of D's running streams gains while this turn prefills on D."""
    d_streams_delay_s: float = 0.0
    """What this turn's prefill on D adds to the latency of D's running streams, summed (what
    D's budget bounds; not ranked)."""


@dataclass(frozen=True)
class Choice:
    """The path to take, and what the next best was estimated to cost."""

    path: Path
    ttft_s: float
    runner_up: Path | None
    runner_up_ttft_s: float | None
    estimates: dict[Path, Estimate] = field(default_factory=dict)
    """Every path that could run (within the budget or not)."""
    excluded: dict[Path, str] = field(default_factory=dict)
    """Paths left out, and why (``no handle``, ``over budget``, ...)."""


def _cap(tokens: int, n: int) -> int:
    return min(tokens, n - 1)


def estimate(state: TurnState, curves: Curves) -> tuple[dict[Path, Estimate], dict[Path, str]]:
    """Each path's estimate, and the paths that cannot run at all, with why."""
    n = state.prompt_tokens
    local = _cap(state.p_cached_tokens, n)
    g = _cap(state.d_cached_tokens, n)
    to_d = curves.transfer_s(n - g)
    queue_p = curves.queue_p_s(state.p_queued_tokens)
    first = curves.first_decode_s(n)
    o = curves.overhead_s
    out: dict[Path, Estimate] = {}
    why: dict[Path, str] = {}

    queue_d = curves.queue_d_s(state.d_in_flight_tokens)

    def p_turn(path: Path, read: int, ctx: int) -> None:
        # D's step waits for what is left of D's queue once the KV has reached it
        at_d = o + queue_p + curves.transfer_s(read) + curves.prefill_p_s(n - ctx, ctx) + to_d
        out[path] = Estimate(path, max(at_d, queue_d) + first, n - ctx, read + (n - g))

    p_turn("recompute", 0, 0)
    if local > 0:
        p_turn("local", 0, local)
    else:
        why["local"] = "P has nothing cached"
    h = _cap(state.handle_tokens, n)
    read = h - local
    if state.handle_tokens <= 0:
        why["pull"] = "no handle"
    elif read <= 0:
        why["pull"] = "P's cache covers the handle"
    elif state.recompute_threshold > 0 and read < state.recompute_threshold:
        why["pull"] = "below upstream.kv_recompute_threshold"
    else:
        p_turn("pull", read, h)

    def d_turn(path: Path, ctx: int, load_s: float, loaded: int) -> None:
        new = n - ctx
        out[path] = Estimate(
            path,
            max(o + load_s, queue_d) + curves.prefill_d_s(new, ctx),
            new,
            loaded,
            curves.itl_added_s(state.d_in_flight_tokens + new),
            curves.streams_delay_s(new, state.d_running_streams),
        )

    if g > 0:
        d_turn("decode", g, 0.0, 0)
    else:
        why["decode"] = "D holds nothing of the prompt"
    c = _cap(state.d_cpu_tokens, n)
    if curves.cpu_load_s_per_token is None:
        why["cpu"] = "D has no CPU tier"
    elif c <= g:
        why["cpu"] = "D's CPU tier holds no more than its GPU"
    else:
        d_turn("cpu", c, curves.cpu_load_s_per_token * (c - g), c - g)
    return out, why


def choose(
    state: TurnState, curves: Curves | None = None, budget: DecodeBudget | None = None
) -> Choice:
    """The path with the lowest estimated TTFT among those D's interference budget allows (ties:
    the order of :data:`PATHS`), and the runner-up's estimate. What a decode-side path costs D's
    running streams is the budget's to bound, not added to its TTFT."""
    curves = curves or Curves()
    budget = budget or DecodeBudget()
    estimates, excluded = estimate(state, curves)
    allowed: list[Estimate] = []
    for path in PATHS:
        e = estimates.get(path)
        if e is None:
            continue
        if path in ("decode", "cpu"):
            if e.computed_tokens > budget.max_new_tokens:
                excluded[path] = f"{e.computed_tokens} new tokens > {budget.max_new_tokens}"
                continue
            if state.d_in_flight_tokens + e.computed_tokens > budget.tokens_in_flight:
                excluded[path] = (
                    f"{state.d_in_flight_tokens} + {e.computed_tokens} tokens in flight "
                    f"> {budget.tokens_in_flight}"
                )
                continue
        allowed.append(e)
    ranked = sorted(allowed, key=lambda e: (e.ttft_s, PATHS.index(e.path)))
    best = ranked[0]  # recompute is always there
    second = ranked[1] if len(ranked) > 1 else None
    return Choice(
        best.path,
        best.ttft_s,
        second.path if second else None,
        second.ttft_s if second else None,
        estimates,
        excluded,
    )


class InFlight:
    """Each D's new prompt tokens of decode-in-place turns, from the request until D's first
    bytes arrive or it fails (the router's own count: the budget ``choose`` checks)."""

    def __init__(self) -> None:
        self._tokens: dict[str, int] = {}

    def snapshot(self) -> dict[str, int]:
        return dict(self._tokens)

    def reserve(self, url: str, tokens: int, budget: DecodeBudget) -> bool:
        """Count ``tokens`` on ``url`` if the budget allows them; whether it did."""
        now = self._tokens.get(url, 0)
        if tokens > budget.max_new_tokens or now + tokens > budget.tokens_in_flight:
            return False
        self._tokens[url] = now + tokens
        return True

    def give_back(self, url: str, tokens: int) -> Callable[[], None]:
        """A call that releases ``tokens`` on ``url`` the first time it is made."""
        left = [tokens]

        def release() -> None:
            self.release(url, left.pop() if left else 0)

        return release

    def release(self, url: str, tokens: int) -> None:
        if tokens:
            left = self._tokens.get(url, 0) - tokens
            if left > 0:
                self._tokens[url] = left
            else:
                self._tokens.pop(url, None)
