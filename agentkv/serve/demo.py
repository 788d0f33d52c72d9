"""``agentkv demo``: a tool-using agent on the default backend, three ways.

1. Use the backend already answering at the local profile's URL, or start the ``local`` profile
   (simulated prefill and decode engines + agentkv's router) in the background.
2. Drive a scripted, tool-using agent through the SDK: exact token ids, one conversation id,
   its reasoning stripped at turn 4 and a summary at turn 6. Per turn: TTFT, prompt tokens,
   reused tokens, the router's decision.
3. Replay the same turns as a naive client would: without a conversation id (no reuse), then
   with reuse that nobody verifies (vLLM's example-proxy policy, on a second router), counting
   the prompt tokens that ran on KV computed for other tokens (the simulator's wrong-KV
   counter).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

import agentkv
from agentkv.promtext import parse_metrics
from agentkv.serve import Deployment, expand, load_profile
from agentkv.serve.supervisor import Supervisor

__all__ = ["run_demo"]

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


@dataclass
class Row:
    turn: int
    label: str
    ttft_ms: float
    prompt_tokens: int
    reused: int
    decision: str
    wrong_kv: int


class _Backend:
    """URLs of the running deployment and the sims' wrong-KV counter."""

    def __init__(self, deployment: Deployment) -> None:
        self.base_url = deployment.base_url
        self.engines = [
            p.health_url.rsplit("/health", 1)[0] for p in deployment.processes if p.role != "router"
        ]

    def wrong_kv(self) -> int:
        total = 0.0
        for url in self.engines:
            with contextlib.suppress(httpx.HTTPError):
                total += parse_metrics(httpx.get(f"{url}/metrics", timeout=5).text).get(
                    "agentkv_sim_wrong_kv_tokens_total", 0.0
                )
        return int(total)


def _agent(
    client: agentkv.Client, backend: _Backend, label: str, *, conversation: bool
) -> list[Row]:
    """Run the script; ``conversation=False`` sends no conversation id (a fresh id each turn)."""
    rows: list[Row] = []
    # A tag per run, so no run finds another's prompts in the engines' prefix caches.
    system = f"[run {label} {time.time_ns()}] {SYSTEM}"
    conv = client.conversation(model="agentkv-sim", system=system, tools=TOOLS)
    pending_call: str | None = None
    turn = 0
    for step, script in SCRIPT:
        if step == "strip":
            conv.strip_reasoning()
            continue
        if step == "summary":
            conv.compact(
                lambda msgs: "We fixed the expiry margin in the scheduler; tests pass.", keep_last=2
            )
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
                ttft,
                receipt.prompt_tokens,
                receipt.reused_tokens or 0,
                receipt.decision or "-",
                backend.wrong_kv() - before,
            )
        )
    return rows


@contextlib.contextmanager
def _backend(profile: str = "local") -> Iterator[tuple[Deployment, bool]]:
    """The deployment of ``profile``: (deployment, started here)."""
    deployment = expand(load_profile(profile))
    with contextlib.suppress(httpx.HTTPError):
        if (
            httpx.get(deployment.base_url.removesuffix("/v1") + "/health", timeout=1).status_code
            == 200
        ):
            yield deployment, False
            return
    with Supervisor(deployment, console=None, startup_timeout_s=90) as _:
        yield deployment, True


@contextlib.contextmanager
def _unverified_router(deployment: Deployment) -> Iterator[str]:
    """A second router on the same engines with the example proxy's policy."""
    from agentkv.sim.launch import free_port

    port = free_port()
    config = dict(deployment.router_config, port=port, reuse_policy="unverified")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "router.json")
        path.write_text(json.dumps(config))
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentkv",
                "router",
                "--config",
                str(path),
                "--log-level",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                time.sleep(0.1)
            yield f"{url}/v1"
        finally:
            proc.terminate()
            proc.wait(10)


def run_demo(*, profile: str = "local", console: Console | None = None) -> int:
    """Run the demo on ``profile`` (a simulator profile) and print its tables; 0 when every
    claim held."""
    console = console or Console()
    console.print(
        "[bold]agentkv demo[/]: a tool-using agent on simulated vLLM P/D behind agentkv's router"
    )
    with _backend(profile) as (deployment, started):
        console.print(
            ("started" if started else "using") + f" the local backend at {deployment.base_url}"
        )
        backend = _Backend(deployment)
        with agentkv.Client(base_url=deployment.base_url, api_key="demo") as client:
            verified = _agent(client, backend, "agentkv", conversation=True)
            naive = _agent(client, backend, "no-id", conversation=False)
        with (
            _unverified_router(deployment) as url,
            agentkv.Client(base_url=url, api_key="demo") as client,
        ):
            unverified = _agent(client, backend, "unverified", conversation=True)
    _print(console, verified, naive, unverified)
    ok = sum(r.wrong_kv for r in verified) == 0 and sum(r.wrong_kv for r in unverified) > 0
    ok = ok and all(r.decision == "pull" for r in verified[1:] if r.turn not in (4, 6))
    if not ok:
        console.print("[red]demo check failed: reuse or wrong-KV counts are not as expected[/]")
    return 0 if ok else 1


def _print(console: Console, verified: list[Row], naive: list[Row], unverified: list[Row]) -> None:
    table = Table(title="agentkv: exact ids, one conversation id, verified reuse")
    for col in ("turn", "TTFT ms", "prompt tokens", "reused tokens", "decision", "wrong-KV tokens"):
        table.add_column(col, justify="right")
    notes = {4: " (reasoning stripped)", 6: " (summary)"}
    for r in verified:
        table.add_row(
            f"{r.turn}{notes.get(r.turn, '')}",
            f"{r.ttft_ms:.0f}",
            str(r.prompt_tokens),
            str(r.reused),
            r.decision,
            str(r.wrong_kv),
        )
    console.print(table)
    compare = Table(title="the same turns, three clients")
    for col in ("client", "total TTFT ms", "reused tokens", "wrong-KV tokens"):
        compare.add_column(col, justify="right")
    for name, rows in (
        ("agentkv (verified)", verified),
        ("no conversation id", naive),
        ("reuse without verification", unverified),
    ):
        wrong = sum(r.wrong_kv for r in rows)
        compare.add_row(
            name,
            f"{sum(r.ttft_ms for r in rows):.0f}",
            str(sum(r.reused for r in rows)),
            f"[red]{wrong}[/]" if wrong else "0",
        )
    console.print(compare)
