"""`agentkv bench curves`: each preset's TTFT curve (recompute; reuse of all but the last 10 %)
measured as real P/D turns through the router and simulator processes, next to the cost model
and the published points."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["DEFAULT_PRESETS", "ROWS_HEADER", "curve_rows", "measure_preset", "preset_curve"]

DEFAULT_PRESETS = ("qwen3-32b-p5en", "glm-5-fp8-p5en")
ROWS_HEADER = [
    "preset",
    "prompt tokens",
    "recompute ms (model)",
    "measured",
    "reuse ms (model)",
    "measured",
]

Measured = Sequence[tuple[int, float, float]]
"""(prompt tokens, recompute TTFT s, reuse TTFT s) per prompt length."""


def measure_preset(name: str, points: Sequence[int]) -> Measured:
    """Start the local profile with preset ``name`` and measure both scenarios at ``points``
    (:class:`~agentkv.bench.calibrate.CalibrationError` when it cannot)."""
    import asyncio

    from agentkv.bench import deploy
    from agentkv.bench.calibrate_measure import measure_curve

    with deploy.local_stack(
        "local", time_scale=1.0, preset=name, decode_prefix_caching=False, unverified=False
    ) as s:
        # time_scale 0 would be better, but local_stack scales TTLs by it: keep real time
        # and read the modelled TTFT header (the engines sleep for it).
        return asyncio.run(measure_curve(s.base_url, list(points), model=s.model))


def preset_curve(name: str, points: Sequence[int], measured: Measured) -> dict[str, Any]:
    """The cost model's curves (every 512 tokens), the measured and the published points, in
    ms, as :func:`agentkv.bench.plots.plot_preset_curves` draws them."""
    from agentkv.sim.costmodel import PRESETS, PUBLISHED_POINTS, reused_tokens_for

    cost = PRESETS[name]
    xs = list(range(512, max(points) + 1, 512))

    def published(measurement: str) -> list[tuple[int, float]]:
        return [
            (p.prompt_tokens, p.seconds * 1000)
            for p in PUBLISHED_POINTS
            if p.preset == name and p.measurement == measurement
        ]

    return {
        "model_x": xs,
        "model_recompute_ms": [cost.ttft_s(n, 0) * 1000 for n in xs],
        "model_reuse_ms": [cost.ttft_s(n, reused_tokens_for(n)) * 1000 for n in xs],
        "measured_recompute": [(n, a * 1000) for n, a, _ in measured],
        "measured_reuse": [(n, b * 1000) for n, _, b in measured],
        "published_recompute": published("ttft_recompute"),
        "published_reuse": published("ttft_reuse"),
    }


def curve_rows(name: str, measured: Measured) -> list[list[str]]:
    """One table row per measured length (see :data:`ROWS_HEADER`)."""
    from agentkv.sim.costmodel import PRESETS, reused_tokens_for

    cost = PRESETS[name]
    return [
        [
            name,
            f"{n:,}",
            f"{cost.ttft_s(n, 0) * 1000:,.1f}",
            f"{a * 1000:,.1f}",
            f"{cost.ttft_s(n, reused_tokens_for(n)) * 1000:,.1f}",
            f"{b * 1000:,.1f}",
        ]
        for n, a, b in measured
    ]
