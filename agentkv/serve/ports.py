"""Port overrides for a loaded profile: ``agentkv serve PROFILE --port N --base-port B``.

A profile lays its ports out per group (``[prefill] base_port``, ``[decode] base_port``, the
NIXL side channels, P's KV-event ports; instance i of a group uses ``base + i``) and the router
on ``[router.http] port``. ``with_ports`` moves them without a TOML file:

* ``port``: the router's port (the OpenAI base URL ``http://HOST:PORT/v1``);
* ``base_port``: every engine port, consecutively from ``base_port``: the prefill instances'
  HTTP ports, then the decode instances', then (vLLM engines) the prefill and decode NIXL side
  channels, then P's KV-event ports when the profile has them. :func:`engine_ports` says how
  many that is.

The result is validated again, so a layout that collides with the router's port (or leaves
1-65535) is refused with a message naming the ports.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from agentkv.serve.profile_model import Profile
from agentkv.serve.profiles import ProfileError, format_validation_error

__all__ = ["engine_ports", "with_ports"]


def engine_ports(profile: Profile) -> int:
    """How many consecutive ports ``with_ports(profile, base_port=B)`` uses from ``B``."""
    n = profile.prefill.count + profile.decode.count
    if profile.engine == "vllm":
        n += profile.prefill.count + profile.decode.count
    if profile.prefill.kv_events_base_port is not None:
        n += profile.prefill.count
    if profile.decode.kv_events_base_port is not None:
        n += profile.decode.count
    return n


def with_ports(
    profile: Profile, *, port: int | None = None, base_port: int | None = None
) -> Profile:
    """``profile`` with the router on ``port`` and the engines' ports laid out from
    ``base_port`` (each left as it is when None). Raises :class:`ProfileError`."""
    if port is None and base_port is None:
        return profile
    data: dict[str, Any] = profile.model_dump(exclude_unset=True)  # what the profile set
    for group in ("prefill", "decode"):
        data.setdefault(group, {})
    if port is not None:
        data.setdefault("router", {}).setdefault("http", {})["port"] = port
    if base_port is not None:
        p, d = profile.prefill.count, profile.decode.count
        data["prefill"]["base_port"] = base_port
        data["decode"]["base_port"] = base_port + p
        nxt = base_port + p + d
        if profile.engine == "vllm":
            data["prefill"]["side_channel_base_port"] = nxt
            data["decode"]["side_channel_base_port"] = nxt + p
            nxt += p + d
        if profile.prefill.kv_events_base_port is not None:
            data["prefill"]["kv_events_base_port"] = nxt
            nxt += p
        if profile.decode.kv_events_base_port is not None:
            data["decode"]["kv_events_base_port"] = nxt
    flags = " ".join(
        f"--{name} {value}"
        for name, value in (("port", port), ("base-port", base_port))
        if value is not None
    )
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(format_validation_error(exc, f"{profile.name} with {flags}")) from None
