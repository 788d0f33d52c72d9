"""A profile's ``[router]`` table: the router's own configuration model
(:class:`~agentkv.router.config.RouterConfig`) less what the profile sets, and the deprecated
flat ``[router]`` keys of before the groups."""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

from pydantic import ConfigDict, Field, model_validator

from agentkv.router.config import RouterConfig
from agentkv.router.config_legacy import migrate

__all__ = ["ROUTER_OWNED", "RouterSettings", "nest_router"]


class RouterSettings(RouterConfig):
    """``[router]``: agentkv's router in front of the engines. Its configuration itself
    (:class:`~agentkv.router.config.RouterConfig`, each group a table: ``[router.http]``,
    ``[router.store]``, ``[router.retention]``, …) less what the profile sets
    (:data:`ROUTER_OWNED`), and the router process's ``replicas`` and ``env``."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    complete: ClassVar[bool] = False  # expand() adds the engines; Profile checks the TTLs

    replicas: int = Field(1, ge=1)
    """Router replicas (Kubernetes rendering; they share the Redis store)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of the router process."""

    @model_validator(mode="before")
    @classmethod
    def _options(cls, data: Any) -> Any:
        return nest_router(data) if isinstance(data, dict) else data


def nest_router(table: dict[str, Any]) -> dict[str, Any]:
    """A profile's ``[router]`` table of before the groups (deprecated, a DeprecationWarning
    each): ``[router.options]``'s keys are the router's, and flat keys (``port``,
    ``ttl_margin_s``, ``store``) go to their groups. Done per file before ``extends`` merges, so
    an old key of a profile overrides its parent's nested one."""
    if isinstance(table.get("options"), dict):
        warnings.warn(
            "profile key 'router.options' is deprecated: set the router's keys in [router.GROUP] "
            "tables (e.g. [router.upstream] prefill_deadline_s = 30)",
            DeprecationWarning,
            stacklevel=3,
        )
        table = dict(table)
        table = {**table.pop("options"), **table}
    return migrate(table, stacklevel=3)


ROUTER_OWNED = {
    "upstream": ("prefill", "decode", "block_size", "kv_recompute_threshold"),
    "retention": ("decoder_kv_blocks_ttl_s",),
    "http": ("host",),
}
"""The router's keys a profile sets itself (from its engines, the profile's own keys, and the
host given to ``expand()``): ``[router.GROUP]`` may not set them."""
