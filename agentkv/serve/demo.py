"""``agentkv demo``: a tool-using agent on the default backend, three ways.

1. Use the backend already answering at the local profile's URL, or start the ``local`` profile
   (simulated prefill and decode engines + agentkv's router) in the background.
2. Drive a scripted, tool-using agent through the SDK: exact token ids, one conversation id,
   its reasoning stripped at turn 4 and a summary at turn 6 (the router trims the handle to
   the verified prefix: a trimmed pull). Per turn: the simulator's modelled TTFT (its cost
   model, noise-free: ``X-AgentKV-Sim-Model-TTFT-Ms``), prompt tokens, reused tokens, the
   router's decision, and the TTFT saved against the same turn without a conversation id.
3. Replay the same turns as a naive client would: without a conversation id (no reuse), then
   with reuse that nobody verifies (vLLM's example-proxy policy, on a second router), counting
   the prompt tokens that ran on KV computed for other tokens (the simulator's wrong-KV
   counter). The comparison counts TTFT saved only over the turns that read no wrong KV (an
   answer computed on wrong KV is not the model's), and a note after each rewrite turn says
   what the rewrite left unchanged. The tables fit 80 columns.

Something else on the router's port (another server, or a port that is merely taken) is one
line on stderr and exit status 2, never a traceback; ``--port`` picks another port, and busy
engine ports are moved to free ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import agentkv
from agentkv.procs import ProcessError, free_port_range
from agentkv.protocol.promtext import parse_metrics
from agentkv.serve import Deployment, ProfileError, check_runtime, expand, load_profile
from agentkv.serve.checks import port_free, probe_router
from agentkv.serve.ports import engine_ports, with_ports
from agentkv.serve.supervisor import ServeError, Supervisor, start_router

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


TURNS = sum(1 for step, _ in SCRIPT if ":" in step)
REWRITES = {4: "reasoning stripped", 6: "summary"}
"""The turns that follow a rewrite, and what it was."""
DECISIONS = {
    "miss": "the router holds no handle for the conversation (its first turn, or no "
    "conversation id)",
    "pull": "P read the verified history's KV back from D instead of recomputing it "
    "([bold]trimmed[/]: after a rewrite, only the prefix the rewrite left unchanged)",
    "decode": "the turn went straight to the D that held the history, which prefilled only "
    "the new tokens from its own prefix cache (router config paths = choose)",
    "cpu": "the handle was gone; the turn went to the D whose CPU tier held the history, "
    "which loaded it and prefilled the rest (router config paths = choose, D's KV events)",
    "stale": "a handle the prompt does not extend, released, nothing read",
    "local": "P's own prefix cache held what D offered; nothing read",
    "recompute": "too little to read; recomputed",
    "expired": "the handle was too close to D's TTL to read",
}
FOOTER = (
    "[bold]wrong KV[/] = prompt tokens that ran on KV computed for other tokens (silent "
    "corruption: vLLM places a handle's blocks by position and checks nothing); an answer "
    "computed on them is not the model's, so the TTFT such a turn saves counts for nothing. "
    "TTFT = the simulator's modelled time to first token (its cost model, noise-free), in ms."
)


class DemoError(Exception):
    """What stops the demo, in one line."""


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


class _Backend:
    """URLs of the running deployment and the sims' wrong-KV counter."""

    def __init__(self, deployment: Deployment) -> None:
        self.base_url = deployment.base_url
        config = deployment.router_config
        self.engines = [str(e["url"]) for role in ("prefill", "decode") for e in config[role]]

    def wrong_kv(self) -> int:
        total = 0.0
        for url in self.engines:
            with contextlib.suppress(httpx.HTTPError):
                total += parse_metrics(httpx.get(f"{url}/metrics", timeout=5).text).get(
                    "agentkv_sim_wrong_kv_tokens_total", 0.0
                )
        return int(total)


def _agent(
    client: agentkv.Client,
    backend: _Backend,
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
                receipt.reused_tokens or 0,
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


def _running(deployment: Deployment) -> Deployment:
    """``deployment`` with the engines the running router reports (its ``/health``, open
    without tenants), which need not be the profile's (``agentkv serve --base-port``)."""
    url = deployment.base_url.removesuffix("/v1")
    try:
        health = httpx.get(f"{url}/health", timeout=3).json()
    except (httpx.HTTPError, ValueError):
        return deployment
    config = dict(deployment.router_config)
    for role in ("prefill", "decode"):
        urls = list(health.get(role) or {}) if isinstance(health, dict) else []
        if not urls:
            return deployment  # not shown (an admin key is needed): the profile's
        config[role] = [{"url": u} for u in urls]
    return dataclasses.replace(deployment, router_config=config)


def _free_base(count: int, avoid: int) -> int:
    """The first of ``count`` consecutive free ports (not ``avoid``)."""
    try:
        return free_port_range(count, avoid=(avoid,))
    except RuntimeError:
        raise DemoError(f"found no {count} consecutive free ports for the engines") from None


@contextlib.contextmanager
def _backend(profile: str = "local", port: int | None = None) -> Iterator[tuple[Deployment, bool]]:
    """The deployment of ``profile`` (the router on ``port`` when given): (deployment, started
    here). Raises :class:`DemoError`."""
    try:
        prof = with_ports(load_profile(profile), port=port)
    except ProfileError as exc:
        raise DemoError(str(exc)) from None
    deployment = expand(prof)
    where = f"127.0.0.1:{prof.router.port}"
    hint = "stop it, or run agentkv demo --port N with a free port"
    found = probe_router(deployment.base_url.removesuffix("/v1"))
    if found == "agentkv":
        yield _running(deployment), False
        return
    if found == "agentkv-unhealthy":
        raise DemoError(f"agentkv's router on {where} has no healthy engines: {hint}")
    if found != "none":
        raise DemoError(f"{where} is taken by {found}: {hint}")
    if not port_free(prof.router.port):
        raise DemoError(f"port {prof.router.port} is in use: {hint}")
    if check_runtime(prof):  # engine ports taken (e.g. another deployment): move the engines
        prof = with_ports(prof, base_port=_free_base(engine_ports(prof), prof.router.port))
        problems = check_runtime(prof)
        if problems:
            raise DemoError("; ".join(problems))
        deployment = expand(prof)
    supervisor = Supervisor(deployment, console=None, startup_timeout_s=90)
    try:
        supervisor.start()
    except ServeError as exc:
        supervisor.stop()
        raise DemoError(f"could not start profile {prof.name}: {exc}") from None
    try:
        yield deployment, True
    finally:
        supervisor.stop()


@contextlib.contextmanager
def _unverified_router(deployment: Deployment) -> Iterator[str]:
    """A second router on the same engines with the example proxy's policy."""
    config = dict(deployment.router_config, reuse_policy="unverified")
    try:
        router = start_router(config, timeout_s=30)
    except ProcessError as exc:
        raise DemoError(f"could not start the unverified router: {exc}") from None
    with router:
        yield f"{router.url}/v1"


def run_demo(
    *, profile: str = "local", port: int | None = None, console: Console | None = None
) -> int:
    """Run the demo on ``profile`` (a simulator profile; the router on ``port`` when given) and
    print its tables; 0 when every claim held, 1 when one did not, 2 when it could not run."""
    console = console or Console()
    console.print(
        "[bold]agentkv demo[/]: a tool-using agent on simulated vLLM P/D behind agentkv's router"
    )
    try:
        verified, naive, unverified = _run(console, profile, port)
    except DemoError as exc:
        Console(stderr=True, soft_wrap=True).print(
            f"agentkv demo: {exc}", markup=False, highlight=False
        )
        return 2
    _print(console, verified, naive, unverified)
    problems = check(verified, naive, unverified)
    for problem in problems:
        console.print(f"[red]demo check failed[/]: {problem}", highlight=False)
    return 1 if problems else 0


def _run(
    console: Console, profile: str, port: int | None
) -> tuple[list[Row], list[Row], list[Row]]:
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    with progress:
        task = progress.add_task("starting the local backend", total=3 * TURNS)
        with _backend(profile, port) as (deployment, started):
            progress.console.print(
                ("started" if started else "using") + f" the local backend at {deployment.base_url}"
            )
            backend = _Backend(deployment)
            model = load_profile(profile).served_model_name

            def step() -> None:
                progress.advance(task)

            with agentkv.Client(base_url=deployment.base_url, api_key="demo") as client:
                progress.update(task, description="agentkv (verified reuse)")
                verified = _agent(
                    client, backend, "agentkv", conversation=True, model=model, on_turn=step
                )
                progress.update(task, description="no conversation id")
                naive = _agent(
                    client, backend, "no-id", conversation=False, model=model, on_turn=step
                )
            progress.update(task, description="reuse without verification")
            with (
                _unverified_router(deployment) as url,
                agentkv.Client(base_url=url, api_key="demo") as client,
            ):
                unverified = _agent(
                    client, backend, "unverified", conversation=True, model=model, on_turn=step
                )
    return verified, naive, unverified


def check(verified: list[Row], naive: list[Row], unverified: list[Row]) -> list[str]:
    """The demo's claims, each that failed as a sentence: agentkv reads no wrong KV and pulls
    every turn after the first (the rewrite turns a trimmed pull), unverified reuse reads wrong
    KV, and agentkv's modelled TTFT is below the naive client's."""
    problems = []
    if sum(r.wrong_kv for r in verified):
        problems.append("agentkv's turns ran on wrong KV")
    if not sum(r.wrong_kv for r in unverified):
        problems.append("unverified reuse read no wrong KV")
    for r in verified[1:]:
        if r.decision != "pull":
            problems.append(f"turn {r.turn}: decision {r.decision}, not pull")
        elif (r.turn in REWRITES) != r.trimmed:
            problems.append(f"turn {r.turn}: {'not ' if r.turn in REWRITES else ''}trimmed")
    if sum(r.ttft_ms for r in verified) >= sum(r.ttft_ms for r in naive):
        problems.append("agentkv's modelled TTFT is not below the naive client's")
    return problems


def _decision(r: Row) -> str:
    return f"{r.decision} (trimmed)" if r.trimmed else r.decision


def _turns(rows: list[Row]) -> str:
    """``"4 and 6"``: the turns of ``rows``."""
    names = [str(r.turn) for r in rows]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _table(title: str, caption: str) -> Table:
    """A table that fits 80 columns: no outer edge, one space between columns."""
    return Table(
        title=title,
        caption=caption,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )


def _print(console: Console, verified: list[Row], naive: list[Row], unverified: list[Row]) -> None:
    table = _table(
        "agentkv: exact ids, one conversation id, verified reuse",
        "modelled ms; no reuse = the same turn without a conversation id; saved = no reuse - TTFT",
    )
    for col in ("turn", "TTFT", "no reuse", "saved", "prompt", "reused", "decision", "wrong KV"):
        table.add_column(col, justify="right", no_wrap=True)
    for r, base in zip(verified, naive, strict=True):
        table.add_row(
            str(r.turn),
            f"{r.ttft_ms:.0f}",
            f"{base.ttft_ms:.0f}",
            f"{base.ttft_ms - r.ttft_ms:.0f}",
            f"{r.prompt_tokens:,}",
            f"{r.reused:,}",
            _decision(r),
            str(r.wrong_kv),
        )
    console.print(table)
    for r in verified:
        if r.turn in REWRITES:
            console.print(
                f"turn {r.turn} ({REWRITES[r.turn]}): {r.reused:,} of {r.prompt_tokens:,} prompt "
                f"tokens read back: {r.survived}, unchanged by the rewrite; the rest recomputed",
                highlight=False,
            )
    console.print()
    compare = _table(
        f"the same {len(verified)} turns, three clients",
        "TTFT saved against no reuse, over the turns that read no wrong KV",
    )
    compare.add_column("client", no_wrap=True)
    for col in ("TTFT", "saved", "correct", "wrong KV"):
        compare.add_column(col, justify="right", no_wrap=True)
    baseline = {r.turn: r.ttft_ms for r in naive}
    base_total = sum(baseline.values())
    for name, rows in (
        ("agentkv (verified)", verified),
        ("no conversation id", naive),
        ("reuse without verification", unverified),
    ):
        wrong = sum(r.wrong_kv for r in rows)
        correct = f"{sum(1 for r in rows if not r.wrong_kv)} of {len(rows)}"
        saved = sum(baseline[r.turn] - r.ttft_ms for r in rows if not r.wrong_kv)
        share = f" ({saved / base_total:.0%})" if base_total else ""
        compare.add_row(
            name,
            f"{sum(r.ttft_ms for r in rows):.0f}",
            "-" if rows is naive else f"{saved:.0f}{share}",
            f"[red]{correct}[/]" if wrong else correct,
            f"[red]{wrong:,}[/]" if wrong else "0",
        )
    console.print(compare)
    bad = [r for r in unverified if r.wrong_kv]
    if bad:
        console.print(
            f"reuse without verification: turn{'s' if len(bad) > 1 else ''} {_turns(bad)} ran on"
            f" KV computed for other tokens ({sum(r.wrong_kv for r in bad):,} prompt tokens): "
            "faster, and wrong",
            highlight=False,
        )
    console.print()
    seen = {r.decision for rows in (verified, naive, unverified) for r in rows}
    legend = "; ".join(f"[bold]{d}[/] = {text}" for d, text in DECISIONS.items() if d in seen)
    console.print(f"decisions: {legend}. {FOOTER}")
