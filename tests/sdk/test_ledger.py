"""The conversation ledger's rules (pure, no server)."""

from __future__ import annotations

import json

import pytest

from agentkv._exceptions import ConversationError, StateError
from agentkv._ledger import Ledger, TurnResult
from agentkv.protocol import HEADER_CONVERSATION_ID, HEADER_EPOCH


def answer(ledger: Ledger, prompt: list[int], out: list[int], **message) -> None:
    msg = {"role": "assistant", "content": "ok", **message}
    result = TurnResult(msg, prompt, out, "stop", {"prompt_tokens": len(prompt)}, {}, 0.01)
    ledger.absorb(prompt, result, None)


def test_request_carries_id_epoch_session_and_exact_ids():
    ledger = Ledger(id="c1", model="m", system="s")
    ledger.add_user("hi")
    kw = ledger.request([1, 2, 3], {"temperature": 0, "extra_body": {"top_k": 5}})
    assert kw["model"] == "m" and kw["temperature"] == 0
    assert kw["extra_headers"] == {HEADER_CONVERSATION_ID: "c1", HEADER_EPOCH: "0"}
    assert kw["extra_body"] == {
        "top_k": 5,
        "session_id": "c1",
        "return_token_ids": True,
        "kv_transfer_params": {"prompt_token_ids": [1, 2, 3]},
    }
    assert [m["role"] for m in kw["messages"]] == ["system", "user"]


def test_a_client_cannot_smuggle_a_transfer_handle():
    ledger = Ledger(model="m", mode="messages")
    ledger.add_user("hi")
    kw = ledger.request(None, {"extra_body": {"kv_transfer_params": {"remote_block_ids": [[1]]}}})
    assert "kv_transfer_params" not in kw["extra_body"]


@pytest.mark.parametrize("field", ["messages", "model"])
def test_owned_fields_are_rejected(field):
    ledger = Ledger(model="m")
    ledger.add_user("hi")
    with pytest.raises(ConversationError, match=field):
        ledger.request(None, {field: "x"})


def test_streaming_requests_usage():
    ledger = Ledger(model="m")
    ledger.add_user("hi")
    assert ledger.request(None, {"stream": True})["stream_options"] == {"include_usage": True}


def test_render_jobs_full_then_append():
    ledger = Ledger(model="m")
    with pytest.raises(ConversationError, match="Nothing to send"):
        ledger.render_job()
    ledger.add_user("hi")
    assert ledger.render_job().kind == "full"
    answer(ledger, [1, 2], [3, 4])
    with pytest.raises(ConversationError, match="Nothing to send"):
        ledger.render_job()
    ledger.add_user("more")
    job = ledger.render_job()
    assert job.kind == "append" and job.last_output_ids == [3, 4]
    assert [m["content"] for m in job.messages] == ["more"]
    assert ledger.next_prompt(job, [9]) == [1, 2, 3, 4, 9]


def test_tool_results_must_answer_an_open_call():
    ledger = Ledger(model="m")
    ledger.add_user("weather?")
    call = {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
    answer(ledger, [1], [2], tool_calls=[call])
    before = ledger.messages
    with pytest.raises(ConversationError, match="call_2"):
        ledger.add_tool_result("call_2", "sunny")
    assert ledger.messages == before
    ledger.add_tool_result("call_1", "sunny")
    with pytest.raises(ConversationError, match="already answered"):
        ledger.add_tool_result("call_1", "again")


def test_rewrite_reports_surviving_prefix_and_bumps_epoch():
    ledger = Ledger(model="m", system="s")
    ledger.add_user("q1")
    answer(ledger, [1, 2, 3], [4, 5])  # messages 0..2 -> ids[:5]
    ledger.add_user("q2")
    answer(ledger, [1, 2, 3, 4, 5, 6, 7], [8, 9])  # messages 0..4 -> ids[:9]
    msgs = ledger.messages
    report = ledger.rewrite([*msgs[:3], {"role": "user", "content": "summary"}], "compact")
    assert report.epoch == 1 and report.surviving_messages == 3
    assert report.surviving_tokens == 5 and report.dropped_tokens == 4
    assert ledger.render_job().kind == "full"
    assert ledger.request(None, {})["extra_headers"][HEADER_EPOCH] == "1"


def test_rewrite_rejects_empty_and_leaves_history():
    ledger = Ledger(model="m", system="s")
    with pytest.raises(ConversationError):
        ledger.rewrite([], "x")
    assert ledger.messages == [{"role": "system", "content": "s"}] and ledger.epoch == 0


def test_without_reasoning_and_compacted():
    ledger = Ledger(model="m", system="s")
    ledger.add_user("q1")
    answer(ledger, [1], [2], reasoning="think", content="<think>x</think>a1")
    ledger.add_user("q2")
    answer(ledger, [1, 2, 3], [4], content="a2")
    stripped = ledger.without_reasoning()
    assert "reasoning" not in stripped[2] and stripped[2]["content"] == "a1"
    compact = ledger.compacted("we talked", keep_last=2)
    assert [m["role"] for m in compact] == ["system", "user", "user", "assistant"]
    assert "we talked" in compact[1]["content"]


def test_classify_tolerates_lossy_frameworks():
    ledger = Ledger(model="m")
    ledger.add_user("q")
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    answer(ledger, [1], [2], reasoning="r", tool_calls=[call])
    lossy = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
            ],
        },
    ]
    assert ledger.classify(lossy) == "same"
    assert (
        ledger.classify([*lossy, {"role": "tool", "tool_call_id": "c", "content": "x"}]) == "append"
    )
    assert ledger.classify([{"role": "user", "content": "other"}]) == "rewrite"


def test_state_round_trip_is_json_and_exact():
    ledger = Ledger(id="c9", model="m", system="s")
    ledger.add_user("q")
    answer(ledger, [1, 2], [3])
    ledger.add_user("pending")
    state = json.loads(json.dumps(ledger.to_state()))
    again = Ledger.from_state(state)
    assert again.to_state() == ledger.to_state()
    assert again.render_job().kind == "append"


@pytest.mark.parametrize(
    "state",
    [{}, {"version": 99}, {"version": 1, "id": "x"}, {"version": 1, "id": "x", "epoch": "a"}],
    ids=["empty", "version", "missing", "types"],
)
def test_bad_state_is_a_state_error(state):
    with pytest.raises(StateError):
        Ledger.from_state(state)


def test_reasoning_is_sent_under_both_names_and_the_history_keeps_its_own():
    ledger = Ledger(model="m", mode="messages")
    ledger.add_user("hi")
    answer(ledger, [1, 2], [3], reasoning="because")
    ledger.add_user("and?")
    sent = ledger.request(None, {})["messages"]
    assert sent[1] == {
        "role": "assistant",
        "content": "ok",
        "reasoning": "because",
        "reasoning_content": "because",
    }
    assert ledger.messages[1] == {"role": "assistant", "content": "ok", "reasoning": "because"}
    assert sent[0] == ledger.messages[0] and sent[2] == ledger.messages[2]
