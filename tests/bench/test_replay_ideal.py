"""A raw client's ideal (``agentkv bench replay --client chat|messages|responses``): answers the
client sent back unchanged as the model generated them, answers it changed as it sent them; and
why a turn read back less than its ideal. Table tests, no processes."""

from __future__ import annotations

import pytest

from agentkv.bench.replay_records import TurnRecord
from agentkv.bench.report import shortfall_cause, shortfall_rows, summarize
from agentkv.bench.wire import Answer, Message, ToolCall, same_answer, shadow, strip_reasoning

CALL = ToolCall("call_1", "Bash", '{"command": "ls"}')
RAW_CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>'


def _answer(text: str, reasoning: str | None = None) -> Message:
    return Answer(text=text, reasoning=reasoning, calls=[CALL]).message()


def test_raw_text_is_what_the_simulator_writes():
    assert _answer(" one two").raw == " one two" + RAW_CALL
    assert _answer(" one", reasoning="").raw == "<think></think> one" + RAW_CALL


@pytest.mark.parametrize(
    ("before", "after", "same"),
    [
        (_answer(" a"), _answer(" a"), True),
        # an empty thinking block is no reasoning (the router's digest says the same)
        (_answer(" a", reasoning=""), _answer(" a"), True),
        (_answer(" a", reasoning="why"), _answer(" a"), False),
        (_answer("<think>why</think> a"), _answer(" a"), False),
        (_answer(" a"), Message("assistant", " a"), False),  # its tool call dropped
    ],
)
def test_same_answer(before: Message, after: Message, same: bool):
    assert same_answer(before, after) is same


def test_shadow_keeps_unchanged_answers_as_generated_and_changed_ones_as_sent():
    first = _answer(" a")
    second = _answer("<think>why</think> b")
    history = [
        Message("system", "sys"),
        Message("user", "go"),
        first,
        Message("tool", "out", call_id=CALL.id),
        second,
        Message("user", "next"),
    ]
    stripped = strip_reasoning(history)
    returned = [
        r if r is not None and same_answer(r, m) else None
        for m, r in zip(stripped, [None, None, first, None, second, None], strict=True)
    ]
    assert returned[2] is first and returned[4] is None
    out = shadow(stripped, returned)
    # the unchanged answer: the text the model generated, its tool call included
    assert out[2] == {"role": "assistant", "content": " a" + RAW_CALL}
    # the changed one as the client sends it: its text and its call, for the template
    assert out[4] == {
        "role": "assistant",
        "content": "b",  # the think block cut out with the space after it
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "Bash", "arguments": '{"command": "ls"}'},
            }
        ],
    }
    assert out[3] == {"role": "tool", "content": "out", "tool_call_id": "call_1"}
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool", "assistant", "user"]
    # the changed answer as generated less what the client cut out (ideal_generated_tokens)
    generated = shadow(stripped, returned, changed_as_generated=True)
    assert generated[4] == {"role": "assistant", "content": "b" + RAW_CALL}
    assert generated[:4] == out[:4] and generated[5:] == out[5:]
    # without ``returned`` every answer is as generated (the stripped raw text)
    assert shadow(stripped)[4] == generated[4]


def test_an_answer_whose_empty_thinking_block_was_dropped_stays_as_generated():
    """Messages: every answer comes with an empty thinking block; a strip drops it, and the
    answer still says the same (the router keeps its ids, ``<think></think>`` included)."""
    answer = _answer(" a", reasoning="")
    history = [Message("user", "go"), answer, Message("user", "next")]
    stripped = strip_reasoning(history)
    assert stripped[1].reasoning is None and stripped[1].raw == "a" + RAW_CALL
    returned = [None, answer if same_answer(answer, stripped[1]) else None, None]
    assert shadow(stripped, returned)[1]["content"] == "<think></think> a" + RAW_CALL


def _rec(**fields: object) -> TurnRecord:
    base: dict[str, object] = {
        "policy": "agentkv",
        "session": "s",
        "turn": 3,
        "kind": "append",
        "gap_trace_s": 5.0,
        "gap_real_s": 0.1,
        "within_ttl": True,
        "trace_input_tokens": 100,
        "trace_output_tokens": 10,
        "decision": "pull",
        "ideal_tokens": 1000,
        "reused_tokens": 1000,
        "wrong_kv_tokens": 0,
    }
    return TurnRecord(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "cause"),
    [
        ({}, None),
        ({"reused_tokens": 1200}, None),  # more than the ideal: capped, nothing short
        ({"ideal_tokens": 0, "reused_tokens": 0, "decision": "miss"}, None),
        ({"reused_tokens": 0, "decision": "expired"}, "expired"),
        ({"reused_tokens": 0, "decision": "miss"}, "expired"),
        ({"wrong_kv_tokens": 40}, "wrong-kv"),
        ({"reused_tokens": 960, "trim_cause": "drift"}, "trimmed"),
        ({"reused_tokens": 981}, "held-short"),
        ({"reused_tokens": 0, "decision": "recompute"}, "other"),
    ],
)
def test_shortfall_cause(fields: dict[str, object], cause: str | None):
    assert shortfall_cause(_rec(**fields)) == cause


def test_shortfall_by_cause_in_the_summary():
    records = [
        _rec(turn=1),
        _rec(turn=2, reused_tokens=960, trim_cause="drift", ideal_generated_tokens=1016),
        _rec(turn=3, reused_tokens=981, ideal_generated_tokens=1000),
        _rec(turn=4, reused_tokens=0, decision="expired"),
        _rec(turn=5, reused_tokens=962),
    ]
    s = summarize(records)["agentkv"]
    assert s.shortfall == {
        "trimmed": {"turns": 1, "tokens": 40},
        "held-short": {"turns": 2, "tokens": 19 + 38},
        "expired": {"turns": 1, "tokens": 1000},
    }
    assert s.ideal_generated_tokens == 2016 and s.ideal_tokens == 5000
    assert s.useful_reused_tokens == 5000 - 40 - 57 - 1000
    head, row = shortfall_rows({"agentkv": s})
    assert head[2:7] == ["expired", "wrong-kv", "trimmed", "held-short", "other"]
    assert row[2] == "1,000 (1; 20.00%)" and row[4] == "40 (1; 0.80%)" and row[6] == "–"
    # the SDK's rows have no generated ideal: no column figure, and nothing short, no table
    assert shortfall_rows(summarize([_rec()])) == []
