"""Router configuration data for tests: ``router_data(...)`` merges parts group by group.

Tests written before the groups pass the router's fields by their flat names (``retries``,
``store``, ``paths``); they are nested here by the router's own mapping
(:func:`agentkv.router.config_legacy.migrate`) without its DeprecationWarning, which
``tests/router/test_config.py`` checks."""

from __future__ import annotations

import warnings
from typing import Any

from agentkv.router.config_legacy import migrate

__all__ = ["router_data"]


def router_data(*parts: dict[str, Any] | None) -> dict[str, Any]:
    """``parts`` (nested, or with flat keys) nested and merged in order, group by group."""
    out: dict[str, Any] = {}
    for part in parts:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            nested = migrate(dict(part or {}))
        for group, value in nested.items():
            if isinstance(value, dict) and isinstance(out.get(group), dict):
                out[group] = {**out[group], **value}
            else:
                out[group] = value
    return out
