"""agentkv for the OpenAI Agents SDK: ``AgentKVModelProvider``, models whose turns run through
agentkv conversations (one per agent session), token-exact and rewrite-safe."""

from __future__ import annotations

from agentkv_openai_agents._install import require_vllm_agentkv

require_vllm_agentkv("agentkv-openai-agents")  # before agentkv: PyPI's `agentkv` is another

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
