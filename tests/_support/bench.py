"""Shared pieces of the benchmark tests: the real traces and a small hand-made trace."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
CLAUDE_CODE = TRACES / "weka_claude_code" / "traces.jsonl.xz"
MOONCAKE = TRACES / "mooncake_fast25" / "conversation_trace.jsonl"

# Time runs 200 times faster in the shared deployment: the router's TTL (450 s) is 2.25 s.
TIME_SCALE = 0.005


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared traces are not checked out)")
    return path


def _session(sid: str, system: int, steps: list[tuple[str, int, int, float, bool, int]]) -> Any:
    """A Claude Code session: (kind, in, out, gap, output has reasoning, shared blocks)."""
    counter = itertools.count(1)
    reqs: list[dict[str, Any]] = []
    t = 0.0
    for kind, n, out, gap, reasoning, shared in steps:
        blocks = -(-n // 64)
        if not reqs:
            ids = [next(counter) for _ in range(blocks)]
        else:
            keep = reqs[-1]["in"] // 64 if kind == "append" else shared
            ids = reqs[-1]["hash_ids"][:keep] + [next(counter) for _ in range(blocks - keep)]
        t += gap
        reqs.append(
            {
                "t": t,
                "type": "n",
                "in": n,
                "out": out,
                "hash_ids": ids,
                "input_types": ["tool_result"] if reqs else ["text"],
                "output_types": ["thinking", "text"] if reasoning else ["text"],
                "stop": "tool_use",
                "api_time": 1.0,
                "think_time": gap,
            }
        )
        t += 1.0
    return {
        "id": sid,
        "models": ["claude-test"],
        "block_size": 64,
        "hash_id_scope": "local",
        "tool_tokens": system // 2,
        "system_tokens": system - system // 2,
        "requests": reqs,
    }


SMALL_SESSIONS = [
    _session(
        "trace_a",
        1024,
        [
            ("first", 2048, 128, 0, False, 0),
            ("append", 2432, 200, 5, True, 0),  # its answer reasons
            ("append", 2532, 64, 3, False, 0),  # grows by 100 < 200: the reasoning is stripped
            ("rewrite", 1500, 64, 4, False, 16),  # compaction: the 1,024-token system prompt stays
            ("append", 1800, 64, 500, False, 0),  # beyond the router's 450 s TTL
            ("append", 2000, 32, 2, False, 0),
        ],
    ),
    _session(
        "trace_b",
        0,
        [
            ("first", 700, 50, 0, False, 0),
            ("append", 900, 50, 1, False, 0),
            ("append", 1100, 50, 2, False, 0),
            ("append", 1300, 40, 1, False, 0),
        ],
    ),
]
"""trace_a: append, strip, rewrite, append (expired), append; trace_b: three appends."""
