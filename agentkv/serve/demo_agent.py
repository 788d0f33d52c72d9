"""``agentkv demo``'s agent: a scripted, tool-using coding agent (its tools, system prompt and
turns, with its reasoning stripped before turn 4 and a summary before turn 6), run through the SDK
over a backend, one :class:`Row` per turn."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import httpx

import agentkv
from agentkv.protocol.promtext import parse_metrics
from agentkv.serve import Deployment

__all__ = ["REWRITES", "TURNS", "Backend", "Row", "run_agent"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite.",
            "parameters": {"type": "object", "properties": {"target": {"type": "string"}}},
        },
    },
]
SYSTEM = "You are a careful coding agent working in a large repository. " + " ".join(
    f"Rule {i}: read a file before editing it, keep each change small, cite line {i}."
    for i in range(120)
)
# (what the user or the tool says, what the scripted model answers)
SCRIPT: list[tuple[str, dict[str, Any]]] = [
    (
        "user:Why does test_expiry fail?",
        {
            "reasoning": "Start with the scheduler.",
            "content": "",
            "tool_calls": [{"name": "read_file", "arguments": {"path": "scheduler.py"}}],
        },
    ),
    (
        "tool:def expire(h):\n    return h.age > TTL  # should be >= TTL - margin\n" * 6,
        {
            "reasoning": "The comparison ignores the margin.",
            "content": "",
            "tool_calls": [{"name": "run_tests", "arguments": {"target": "test_expiry"}}],
        },
    ),
    (
        "tool:FAILED test_expiry - handle used 2 s before expiry\n" * 4,
        {"reasoning": "Confirmed.", "content": "The expiry check ignores the 5 s margin. " * 8},
    ),
    ("strip", {}),
    (
        "user:Fix it and rerun.",
        {
            "reasoning": "Edit then test.",
            "content": "",
            "tool_calls": [{"name": "run_tests", "arguments": {"target": "all"}}],
        },
    ),
    (
        "tool:312 passed\n" * 3,
        {"reasoning": "All green.", "content": "Fixed: margin applied. " * 8},
    ),
    ("summary", {}),
    (
        "user:What else should we check?",
        {
            "reasoning": "Think about clocks.",
            "content": "Check that every TTL uses a monotonic clock. " * 8,
        },
    ),
]


TURNS = sum(1 for step, _ in SCRIPT if ":" in step)
REWRITES = {4: "reasoning stripped", 6: "summary"}
"""The turns that follow a rewrite, and what it was."""


@dataclass
class Row:
    turn: int
    label: str
    ttft_ms: float
    """The simulator's modelled TTFT (``X-AgentKV-Sim-Model-TTFT-Ms``); wall clock without it."""
    prompt_tokens: int
    reused: int
    decision: str
    wrong_kv: int
    trimmed: bool = False
    wall_ttft_ms: float = 0.0
    survived: str = ""
    """After a rewrite: what the rewrite left unchanged at the start of the history."""


class Backend:
    """URLs of the running deployment and the sims' wrong-KV counter."""

    def __init__(self, deployment: Deployment) -> None:
        self.base_url = deployment.base_url
        upstream = deployment.router_config["upstream"]
        self.engines = [str(e["url"]) for role in ("prefill", "decode") for e in upstream[role]]

    def wrong_kv(self) -> int:
        total = 0.0
        for url in self.engines:
            with contextlib.suppress(httpx.HTTPError):
                total += parse_metrics(httpx.get(f"{url}/metrics", timeout=5).text).get(
                    "agentkv_sim_wrong_kv_tokens_total", 0.0
                )
        return int(total)


def run_agent(
    client: agentkv.Client,
    backend: Backend,
    label: str,
    *,
    conversation: bool,
    model: str = "agentkv-sim",
    on_turn: Any = None,
) -> list[Row]:
    """Run the script; ``conversation=False`` sends no conversation id (a fresh id each turn)."""
    rows: list[Row] = []
    # A tag per run, so no run finds another's prompts in the engines' prefix caches.
    system = f"[run {label} {time.time_ns()}] {SYSTEM}"
    conv = client.conversation(model=model, system=system, tools=TOOLS)
    pending_call: str | None = None
    survived = ""
    turn = 0
    for step, script in SCRIPT:
        if step == "strip":
            before_rewrite = list(conv.messages)
            survived = _survivors(before_rewrite, conv.strip_reasoning().surviving_messages)
            continue
        if step == "summary":
            before_rewrite = list(conv.messages)
            report = conv.compact(
                lambda msgs: "We fixed the expiry margin in the scheduler; tests pass.", keep_last=2
            )
            survived = _survivors(before_rewrite, report.surviving_messages)
            continue
        kind, text = step.split(":", 1)
        if kind == "tool" and pending_call is not None:
            conv.add_tool_result(pending_call, text)
        else:
            conv.add_user(text)
        if not conversation:
            conv = client.resume({**conv.to_state(), "id": f"anon-{label}-{turn}"})
        before = backend.wrong_kv()
        started = time.perf_counter()
        stream = conv.create(max_tokens=400, stream=True, extra_body={"agentkv_sim": script})
        ttft = 0.0
        for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            if (
                not ttft
                and delta is not None
                and (
                    delta.content or delta.tool_calls or (delta.model_extra or {}).get("reasoning")
                )
            ):
                ttft = (time.perf_counter() - started) * 1000
        receipt = stream.receipt
        assert receipt is not None
        turn += 1
        message = conv.messages[-1]
        pending_call = message["tool_calls"][0]["id"] if message.get("tool_calls") else None
        rows.append(
            Row(
                turn,
                label,
                receipt.model_ttft_ms if receipt.model_ttft_ms is not None else ttft,
                receipt.prompt_tokens,
                _reused(receipt),
                receipt.decision or "-",
                backend.wrong_kv() - before,
                trimmed=receipt.trim_cause is not None,
                wall_ttft_ms=ttft,
                survived=survived,
            )
        )
        survived = ""
        if on_turn is not None:
            on_turn()
    return rows


def _reused(receipt: agentkv.TurnReceipt) -> int:
    """The history's tokens the turn did not recompute: read back by P (``pull``), or found
    in D's own prefix cache on a turn that went straight to D (``decode``, ``cpu``)."""
    if receipt.decision in ("decode", "cpu"):
        return receipt.cached_tokens or 0
    return receipt.reused_tokens or 0


def _survivors(messages: list[dict[str, Any]], count: int) -> str:
    """The first ``count`` messages in words ("the system prompt with the tools and a user
    message")."""
    names = {
        "system": "the system prompt with the tools",
        "user": "a user message",
        "assistant": "an answer",
        "tool": "a tool result",
    }
    words = [names.get(str(m.get("role")), "a message") for m in messages[:count]]
    if len(words) < 2:
        return words[0] if words else "nothing"
    return ", ".join(words[:-1]) + " and " + words[-1]
