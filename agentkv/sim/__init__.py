"""An engine simulator that speaks vLLM 0.33's OpenAI server and NixlConnector P/D protocol.

``create_app(SimConfig(...))`` builds one instance as an ASGI app; ``agentkv sim`` runs one.
It renders chat templates and tokenizes for real, keeps KV in a paged block pool with prefix
caching, moves blocks between instances like NIXL (over HTTP), and counts every prompt token
that would run on KV computed for other tokens (``agentkv_sim_wrong_kv_tokens_total``).
Needs the ``serve`` extra (a missing package is named with its install command).
"""

from __future__ import annotations

from agentkv._extras import raise_missing_extra

try:
    from agentkv.sim.app import create_app
    from agentkv.sim.config import SimConfig
    from agentkv.sim.faults import Faults
    from agentkv.sim.state import SimState
except ModuleNotFoundError as exc:  # an extra that is not installed: say which
    raise_missing_extra(exc, "agentkv.sim (the engine simulator)")

__all__ = ["Faults", "SimConfig", "SimState", "create_app"]
