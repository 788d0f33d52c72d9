"""Router configuration data for tests: ``router_data(...)`` merges parts group by group.

Parts are nested like the router's configuration (``{"upstream": {"retries": 1}}``). A part with
the flat keys of before the groups (``retries``, ``store = "redis://…"``) is still nested, by the
router's own mapping (:func:`agentkv.router.config_legacy.migrate`), but with its
DeprecationWarning, which the test suite turns into an error.

A test marked ``paths_pull`` (``pytestmark = pytest.mark.paths_pull`` in a file whose tests
check P's reads of D's KV) gets :data:`PULL` under every part: each router it starts through
these helpers (``stack``, ``start_router``, ``inprocess_stack``, ``router_on``) sends every
later turn through P unless the test sets ``paths.mode`` itself. Unmarked tests get the
router's default, ``choose``."""

from __future__ import annotations

from typing import Any

from agentkv.router.config_legacy import migrate

__all__ = ["PULL", "pinned", "router_data"]

PULL: dict[str, Any] = {"paths": {"mode": "pull"}}
"""``paths.mode = "pull"``: every later turn through P, which reads D's KV back."""

pinned: list[dict[str, Any]] = []
"""Parts under every ``router_data``: ``[PULL]`` while a ``paths_pull`` test is set up and
runs (tests/conftest.py), else empty."""


def router_data(*parts: dict[str, Any] | None) -> dict[str, Any]:
    """``parts`` nested and merged in order, group by group."""
    out: dict[str, Any] = {}
    for part in (*pinned, *parts):
        nested = migrate(dict(part or {}), stacklevel=3)
        for group, value in nested.items():
            if isinstance(value, dict) and isinstance(out.get(group), dict):
                out[group] = {**out[group], **value}
            else:
                out[group] = value
    return out
