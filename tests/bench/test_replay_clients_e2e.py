"""`agentkv bench replay --client sdk|chat|messages|responses` on real processes: the `local`
profile's simulated P and D and agentkv's router, with a recording proxy in front of the router
(tests/bench/recording_proxy.py) that keeps every request the router received.

Each client replays the small trace (an append, a reasoning strip, a compaction, a gap beyond
the router's TTL, plain appends; tool rounds throughout): every request is answered 200, every
turn's receipt is read back (decision, reused and verified tokens, trim cause; the API's own
usage agrees with the receipt), no turn runs on wrong KV, and the raw clients send nothing of
agentkv's: no agentkv header, no token ids, no agentkv body field but the simulator's script;
the router names their conversations from the harness's own signal (its
``conversation_sources`` counter)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from agentkv.bench.deploy import Stack
from agentkv.cli import app
from agentkv.protocol import BODY_SIM_SCRIPT, RouterMetric
from tests._support.bench import CLAUDE_CODE, TIME_SCALE, need
from tests._support.recording_proxy import Received, Recorder, recording_proxy

pytestmark = pytest.mark.e2e

API = {
    "sdk": "/v1/chat/completions",
    "chat": "/v1/chat/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}
SOURCE = {"sdk": "agentkv", "chat": "session", "messages": "claude-code", "responses": "codex"}
SESSION_HEADER = {
    "chat": "x-session-id",
    "messages": "x-claude-code-session-id",
    "responses": "session-id",
}
# agentkv's own body fields and headers (docs/router.md): what the SDK sends and a raw client
# must not
AGENTKV_FIELDS = {"conversation_id", "kv_transfer_params", "return_token_ids"}
AGENTKV_HEADERS = ("x-agentkv-", "x-conversation-id")


@pytest.fixture(scope="module")
def proxy(stack: Stack) -> Iterator[tuple[str, Recorder]]:
    with recording_proxy(stack.base_url.removesuffix("/v1")) as (url, rec):
        yield url + "/v1", rec


def _sources(stack: Stack) -> dict[str, float]:
    text = httpx.get(stack.base_url.removesuffix("/v1") + "/metrics", trust_env=False).text
    prefix = f"{RouterMetric.CONVERSATION_SOURCES}_total"
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix + "{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            out[source] = float(line.rsplit(" ", 1)[1])
    assert out or f"# HELP {RouterMetric.CONVERSATION_SOURCES}" in text, text[:500]
    return out


def _replay(stack: Stack, endpoint: str, trace: Path, out: Path, client: str, *extra: str) -> Any:
    args = [
        "bench", "replay", str(trace), "--endpoint", endpoint, "--client", client,
        "--router-ttl", str(stack.router_ttl_s * TIME_SCALE),
        "--decoder-ttl", str(stack.decoder_ttl_real_s),
        "--time-scale", str(TIME_SCALE), "--concurrency", "2",
        "--out", str(out), "--no-progress", "--no-plots", *extra,
    ]  # fmt: skip
    result = CliRunner().invoke(app, args, terminal_width=200)
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "turns.json").read_text())
    for r in rows:
        assert r["error"] is None, r
    summary = json.loads((out / "summary.json").read_text())
    return sorted(rows, key=lambda r: (r["policy"], r["session"], r["turn"])), summary


def _api_requests(seen: list[Received], client: str) -> list[Received]:
    return [r for r in seen if r.method == "POST" and r.path.split("?")[0] == API[client]]


def _check_raw_wire(client: str, requests: list[Received]) -> None:
    """What a raw client sent: its harness's shape and session signal, nothing of agentkv's."""
    sessions = set()
    for r in requests:
        assert r.status == 200, (r.path, r.status)
        assert not [h for h in r.headers if h.startswith(AGENTKV_HEADERS)], r.headers
        body = r.json()
        assert not AGENTKV_FIELDS & set(body), sorted(body)
        # the one agentkv-named field is the simulator's script (vLLM ignores it)
        assert [k for k in body if k.startswith("agentkv")] == [BODY_SIM_SCRIPT]
        assert "prompt_token_ids" not in json.dumps(body)
        sessions.add(r.headers[SESSION_HEADER[client]])
        if client == "chat":
            assert "session_id" not in body and body["stream"] is True
        elif client == "messages":
            assert r.path == "/v1/messages?beta=true"
            user = json.loads(body["metadata"]["user_id"])
            assert user["session_id"] == r.headers["x-claude-code-session-id"]
            assert body["thinking"] == {"type": "disabled"}
        else:
            assert body["store"] is False and "previous_response_id" not in body
            assert body["prompt_cache_key"] == r.headers["session-id"]
    assert len(sessions) == 2  # one per session of the trace, every turn
    bodies = [json.dumps(r.json()) for r in requests]
    # tool rounds in the API's own form, the system prompt as the API carries it
    if client == "chat":
        assert any('"role": "tool"' in b and '"tool_calls"' in b for b in bodies)
    elif client == "messages":
        assert any('"tool_result"' in b and '"tool_use"' in b for b in bodies)
        assert any(isinstance(r.json().get("system"), list) for r in requests)
    else:
        assert any('"function_call_output"' in b and '"function_call"' in b for b in bodies)
        assert any("instructions" in r.json() for r in requests)


@pytest.fixture(scope="module")
def sdk_rows(
    stack: Stack, proxy: tuple[str, Recorder], tmp_path_factory: pytest.TempPathFactory
) -> list[dict]:
    from tests._support.bench import SMALL_SESSIONS

    trace = tmp_path_factory.mktemp("sdk") / "small.jsonl"
    trace.write_text("".join(json.dumps(s) + "\n" for s in SMALL_SESSIONS))
    endpoint, rec = proxy
    rec.take()
    rows, _ = _replay(stack, endpoint, trace, trace.parent / "out", "sdk")
    requests = _api_requests(rec.take(), "sdk")
    # the recorder sees agentkv's own signals when a client sends them
    assert requests and all(r.status == 200 for r in requests)
    assert all("x-conversation-id" in r.headers for r in requests)
    assert all("kv_transfer_params" in r.json() for r in requests[1:])
    return list(rows)


@pytest.mark.parametrize("client", ["chat", "messages", "responses"])
def test_raw_client_replays_the_small_trace(
    stack: Stack,
    proxy: tuple[str, Recorder],
    small_trace: Path,
    tmp_path: Path,
    sdk_rows: list[dict],
    client: str,
):
    endpoint, rec = proxy
    rec.take()
    before = _sources(stack)
    rows, summary = _replay(stack, endpoint, small_trace, tmp_path / "out", client)
    after = _sources(stack)
    requests = _api_requests(rec.take(), client)
    assert len(requests) == len(rows) == len(sdk_rows) == 10
    _check_raw_wire(client, requests)
    # the router named every turn from the harness's own signal, none from agentkv's
    grew = {s: after.get(s, 0) - before.get(s, 0) for s in after}
    assert grew[SOURCE[client]] == 10 and grew.get("agentkv", 0) == 0, grew

    # the same trace turns as the SDK's; the raw prompt never holds less than the SDK's
    assert [(r["session"], r["kind"]) for r in rows] == [
        (r["session"], r["kind"]) for r in sdk_rows
    ]
    for raw, sdk in zip(rows, sdk_rows, strict=True):
        assert raw["client"] == client and sdk["client"] == "sdk"
        assert raw["prompt_tokens"] >= sdk["prompt_tokens"] > 0
        # the receipt read back, and the API's own usage says the same
        assert raw["decision"] and raw["wrong_kv_tokens"] == 0 and raw["model_ttft_ms"] > 0
        assert raw["reused_tokens"] == raw["router_reused_tokens"]
        assert raw["wall_ttft_ms"] is not None
        # the ideal is measured on the generated ids (the answer's text re-tokenized)
        assert raw["generated_known"] is True and sdk["generated_known"] is None
    decisions = [r["decision"] for r in rows]
    expected = [
        "miss", "pull", "pull", "pull", "expired", "pull",
        "miss", "pull", "pull", "pull",
    ]  # fmt: skip
    # the trace's gaps run in scaled real time: on a loaded machine a pull may find its handle
    # past the router's TTL, never the other way round
    assert all(
        d == e or (e, d) == ("pull", "expired") for d, e in zip(decisions, expected, strict=True)
    ), decisions
    assert decisions.count("pull") >= 5, decisions
    for r in rows:
        if r["decision"] != "pull":
            continue
        assert 0 < r["reused_tokens"] <= r["verified_tokens"]
        assert r["ideal_tokens"] > 0
        # the whole ideal, or less: with the trim's cause (`drift`: no epoch header) where the
        # router rendered the client's history, or where it kept the token identity (of the
        # whole history or of its unchanged prefix) and the conversation's own history is
        # shorter than the exact-mode ideal after a rewrite
        if r["reused_tokens"] < r["ideal_tokens"]:
            assert r["trim_cause"] == "drift" or r["identity"] in ("kept", "kept-prefix"), r
    # token identity outlives the KV (identity_ttl_s): the turn after the pause past the
    # router's TTL is recomputed but keeps the answers' ids
    assert [r["identity"] for r in rows if r["decision"] == "expired"] == [
        "kept"
    ] * decisions.count("expired"), rows
    # the ideal prompts the answers the client changed as it sent them; a kept turn whose handle
    # was wholly used falls short of it only after a turn the router rendered whole (its record
    # gone past the TTL, or a rewrite that kept no recorded answer)
    generated = [r["ideal_generated_tokens"] for r in rows if r["turn"] > 0]
    assert sum(generated) >= sum(r["ideal_tokens"] for r in rows), rows
    for r in rows:
        if r["shortfall_cause"] == "held-short":
            before = [b for b in rows if b["session"] == r["session"] and b["turn"] < r["turn"]]
            assert any(
                (b["identity"] or "").startswith("rendered:") and b["turn"] > 0 for b in before
            ), r
    # the previous answer's tool call is in what D held (and in the ideal), not in the SDK's
    for raw, sdk in zip(rows, sdk_rows, strict=True):
        if raw["kind"] == "append":
            assert raw["held_tokens"] > sdk["held_tokens"] > 0
    totals = summary["policies"]["agentkv"]
    assert totals["wrong_kv_tokens"] == 0 and totals["errors"] == 0
    assert 0 < totals["captured_pct"] <= 100
    assert summary["meta"]["settings"]["client"] == client
    assert summary["meta"]["setup"]["client"].startswith(client)


def test_sdk_rows_keep_their_receipts(sdk_rows: list[dict]):
    """The SDK's turns (exact mode) read back everything verifiable; the new receipt columns
    are filled."""
    assert all(r["wrong_kv_tokens"] == 0 for r in sdk_rows)
    pulls = [r for r in sdk_rows if r["decision"] == "pull"]
    assert pulls and all(r["verified_tokens"] >= r["reused_tokens"] > 0 for r in pulls)
    assert all(r["trim_cause"] == "rewrite" for r in pulls if r["kind"] in ("strip", "rewrite"))
    assert all(
        r["reused_tokens"] == r["ideal_tokens"] and r["trim_cause"] is None
        for r in pulls
        if r["kind"] == "append"
    )


def test_raw_client_compare(stack: Stack, small_trace: Path, tmp_path: Path):
    """--compare with a raw client: the baseline reads nothing, the unverified router runs the
    rewritten turns on wrong KV, agentkv's router never does."""
    assert stack.unverified_url is not None
    rows, summary = _replay(
        stack, stack.base_url, small_trace, tmp_path / "out", "chat",
        "--compare", "--unverified-endpoint", stack.unverified_url,
    )  # fmt: skip
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["policy"], []).append(r)
    assert set(by) == {"none", "unverified", "agentkv"}
    assert all(r["reused_tokens"] == 0 and r["decision"] == "miss" for r in by["none"])
    assert sum(r["wrong_kv_tokens"] for r in by["unverified"]) > 0
    assert all(r["wrong_kv_tokens"] == 0 for r in by["agentkv"])
    assert summary["policies"]["agentkv"]["wrong_kv_tokens"] == 0


def test_messages_client_on_the_claude_code_trace(stack: Stack, tmp_path: Path):
    """Two sessions of the real Claude Code trace, as Claude Code would send them."""
    rows, summary = _replay(
        stack, stack.base_url, need(CLAUDE_CODE), tmp_path / "out", "messages",
        "--sessions", "2", "--max-turns", "8", "--max-context", "4096",
        "--token-scale", "0.0625",
    )  # fmt: skip
    assert len({r["session"] for r in rows}) == 2
    assert all(r["wrong_kv_tokens"] == 0 for r in rows)
    assert [r["decision"] for r in rows if r["turn"] == 0] == ["miss", "miss"]
    assert any(r["decision"] == "pull" for r in rows)
    assert summary["policies"]["agentkv"]["useful_reused_tokens"] > 0


def test_bad_client_and_leases(small_trace: Path):
    runner = CliRunner()
    r = runner.invoke(app, ["bench", "replay", str(small_trace), "--client", "grpc"])
    assert r.exit_code == 2 and "unknown --client" in r.output
    r = runner.invoke(app, ["bench", "replay", str(small_trace), "--client", "chat", "--leases"])
    assert r.exit_code == 2 and "--client sdk" in r.output
