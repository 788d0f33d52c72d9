"""PNG figures (matplotlib, the ``bench`` extra; drawn off-screen)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentkv.bench.replay_records import POLICIES, TurnRecord

__all__ = [
    "plot_preset_curves",
    "plot_retention",
    "plot_reuse_fraction",
    "plot_tradeoff",
    "plot_ttft_by_context",
]

_COLORS = {"none": "#7f7f7f", "unverified": "#d62728", "agentkv": "#1f77b4", "lease": "#2ca02c"}
_LABELS = {
    "none": "no reuse (baseline)",
    "unverified": "unverified (example proxy)",
    "agentkv": "agentkv verified",
    "lease": "agentkv + leases",
}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - the bench extra brings it
        raise RuntimeError(
            'plots need matplotlib: pip install "vllm-agentkv[bench]" (or pass --no-plots)'
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _binned(xs: Sequence[float], ys: Sequence[float], bins: int) -> tuple[list[float], list[float]]:
    if not xs:
        return [], []
    pairs = sorted(zip(xs, ys, strict=True))
    size = max(1, len(pairs) // bins)
    bx: list[float] = []
    by: list[float] = []
    for i in range(0, len(pairs), size):
        chunk = pairs[i : i + size]
        if len(chunk) < max(3, size // 2) and bx:
            continue
        mid = sorted(y for _, y in chunk)
        bx.append(sum(x for x, _ in chunk) / len(chunk))
        by.append(mid[len(mid) // 2])
    return bx, by


def plot_ttft_by_context(records: Sequence[TurnRecord], path: Path, *, title: str = "") -> Path:
    """Modelled TTFT against prompt length, per policy (turns after the first)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for policy in POLICIES:
        rows = [
            r
            for r in records
            if r.policy == policy and r.turn > 0 and not r.error and r.model_ttft_ms is not None
        ]
        if not rows:
            continue
        xs = [float(r.prompt_tokens) for r in rows]
        ys = [float(r.model_ttft_ms or 0.0) for r in rows]
        ax.scatter(xs, ys, s=6, alpha=0.25, color=_COLORS[policy])
        bx, by = _binned(xs, ys, 12)
        ax.plot(bx, by, color=_COLORS[policy], label=f"{_LABELS[policy]} (median)", lw=2)
    ax.set_xlabel("prompt tokens (on the wire)")
    ax.set_ylabel("TTFT, simulator's cost model (ms)")
    ax.set_title(title or "TTFT by context length")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_reuse_fraction(summaries: Mapping[str, Any], path: Path) -> Path:
    """Share of the ideal reusable tokens each policy read back correctly, by turn kind, with
    the wrong-KV tokens above the bars."""
    plt = _pyplot()
    kinds = ["append", "strip", "rewrite", "all"]
    policies = [p for p in POLICIES if p in summaries]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    width = 0.8 / max(1, len(policies))
    for i, policy in enumerate(policies):
        s = summaries[policy]
        values, wrong = [], []
        for kind in kinds:
            if kind == "all":
                pct, w = s.captured_pct, s.wrong_kv_tokens
            else:
                k = s.by_kind.get(kind)
                pct, w = (k.captured_pct, k.wrong_kv_tokens) if k else (None, 0)
            values.append(pct or 0.0)
            wrong.append(w)
        xs = [j + (i - (len(policies) - 1) / 2) * width for j in range(len(kinds))]
        bars = ax.bar(xs, values, width, color=_COLORS[policy], label=_LABELS[policy])
        for bar, w in zip(bars, wrong, strict=True):
            if w:
                ax.text(
                    bar.get_x() + bar.get_width() / 2,
                    2,
                    f"{w:,} wrong-KV tokens",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color="white",
                )
    ax.set_xticks(range(len(kinds)))
    ax.set_xticklabels(["appends", "reasoning strips", "rewrites", "all turns"])
    ax.set_ylabel("% of ideal reusable tokens read back correctly")
    ax.set_ylim(0, 105)
    ax.set_title("Reuse captured (turns whose gap is within the TTL)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=3, fontsize=8)
    return _save(fig, path)


def plot_retention(summaries: Mapping[str, Any], path: Path) -> Path:
    """D's retained block-hours (modelled at full speed from the trace's gaps), split into
    blocks read or released by the next turn and blocks held until D's TTL, beside the tokens
    read back correctly."""
    plt = _pyplot()
    policies = [p for p in POLICIES if p in summaries]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8.5, 4))
    labels = [_LABELS[p].split(" (")[0] for p in policies]
    to_ttl = [summaries[p].retained_to_ttl_block_s / 3600 for p in policies]
    to_next = [
        summaries[p].retained_block_s / 3600 - t for p, t in zip(policies, to_ttl, strict=True)
    ]
    colors = [_COLORS[p] for p in policies]
    left.bar(labels, to_next, color=colors, label="until the next turn")
    left.bar(
        labels,
        to_ttl,
        bottom=to_next,
        color=colors,
        alpha=0.4,
        hatch="//",
        label="until freed unread (D's TTL or a lapsed lease)",
    )
    left.set_ylabel("D's retained block-hours")
    left.set_title("KV held for the next turn")
    left.legend(fontsize=7)
    right.bar(labels, [summaries[p].useful_reused_tokens / 1e3 for p in policies], color=colors)
    right.set_ylabel("tokens read back correctly (thousands)")
    right.set_title("Prefill tokens not recomputed")
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    return _save(fig, path)


def plot_tradeoff(rows: Sequence[Mapping[str, Any]], path: Path, *, title: str = "") -> Path:
    """The planner's reuse captured against retained block-hours, one line per threshold,
    one point per TTL."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    thresholds = sorted({int(r["threshold"]) for r in rows})
    for threshold in thresholds:
        line = sorted(
            (r for r in rows if int(r["threshold"]) == threshold), key=lambda r: r["ttl_s"]
        )
        xs = [r["retained_block_s"] / 3600 for r in line]
        ys = [r["captured_pct"] for r in line]
        ax.plot(xs, ys, marker="o", label=f"threshold {threshold}")
        if threshold == thresholds[0]:
            for r, x, y in zip(line, xs, ys, strict=True):
                ax.annotate(
                    f"{r['ttl_s']:g}s",
                    (x, y),
                    fontsize=7,
                    xytext=(3, -9),
                    textcoords="offset points",
                )
    ax.set_xscale("log")
    ax.set_xlabel("D's retained block-hours (log)")
    ax.set_ylabel("% of reusable tokens read back")
    ax.set_title(title or "Reuse against retained KV, by decoder_kv_blocks_ttl")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_preset_curves(curves: Mapping[str, Mapping[str, Any]], path: Path) -> Path:
    """Per preset: recompute and reuse TTFT against context length (the cost model's curve,
    turns measured through the router and simulator processes, the published points)."""
    plt = _pyplot()
    names = list(curves)
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.3), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        c = curves[name]
        for key, color, label in (
            ("recompute", "#7f7f7f", "recompute (no reuse)"),
            ("reuse", "#1f77b4", "reuse (90% pulled from D)"),
        ):
            ax.plot(c["model_x"], c[f"model_{key}_ms"], color=color, label=f"{label}: model")
            measured = c.get(f"measured_{key}")
            if measured:
                ax.scatter(
                    [m[0] for m in measured],
                    [m[1] for m in measured],
                    color=color,
                    marker="x",
                    label=f"{label}: simulator P/D turn",
                )
            published = c.get(f"published_{key}")
            if published:
                ax.scatter(
                    [p[0] for p in published],
                    [p[1] for p in published],
                    facecolors="none",
                    edgecolors="black",
                    s=70,
                    label="published (vLLM blog, P5en)" if key == "recompute" else None,
                )
        ax.set_title(name)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)
