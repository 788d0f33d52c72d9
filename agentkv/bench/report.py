"""What a replay found: per-policy summaries, files (JSON, CSV, markdown) and a terminal table.

**Compute saved** and **latency saved** are kept apart: compute saved counts prompt tokens
prefill did not compute (and how many of those ran on KV of other tokens); latency saved is the
TTFT difference against the no-reuse baseline on the same turns (the simulator's modelled TTFT,
which does not depend on this machine's load, and the wall-clock TTFT measured here).
"""

from __future__ import annotations

import csv
import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from agentkv.bench.replay_records import TurnRecord

__all__ = [
    "KINDS",
    "SHORTFALL_CAUSES",
    "SHORTFALL_NOTE",
    "PolicySummary",
    "shortfall_cause",
    "shortfall_rows",
    "summarize",
    "write_csv",
    "write_json",
]

KINDS = ("append", "strip", "rewrite")
_POLICY_NAMES = {
    "none": "no reuse (baseline)",
    "unverified": "unverified conversation-id reuse",
    "agentkv": "agentkv verified reuse",
    "lease": "agentkv + retention leases",
}


def policy_name(policy: str) -> str:
    return _POLICY_NAMES.get(policy, policy)


def _pct(part: float, whole: float) -> float | None:
    return 100.0 * part / whole if whole else None


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class KindSummary:
    turns: int = 0
    turns_within_ttl: int = 0
    ideal_tokens: int = 0
    useful_reused_tokens: int = 0
    reused_tokens: int = 0
    wrong_kv_tokens: int = 0
    wrong_kv_turns: int = 0

    @property
    def captured_pct(self) -> float | None:
        return _pct(self.useful_reused_tokens, self.ideal_tokens)


@dataclass
class PolicySummary:
    """One policy's totals over the replayed turns."""

    policy: str
    sessions: int = 0
    turns: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    ideal_tokens: int = 0
    """Reusable tokens D held for turns whose gap is within the router's TTL."""
    beyond_ttl_tokens: int = 0
    """Tokens D held that matched the next prompt, on turns whose gap was too long."""
    reusable_tokens: int = 0
    """The ideal whatever the gap: what any retention policy could let prefill read (the same
    for every policy on the same prompts)."""
    useful_reused_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    wrong_kv_tokens: int = 0
    wrong_kv_turns: int = 0
    expired: int = 0
    decisions: dict[str, int] = field(default_factory=dict)
    retained_block_s: float = 0.0
    retained_to_ttl_block_s: float = 0.0
    """The part held until D's TTL (next turn too late, or none)."""
    by_kind: dict[str, KindSummary] = field(default_factory=dict)
    model_ttft_ms: list[float] = field(default_factory=list, repr=False)
    wall_ttft_ms: list[float] = field(default_factory=list, repr=False)
    latency_saved_ms: float | None = None
    """Mean modelled TTFT saved per turn against the baseline (same turns)."""
    wall_latency_saved_ms: float | None = None
    ttft_saved_pct: float | None = None
    compute_saved_pct: float | None = None
    """Reused tokens as a share of all prompt tokens."""
    measured: dict[str, float] = field(default_factory=dict)
    """Simulator counters scraped around the run (real seconds)."""
    shortfall: dict[str, dict[str, int]] = field(default_factory=dict)
    """Ideal tokens not read back, by cause (:data:`SHORTFALL_CAUSES`): ``turns``, ``tokens``."""
    ideal_generated_tokens: int | None = None
    """Raw clients: the ideal with every answer as generated, changed ones too (the part above
    ``ideal_tokens`` no client can be given: see ``TurnRecord.ideal_generated_tokens``)."""

    @property
    def captured_pct(self) -> float | None:
        return _pct(self.useful_reused_tokens, self.ideal_tokens)

    @property
    def lost_pct(self) -> float | None:
        """Reusable tokens (whatever the gap) not read back correctly: what retention lost."""
        return _pct(self.reusable_tokens - self.useful_reused_tokens, self.reusable_tokens)

    def to_dict(self) -> dict[str, Any]:
        data = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("model_ttft_ms", "wall_ttft_ms", "by_kind")
        }
        data["captured_pct"] = self.captured_pct
        data["lost_pct"] = self.lost_pct
        data["by_kind"] = {
            k: {**asdict(v), "captured_pct": v.captured_pct} for k, v in self.by_kind.items()
        }
        data["model_ttft_p50_ms"] = _quantile(self.model_ttft_ms, 0.5)
        data["model_ttft_p90_ms"] = _quantile(self.model_ttft_ms, 0.9)
        data["model_ttft_mean_ms"] = (
            statistics.fmean(self.model_ttft_ms) if self.model_ttft_ms else None
        )
        data["wall_ttft_p50_ms"] = _quantile(self.wall_ttft_ms, 0.5)
        return data


SHORTFALL_CAUSES = ("expired", "wrong-kv", "trimmed", "held-short", "other")
"""``expired``: the handle had expired though the trace's gap was within the TTL (the answer
before came late on a loaded machine); ``wrong-kv``: KV of other tokens; ``trimmed``: the pull
was cut below the ideal (``trim_cause``); ``held-short``: the router used all D held, and D
held less of this prompt than the ideal (an earlier turn prompted otherwise than the ideal's
ids); ``other``: a decision that read nothing back (recompute, ...)."""


def shortfall_cause(rec: TurnRecord) -> str | None:
    """Why ``rec`` read back less than its ideal (:data:`SHORTFALL_CAUSES`), or None."""
    if rec.useful_reuse >= rec.ideal_tokens:
        return None
    if rec.decision in ("expired", "miss"):
        return "expired"
    if rec.wrong_kv_tokens:
        return "wrong-kv"
    if rec.trim_cause:
        return "trimmed"
    if rec.decision == "pull":
        return "held-short"
    return "other"


def summarize(
    records: Iterable[TurnRecord], measured: Mapping[str, Mapping[str, float]] | None = None
) -> dict[str, PolicySummary]:
    """Per-policy summaries; latency saved is against the ``none`` policy on the same turns."""
    out: dict[str, PolicySummary] = {}
    by_key: dict[tuple[str, str, int], TurnRecord] = {}
    sessions: dict[str, set[str]] = {}
    for r in records:
        s = out.setdefault(r.policy, PolicySummary(r.policy))
        sessions.setdefault(r.policy, set()).add(r.session)
        by_key[(r.policy, r.session, r.turn)] = r
        s.turns += 1
        if r.error:
            s.errors += 1
            continue
        s.decisions[r.decision] = s.decisions.get(r.decision, 0) + 1
        s.prompt_tokens += r.prompt_tokens
        s.ideal_tokens += r.ideal_tokens
        if r.ideal_generated_tokens is not None:
            s.ideal_generated_tokens = (s.ideal_generated_tokens or 0) + r.ideal_generated_tokens
        cause = shortfall_cause(r)
        if cause is not None:
            lost = s.shortfall.setdefault(cause, {"turns": 0, "tokens": 0})
            lost["turns"] += 1
            lost["tokens"] += r.ideal_tokens - r.useful_reuse
        s.reusable_tokens += r.reusable_tokens
        if not r.within_ttl and r.turn > 0:
            s.beyond_ttl_tokens += r.lcp_tokens
        s.useful_reused_tokens += r.useful_reuse
        s.reused_tokens += r.reused_tokens
        s.recomputed_tokens += r.recomputed_tokens
        wrong = r.wrong_kv_tokens or 0
        s.wrong_kv_tokens += wrong
        s.wrong_kv_turns += wrong > 0
        s.expired += r.expired
        s.retained_block_s += r.retained_block_s
        if r.held_to_ttl:
            s.retained_to_ttl_block_s += r.retained_block_s
        if r.model_ttft_ms is not None:
            s.model_ttft_ms.append(r.model_ttft_ms)
        if r.wall_ttft_ms is not None:
            s.wall_ttft_ms.append(r.wall_ttft_ms)
        if r.kind in KINDS:
            k = s.by_kind.setdefault(r.kind, KindSummary())
            k.turns += 1
            k.turns_within_ttl += r.within_ttl
            k.ideal_tokens += r.ideal_tokens
            k.useful_reused_tokens += r.useful_reuse
            k.reused_tokens += r.reused_tokens
            k.wrong_kv_tokens += wrong
            k.wrong_kv_turns += wrong > 0
    for policy, s in out.items():
        s.sessions = len(sessions[policy])
        s.compute_saved_pct = _pct(s.reused_tokens, s.prompt_tokens)
        if measured and policy in measured:
            s.measured = dict(measured[policy])
        if policy == "none" or "none" not in out:
            continue
        model: list[float] = []
        wall: list[float] = []
        base_total = 0.0
        for (p, session, turn), r in by_key.items():
            base = by_key.get(("none", session, turn))
            if p != policy or base is None or r.error or base.error:
                continue
            if r.model_ttft_ms is not None and base.model_ttft_ms is not None:
                model.append(base.model_ttft_ms - r.model_ttft_ms)
                base_total += base.model_ttft_ms
            if r.wall_ttft_ms is not None and base.wall_ttft_ms is not None:
                wall.append(base.wall_ttft_ms - r.wall_ttft_ms)
        s.latency_saved_ms = statistics.fmean(model) if model else None
        s.ttft_saved_pct = _pct(sum(model), base_total)
        s.wall_latency_saved_ms = statistics.fmean(wall) if wall else None
    return out


SHORTFALL_NOTE = (
    "Ideal tokens not read back correctly, by cause: tokens (turns; share of the ideal). "
    "*expired*: the handle had expired though the trace's gap was within the TTL (the turn "
    "before ended late on this machine); *trimmed*: the pull was cut below the ideal "
    "(`trim_cause`); *held-short*: the whole handle was used, and D held less of this "
    "prompt than the ideal (an earlier turn was prompted otherwise than the ideal's ids). "
    "A raw client's ideal prompts every answer the client sent back unchanged as the model "
    "generated it and every other message as sent; the last column is what it would add "
    "with the answers the client changed as generated too (their tool calls, which the "
    "template does not render): no client can be given those."
)


def shortfall_rows(summaries: Mapping[str, PolicySummary]) -> list[list[str]]:
    """The shortfall table (header first; no rows when nothing fell short): the ideal tokens
    not read back, by cause, and (raw clients) what the ideal would add with changed answers
    as generated. The baseline (``none``) is left out."""
    ran = [(p, s) for p, s in summaries.items() if p != "none"]
    if not any(s.shortfall or s.ideal_generated_tokens is not None for _, s in ran):
        return []
    rows = [
        ["policy", "ideal", *SHORTFALL_CAUSES, "changed answers as generated (not in the ideal)"]
    ]
    for policy, s in ran:
        cells = [policy_name(policy), f"{s.ideal_tokens:,}"]
        for cause in SHORTFALL_CAUSES:
            lost = s.shortfall.get(cause)
            share = _pct(lost["tokens"], s.ideal_tokens) if lost else None
            cells.append(
                "–"
                if lost is None
                else f"{lost['tokens']:,} ({lost['turns']}; {share or 0.0:.2f}%)"
            )
        extra = s.ideal_generated_tokens
        cells.append("–" if extra is None else f"+{extra - s.ideal_tokens:,}")
        rows.append(cells)
    return rows


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def write_csv(path: Path, records: Sequence[TurnRecord]) -> None:
    names = [f.name for f in fields(TurnRecord)]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for r in records:
            writer.writerow(r.to_dict())
