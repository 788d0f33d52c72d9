"""Router configuration data for tests: ``router_data(...)`` merges parts group by group.

Parts are nested like the router's configuration (``{"upstream": {"retries": 1}}``). A part with
the flat keys of before the groups (``retries``, ``store = "redis://…"``) is still nested, by the
router's own mapping (:func:`agentkv.router.config_legacy.migrate`), but with its
DeprecationWarning, which the test suite turns into an error."""

from __future__ import annotations

from typing import Any

from agentkv.router.config_legacy import migrate

__all__ = ["router_data"]


def router_data(*parts: dict[str, Any] | None) -> dict[str, Any]:
    """``parts`` nested and merged in order, group by group."""
    out: dict[str, Any] = {}
    for part in parts:
        nested = migrate(dict(part or {}), stacklevel=3)
        for group, value in nested.items():
            if isinstance(value, dict) and isinstance(out.get(group), dict):
                out[group] = {**out[group], **value}
            else:
                out[group] = value
    return out
