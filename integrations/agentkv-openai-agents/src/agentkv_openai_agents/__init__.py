"""agentkv for the OpenAI Agents SDK: ``AgentKVModelProvider``, models whose turns run through
agentkv conversations (one per agent session), token-exact and rewrite-safe."""

from __future__ import annotations

try:  # before agentkv: PyPI's unrelated `agentkv` has the same import name
    from vllm_agentkv import require_vllm_agentkv  # shipped by vllm-agentkv
except ImportError as exc:
    raise ImportError("agentkv-openai-agents needs `pip install vllm-agentkv`") from exc
require_vllm_agentkv("agentkv-openai-agents")

from agentkv.pool import ConversationPool, MemoryStateStore, StateStore, Turn  # noqa: E402
from agentkv_openai_agents.provider import (  # noqa: E402
    AgentKVModel,
    AgentKVModelProvider,
    conversation,
)

__all__ = [
    "AgentKVModel",
    "AgentKVModelProvider",
    "ConversationPool",
    "MemoryStateStore",
    "StateStore",
    "Turn",
    "conversation",
]
__version__ = "0.1.0"
