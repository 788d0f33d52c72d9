"""An engine simulator that speaks vLLM 0.33's OpenAI server and NixlConnector P/D protocol.

``create_app(SimConfig(...))`` builds one instance as an ASGI app; ``agentkv sim`` runs one.
It renders chat templates and tokenizes for real, keeps KV in a paged block pool with prefix
caching, moves blocks between instances like NIXL (over HTTP), and counts every prompt token
that would run on KV computed for other tokens (``agentkv_sim_wrong_kv_tokens_total``).
"""

from __future__ import annotations

from agentkv.sim.app import SimState, create_app
from agentkv.sim.config import SimConfig
from agentkv.sim.faults import Faults

__all__ = ["Faults", "SimConfig", "SimState", "create_app"]
