"""``agentkv demo``: a tool-using agent on the default backend, three ways.

1. Use the backend already answering at the local profile's URL, or start the ``local`` profile
   (simulated prefill and decode engines + agentkv's router) in the background.
2. Drive a scripted, tool-using agent through the SDK: exact token ids, one conversation id,
   its reasoning stripped at turn 4 and a summary at turn 6 (the router trims the handle to
   the verified prefix, and the turn reuses only that). Per turn: the simulator's modelled
   TTFT (its cost model, noise-free: ``X-AgentKV-Sim-Model-TTFT-Ms``), prompt tokens, reused
   tokens (read back by P, or found in D's prefix cache on a ``decode`` turn), the router's
   decision, and the TTFT saved against the same turn without a conversation id.
3. Replay the same turns as a naive client would: without a conversation id (no reuse), then
   with reuse that nobody verifies (vLLM's example-proxy policy, on a second router), counting
   the prompt tokens that ran on KV computed for other tokens (the simulator's wrong-KV
   counter). The comparison counts TTFT saved only over the turns that read no wrong KV (an
   answer computed on wrong KV is not the model's), and a note after each rewrite turn says
   what the rewrite left unchanged. The tables fit 80 columns.

Something else on the router's port (another server, or a port that is merely taken) is one
line on stderr and exit status 2, never a traceback; ``--port`` picks another port, and busy
engine ports are moved to free ones.

The agent and its turns are :mod:`agentkv.serve.demo_agent`, the claims and tables
:mod:`agentkv.serve.demo_report`; this module finds or starts the backend and runs the three.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import agentkv
from agentkv.procs import ProcessError, free_port_range
from agentkv.serve import Deployment, ProfileError, check_runtime, expand, load_profile
from agentkv.serve.checks import port_free, probe_router
from agentkv.serve.demo_agent import TURNS, Backend, Row, run_agent
from agentkv.serve.demo_report import check, print_tables
from agentkv.serve.ports import engine_ports, with_ports
from agentkv.serve.supervisor import ServeError, Supervisor, start_router

__all__ = ["run_demo"]


class DemoError(Exception):
    """What stops the demo, in one line."""


def _running(deployment: Deployment) -> Deployment:
    """``deployment`` with the engines the running router reports (its ``/health``, open
    without tenants), which need not be the profile's (``agentkv serve --base-port``)."""
    url = deployment.base_url.removesuffix("/v1")
    try:
        health = httpx.get(f"{url}/health", timeout=3).json()
    except (httpx.HTTPError, ValueError):
        return deployment
    upstream = dict(deployment.router_config.get("upstream") or {})
    for role in ("prefill", "decode"):
        urls = list(health.get(role) or {}) if isinstance(health, dict) else []
        if not urls:
            return deployment  # not shown (an admin key is needed): the profile's
        upstream[role] = [{"url": u} for u in urls]
    config = {**deployment.router_config, "upstream": upstream}
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
    where = f"127.0.0.1:{prof.router.http.port}"
    hint = "stop it, or run agentkv demo --port N with a free port"
    found = probe_router(deployment.base_url.removesuffix("/v1"))
    if found == "agentkv":
        yield _running(deployment), False
        return
    if found == "agentkv-unhealthy":
        raise DemoError(f"agentkv's router on {where} has no healthy engines: {hint}")
    if found != "none":
        raise DemoError(f"{where} is taken by {found}: {hint}")
    if not port_free(prof.router.http.port):
        raise DemoError(f"port {prof.router.http.port} is in use: {hint}")
    if check_runtime(prof):  # engine ports taken (e.g. another deployment): move the engines
        prof = with_ports(prof, base_port=_free_base(engine_ports(prof), prof.router.http.port))
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
    paths = {**deployment.router_config.get("paths", {}), "reuse_policy": "unverified"}
    config = {**deployment.router_config, "paths": paths}
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
    print_tables(console, verified, naive, unverified)
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
            backend = Backend(deployment)
            model = load_profile(profile).served_model_name

            def step() -> None:
                progress.advance(task)

            with agentkv.Client(base_url=deployment.base_url, api_key="demo") as client:
                progress.update(task, description="agentkv (verified reuse)")
                verified = run_agent(
                    client, backend, "agentkv", conversation=True, model=model, on_turn=step
                )
                progress.update(task, description="no conversation id")
                naive = run_agent(
                    client, backend, "no-id", conversation=False, model=model, on_turn=step
                )
            progress.update(task, description="reuse without verification")
            with (
                _unverified_router(deployment) as url,
                agentkv.Client(base_url=url, api_key="demo") as client,
            ):
                unverified = run_agent(
                    client, backend, "unverified", conversation=True, model=model, on_turn=step
                )
    return verified, naive, unverified
