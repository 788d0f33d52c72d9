"""Trace loaders on the real files in shared/traces, and on small hand-made ones."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from agentkv.bench.traces import (
    TraceError,
    Turn,
    detect_format,
    ideal_reuse,
    iter_claude_code,
    load_trace,
    transition,
)
from tests._support.bench import CLAUDE_CODE, MOONCAKE, need


def test_claude_code_sessions_from_the_real_file():
    sessions = load_trace(need(CLAUDE_CODE), limit=5)
    # trace_0005 is one of the 29 files too large to copy (SOURCES.md)
    assert [s.id for s in sessions] == [
        "trace_0001",
        "trace_0002",
        "trace_0003",
        "trace_0004",
        "trace_0006",
    ]
    first = sessions[0]
    assert first.source == "claude-code" and first.block_size == 64
    assert first.system_tokens == 12974 + 4243  # tool_tokens + system_tokens of trace_0001
    assert first.turns[0].kind == "first" and first.turns[0].gap_s == 0
    assert first.turns[0].input_tokens == 71175 and first.turns[0].output_tokens == 169
    for s in sessions:
        for a, b in zip(s.turns, s.turns[1:], strict=False):
            assert abs(len(b.block_ids) - math.ceil(b.input_tokens / 64)) <= 1
            assert b.kind in ("tool_result", "user_text", "continue")
            # the trace's own timing identity: t[i] = t[i-1] + api_time[i-1] + think_time[i]
            assert a.api_s is not None
            assert b.t_s == pytest.approx(a.t_s + a.api_s + b.gap_s, abs=2.0)


def test_claude_code_transitions_match_the_survey():
    """Most turns append to the previous prompt; some strip reasoning or rewrite history."""
    kinds: dict[str, int] = {}
    shared = total = 0
    for s in load_trace(need(CLAUDE_CODE), limit=8):
        for a, b in zip(s.turns, s.turns[1:], strict=False):
            step = transition(a, b, 64)
            kinds[step.kind] = kinds.get(step.kind, 0) + 1
            shared += ideal_reuse(a, step, b.input_tokens, 16)
            total += b.input_tokens
    assert kinds["append"] > 0.85 * sum(kinds.values())
    assert kinds.get("rewrite", 0) > 0
    assert 0.9 < shared / total < 1.0  # the survey: 96 % of prompt tokens repeat the last turn


def test_claude_code_subagents_are_sessions_when_asked():
    path = need(CLAUDE_CODE)
    with_subs = []
    for s in iter_claude_code(path, include_subagents=True):
        if "/" in s.id:
            with_subs.append(s)
            break
    assert with_subs, "the real trace has sub-agents"
    sub = with_subs[0]
    assert sub.namespace == sub.id.split("/")[0] and sub.turns


def test_mooncake_sessions_are_inferred_from_hash_prefixes():
    sessions = load_trace(need(MOONCAKE))
    assert sum(len(s.turns) for s in sessions) == 12031
    multi = [s for s in sessions if len(s.turns) > 1]
    assert 1500 < len(multi) < 2500  # the survey inferred 1,981 chains of two turns or more
    for s in multi[:200]:
        assert s.block_size == 512 and s.namespace == "global"
        for a, b in zip(s.turns, s.turns[1:], strict=False):
            full = a.input_tokens // 512
            assert full >= 2 and b.block_ids[:full] == a.block_ids[:full]
            assert b.input_tokens > a.input_tokens and b.gap_s >= 0
            assert transition(a, b, 512).kind in ("append", "strip")


def test_vllm_multi_turn_json(tmp_path: Path):
    path = tmp_path / "conversations.json"
    path.write_text(
        json.dumps(
            [
                {
                    "id": "c1",
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "What is KV cache reuse?"},
                        {"role": "assistant", "content": "Keeping attention state."},
                        {"role": "user", "content": "And why verify it?"},
                        {"role": "assistant", "content": "So a rewrite never reads stale KV."},
                    ],
                }
            ]
        )
    )
    assert detect_format(path) == "vllm-multi-turn"
    (s,) = load_trace(path)
    assert s.source == "vllm-multi-turn" and len(s.turns) == 2
    assert s.turns[1].user_text == "And why verify it?"
    assert s.turns[1].output_text == "So a rewrite never reads stale KV."
    assert s.turns[1].input_tokens > s.turns[0].input_tokens + s.turns[0].output_tokens - 1


def test_formats_are_detected_and_bad_files_named(tmp_path: Path, small_trace: Path):
    assert detect_format(small_trace) == "claude-code"
    if MOONCAKE.exists():
        assert detect_format(MOONCAKE) == "mooncake"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hello": 1}\n')
    with pytest.raises(TraceError, match="unknown trace format"):
        detect_format(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"id": "x", "requests": [{"t": 0}]}\n')
    with pytest.raises(TraceError, match=r"broken.jsonl:1: request 0"):
        load_trace(broken)


def _turn(n: int, out: int, ids: list[int], reasoning: bool = False) -> Turn:
    return Turn(0.0, 0.0, n, out, tuple(ids), reasoning=reasoning)


def test_transition_rules_and_ideal_reuse_by_hand():
    prev = _turn(256, 40, [1, 2, 3, 4], reasoning=True)  # 4 full blocks of 64
    # grows by 40 (the output) + 100 new: an append; D holds 256 + 40 - 1 = 295, all repeated
    cur = _turn(396, 10, [1, 2, 3, 4, 5, 6, 7])
    step = transition(prev, cur, 64)
    assert (step.kind, step.resent_output, step.new_tokens) == ("append", 40, 100)
    assert ideal_reuse(prev, step, cur.input_tokens, 16) == 295
    # grows by 20 < 40 with reasoning: the reasoning (all but 19 tokens) was not resent
    cur = _turn(276, 10, [1, 2, 3, 4, 9])
    step = transition(prev, cur, 64)
    assert (step.kind, step.resent_output, step.stripped_output) == ("strip", 19, 21)
    assert ideal_reuse(prev, step, cur.input_tokens, 16) == 256
    # shares 2 of 4 full blocks: a rewrite from block 3
    cur = _turn(300, 10, [1, 2, 8, 9, 10])
    step = transition(prev, cur, 64)
    assert (step.kind, step.shared_tokens) == ("rewrite", 128)
    assert ideal_reuse(prev, step, cur.input_tokens, 16) == 128
