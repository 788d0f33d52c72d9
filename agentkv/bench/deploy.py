"""A deployment for benchmarks: a launch profile on free ports, its TTLs on a compressed clock,
and a second router with the unverified policy on the same engines.

Replaying a trace ``time_scale`` times faster than it happened needs the retention clock
compressed the same way, so that a gap decides reuse exactly as it would at full speed:

* the router's TTL (where it decides ``expired``) becomes ``(D TTL − margin) × time_scale``;
* D's TTL becomes that plus ``max(margin × time_scale, 6 s)``: prefill declines reads within
  5 s of D's expiry on its own (unscaled) clock, so the real margin must stay above 5 s. D may
  therefore hold an expired handle's blocks a little longer than the scaled TTL; the report's
  retained block-seconds are modelled from the trace's gaps at full speed instead.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentkv import procs

__all__ = ["CHATML_TEMPLATE", "P_MARGIN_FLOOR_S", "Stack", "compressed_ttls", "local_stack"]

CHATML_TEMPLATE = Path(__file__).with_name("chatml.jinja")
"""Plain ChatML: re-rendered history is token-identical to the exact history (Qwen3's own
template drops earlier answers' think blocks when it re-renders, so every rewrite would differ
from the first answer on)."""

P_MARGIN_FLOOR_S = 6.0
"""Smallest real margin between the router's TTL and D's: P's 5 s expiry margin + 1 s."""


@dataclass(frozen=True)
class Stack:
    """What a replay talks to."""

    base_url: str
    """The verified router's OpenAI base URL (``…/v1``)."""
    unverified_url: str | None
    """A router with ``paths.reuse_policy = "unverified"`` on the same engines, when started."""
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    model: str
    block_size: int
    time_scale: float
    router_ttl_s: float
    """Trace seconds: gaps at least this long find the handle expired."""
    decoder_ttl_s: float
    """Trace seconds: D's ``decoder_kv_blocks_ttl`` at full speed."""
    decoder_ttl_real_s: float
    """Real seconds D holds a finished turn's blocks in this deployment."""
    profile: str
    description: str
    kv_recompute_threshold: int
    prefill_prefix_caching: bool
    identity_ttl_real_s: float = 0.0
    """Real seconds the router keeps a conversation's token identity (``identity.ttl_s``)."""

    @property
    def engine_urls(self) -> tuple[str, ...]:
        return self.prefill_urls + self.decode_urls


def compressed_ttls(
    decoder_ttl_s: float, margin_s: float, time_scale: float
) -> tuple[int, float, float]:
    """(D's TTL, router margin, router TTL) in real seconds for a replay ``time_scale`` times
    real time (see the module docstring); D's TTL is whole seconds, as vLLM takes it."""
    router_ttl = (decoder_ttl_s - margin_s) * time_scale
    decoder = math.ceil(router_ttl + max(margin_s * time_scale, P_MARGIN_FLOOR_S))
    return decoder, decoder - router_ttl, router_ttl


def _free_range(count: int, taken: set[int]) -> int:
    """A base port with ``count`` free ports after it, none of them in ``taken`` (which gets
    them)."""
    base = procs.free_port_range(count, avoid=taken)
    taken.update(range(base, base + count))
    return base


@contextlib.contextmanager
def start_router(config: dict[str, Any], *, timeout_s: float = 60.0) -> Iterator[str]:
    """Run ``agentkv router`` with ``config`` on a free port (in a session of its own); yields
    its root URL."""
    from agentkv.serve.supervisor import start_router as router_process

    with router_process(config, timeout_s=timeout_s, new_session=True) as router:
        yield router.url


@contextlib.contextmanager
def local_stack(
    profile: str,
    *,
    time_scale: float = 1.0,
    preset: str | None = None,
    costs: str | None = None,
    num_blocks: int | None = None,
    template: str | None = str(CHATML_TEMPLATE),
    decode_prefix_caching: bool | None = None,
    unverified: bool = True,
    decoder_ttl_s: int | None = None,
    router_options: dict[str, Any] | None = None,
    startup_timeout_s: float = 180.0,
) -> Iterator[Stack]:
    """Start ``profile`` (a built-in name or TOML file) for a replay: free ports, TTLs (D's, the
    router's, token identity's) compressed by ``time_scale``, simulator delays scaled by it too,
    the simulator's template ``template`` unless the profile names one, and (``unverified``) a
    second router with vLLM's example-proxy policy on the same engines. ``decoder_ttl_s``
    replaces the profile's D TTL (trace seconds, e.g. a long one for leases);
    ``router_options`` are more ``RouterConfig`` keys, by group (``{"paths": {"mode": …}}``; real
    seconds)."""
    from agentkv.serve import Profile, expand, load_profile
    from agentkv.serve.supervisor import Supervisor

    if time_scale <= 0:
        raise ValueError("time_scale must be positive")
    base = load_profile(profile)
    if decoder_ttl_s is not None:
        base = base.model_copy(update={"decoder_kv_blocks_ttl_s": decoder_ttl_s})
    data = base.model_dump(exclude_unset=True)  # what the profile set (the router refuses more)
    for part in ("prefill", "decode", "router"):
        data.setdefault(part, {})
    router = data["router"]
    d_ttl, margin, _ = compressed_ttls(
        base.decoder_kv_blocks_ttl_s, base.router.retention.ttl_margin_s, time_scale
    )
    data["decoder_kv_blocks_ttl_s"] = d_ttl
    if decode_prefix_caching is not None:
        data["decode"]["prefix_caching"] = decode_prefix_caching
    router.setdefault("retention", {})["ttl_margin_s"] = margin
    # token identity outlives the KV by its own TTL (trace seconds, compressed the same way)
    router.setdefault("identity", {})["ttl_s"] = base.router.identity.ttl_s * time_scale
    for group, values in (router_options or {}).items():
        router[group] = {**router.get(group, {}), **values}
    taken: set[int] = set()
    router.setdefault("http", {})["port"] = _free_range(1, taken)
    for role in ("prefill", "decode"):
        count = base.group(role).count
        data[role]["base_port"] = _free_range(count, taken)
        data[role]["side_channel_base_port"] = _free_range(count, taken)
        if data[role].get("kv_events_base_port") is not None:
            data[role]["kv_events_base_port"] = _free_range(count, taken)
    if base.engine == "sim":
        sim = dict(data.get("sim") or {})
        sim["time_scale"] = time_scale
        if preset is not None:
            sim["preset"] = preset
        if num_blocks is not None:
            sim["num_blocks"] = num_blocks
        if template is not None and not sim.get("template"):
            sim["template"] = template
        data["sim"] = sim
        if costs is not None:
            data["extra_args"] = [*data.get("extra_args", []), "--costs", str(Path(costs))]
    prof = Profile.model_validate(data)
    deployment = expand(prof)
    with Supervisor(deployment, console=None, startup_timeout_s=startup_timeout_s) as _:
        urls = {
            role: tuple(
                p.health_url.removesuffix("/health") for p in deployment.processes if p.role == role
            )
            for role in ("prefill", "decode")
        }
        with contextlib.ExitStack() as stack:
            unverified_url = None
            if unverified:
                paths = {**deployment.router_config.get("paths", {}), "reuse_policy": "unverified"}
                config = {**deployment.router_config, "paths": paths}
                unverified_url = stack.enter_context(start_router(config)) + "/v1"
            yield Stack(
                base_url=deployment.base_url,
                unverified_url=unverified_url,
                prefill_urls=urls["prefill"],
                decode_urls=urls["decode"],
                model=prof.served_model_name,
                block_size=prof.block_size,
                time_scale=time_scale,
                router_ttl_s=base.router_ttl_s,
                decoder_ttl_s=float(base.decoder_kv_blocks_ttl_s),
                decoder_ttl_real_s=float(d_ttl),
                profile=base.name,
                description=base.description,
                kv_recompute_threshold=prof.kv_recompute_threshold,
                prefill_prefix_caching=prof.prefill.prefix_caching,
                identity_ttl_real_s=float(router["identity"]["ttl_s"]),
            )
