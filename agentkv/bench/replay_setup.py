"""Where `agentkv bench replay` runs each policy: a running deployment (``--endpoint``), or
launch profiles started for the run (``--local``), with a deployment of its own for leases.

The ``lease`` policy needs a D whose TTL is the lease's ``max_hold_s`` (the router, not D's
timer, frees blocks), so under ``--local`` it gets a second deployment of the same profile with
that TTL and a lease check six times per (compressed) lease; with ``--endpoint`` it runs on
``lease_endpoint``, a router in front of such a D.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace

import httpx

from agentkv.bench.deploy import Stack, local_stack
from agentkv.bench.replay_records import Policy, ReplaySettings
from agentkv.bench.retention import LeaseParams
from agentkv.bench.runner import (
    PolicyTarget,
    ReplayRun,
    lease_router_options,
    stack_settings,
    stack_target,
)
from agentkv.bench.wire import ClientName
from agentkv.serve.setup import SetupError

__all__ = ["EndpointTTLs", "SetupError", "describe_client", "endpoint_run", "local_run"]


@dataclass(frozen=True)
class EndpointTTLs:
    """A running deployment's TTLs in real seconds."""

    router_s: float = 450.0
    decoder_s: float = 480.0


def _served_model(endpoint: str) -> str:
    try:
        models = httpx.get(endpoint.rstrip("/") + "/models", timeout=10, trust_env=False).json()
        return str(models["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise SetupError(f"{endpoint}/models: {exc}", status=2) from exc


def _endpoint_settings(
    ttls: EndpointTTLs,
    model: str,
    *,
    time_scale: float,
    concurrency: int,
    honor_starts: bool,
    client: ClientName = "sdk",
) -> ReplaySettings:
    return ReplaySettings(
        model=model,
        time_scale=time_scale,
        router_ttl_s=ttls.router_s / time_scale,
        decoder_ttl_s=ttls.decoder_s / time_scale,
        gap_cap_real_s=ttls.decoder_s + 1,
        concurrency=concurrency,
        honor_starts=honor_starts,
        client=client,
    )


def describe_client(client: ClientName) -> str:
    """The report's line on who sent the turns."""
    return _CLIENTS[client]


_CLIENTS: dict[ClientName, str] = {
    "sdk": "sdk (agentkv's SDK, exact mode: token ids, X-Conversation-Id, X-AgentKV-Epoch)",
    "chat": "chat (raw HTTP: Chat Completions with X-Session-ID, no token ids, no agentkv "
    "header or field)",
    "messages": "messages (raw HTTP: Anthropic Messages as Claude Code sends it, "
    "X-Claude-Code-Session-Id, tool_use/tool_result blocks)",
    "responses": "responses (raw HTTP: OpenAI Responses as Codex sends it, store false, "
    "prompt_cache_key and session-id)",
}


def _check_client(client: ClientName, lease: LeaseParams | None) -> None:
    if client not in _CLIENTS:
        raise SetupError(f"unknown --client {client!r} (one of: {', '.join(_CLIENTS)})", status=2)
    if lease is not None and client != "sdk":
        raise SetupError("--leases needs --client sdk (leases are the SDK's)", status=2)


def endpoint_run(
    endpoint: str,
    *,
    ttls: EndpointTTLs,
    time_scale: float,
    concurrency: int = 8,
    honor_starts: bool = False,
    unverified_endpoint: str | None = None,
    compare: bool = False,
    lease: LeaseParams | None = None,
    lease_endpoint: str | None = None,
    lease_ttls: EndpointTTLs | None = None,
    client: ClientName = "sdk",
) -> ReplayRun:
    """The policies on running deployments: ``agentkv`` on ``endpoint`` (and ``none``, with
    ``compare`` the ``unverified`` router too), ``lease`` on ``lease_endpoint`` (its TTLs
    ``lease_ttls``, real seconds; by default D's is ``lease.max_hold_s`` scaled and the
    router's 30 trace seconds less)."""
    _check_client(client, lease)
    if compare and not unverified_endpoint:
        raise SetupError("--endpoint --compare needs --unverified-endpoint", status=2)
    if lease is not None and not lease_endpoint:
        raise SetupError(
            "--endpoint --leases needs --lease-endpoint (a router before a long-TTL D)", status=2
        )
    model = _served_model(endpoint)
    settings = _endpoint_settings(
        ttls,
        model,
        time_scale=time_scale,
        concurrency=concurrency,
        honor_starts=honor_starts,
        client=client,
    )
    targets: dict[Policy, str] = {"agentkv": endpoint}
    if compare:
        targets = {"none": endpoint, "unverified": str(unverified_endpoint), **targets}
    setup = {"endpoint": endpoint, "client": describe_client(client)}
    run = ReplayRun(targets, settings, setup=setup)
    if lease is not None and lease_endpoint:
        lttls = lease_ttls or EndpointTTLs(
            (lease.max_hold_s - 30.0) * time_scale, lease.max_hold_s * time_scale
        )
        own = _endpoint_settings(
            lttls, model, time_scale=time_scale, concurrency=concurrency, honor_starts=honor_starts
        )
        run.own["lease"] = PolicyTarget(lease_endpoint, replace(own, lease=lease))
        run.setup["lease endpoint"] = lease_endpoint
    return run


def _describe(s: Stack, preset: str | None, costs: str | None) -> dict[str, object]:
    return {
        "profile": f"{s.profile} ({s.description})",
        "simulator costs": costs or f"preset {preset or 'of the profile'}",
        "prefill prefix caching": "on" if s.prefill_prefix_caching else "off",
        "kv_recompute_threshold": s.kv_recompute_threshold,
        "chat template": "plain ChatML (agentkv/bench/chatml.jinja), thinking off",
        "token identity TTL": f"{s.identity_ttl_real_s / s.time_scale:,.0f} s (router's "
        f"identity.ttl_s; real: {s.identity_ttl_real_s:g} s)",
        "router_ttl_real_s": s.router_ttl_s * s.time_scale,
        "decoder_ttl_real_s": s.decoder_ttl_real_s,
    }


@contextlib.contextmanager
def local_run(
    profile: str,
    *,
    time_scale: float,
    preset: str | None = None,
    costs: str | None = None,
    compare: bool = False,
    concurrency: int = 8,
    honor_starts: bool = False,
    lease: LeaseParams | None = None,
    client: ClientName = "sdk",
    paths: str | None = None,
) -> Iterator[ReplayRun]:
    """Start ``profile`` for the run (with ``compare`` an unverified router beside agentkv's;
    with ``lease`` a second deployment whose D keeps blocks for ``lease.max_hold_s``;
    ``paths``: the routers' ``paths.mode`` policy, ``choose``, ``pull`` or ``decode``, instead of
    the profile's)."""
    _check_client(client, lease)
    options = {"paths": {"mode": paths}} if paths is not None else None
    with contextlib.ExitStack() as stack:
        try:
            s = stack.enter_context(
                local_stack(
                    profile,
                    time_scale=time_scale,
                    preset=preset,
                    costs=costs,
                    unverified=compare,
                    router_options=options,
                )
            )
            leased = None
            if lease is not None:
                leased = stack.enter_context(
                    local_stack(
                        profile,
                        time_scale=time_scale,
                        preset=preset,
                        costs=costs,
                        unverified=False,
                        decoder_ttl_s=int(lease.max_hold_s),
                        router_options={
                            **lease_router_options(lease, time_scale),
                            **(options or {}),
                        },
                    )
                )
        except Exception as exc:
            raise SetupError(f"could not start {profile}: {exc}", status=1) from exc
        targets: dict[Policy, str] = {"agentkv": s.base_url}
        if compare:
            assert s.unverified_url is not None
            targets = {"none": s.base_url, "unverified": s.unverified_url, **targets}
        settings = stack_settings(
            s, concurrency=concurrency, honor_starts=honor_starts, client=client
        )
        run = ReplayRun(
            targets,
            settings,
            decode_urls=s.decode_urls,
            engine_urls=s.engine_urls,
            drain_timeout_s=s.decoder_ttl_real_s + 5,
            setup={
                **_describe(s, preset, costs),
                "client": describe_client(client),
                "paths": paths or "the profile's",
            },
        )
        if leased is not None and lease is not None:
            own = stack_settings(
                leased, concurrency=concurrency, honor_starts=honor_starts, lease=lease
            )
            run.own["lease"] = stack_target(leased, own)
            run.setup["leases"] = (
                f"lease {lease.lease_s:g} s, UI idle {lease.ui_idle_s:g} s, on a second "
                f"deployment whose D keeps blocks {lease.max_hold_s:g} s (real: "
                f"{leased.decoder_ttl_real_s:g} s)"
            )
        yield run
