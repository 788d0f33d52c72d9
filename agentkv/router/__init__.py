"""agentkv's KV-aware router for vLLM P/D with bidirectional KV transfer.

``create_app(RouterConfig(...))`` is the ASGI app; ``agentkv router`` runs it. Every reuse is
verified by token ids against what the decode instance holds (DESIGN.md, "Verified reuse").
Needs the ``serve`` extra (a missing package is named with its install command).
"""

from __future__ import annotations

from agentkv._extras import raise_missing_extra

try:
    from agentkv.router.app import create_app
    from agentkv.router.config import Backend, RouterConfig, Tenant
except ModuleNotFoundError as exc:  # an extra that is not installed: say which
    raise_missing_extra(exc, "agentkv.router (the router)")

__all__ = ["Backend", "RouterConfig", "Tenant", "create_app"]
