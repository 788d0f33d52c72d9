"""agentkv for the OpenAI Agents SDK: ``AgentKVModelProvider``, models whose turns run through
agentkv conversations (one per agent session), token-exact and rewrite-safe."""

from __future__ import annotations

from agentkv.pool import ConversationPool, MemoryStateStore, StateStore, Turn
from agentkv_openai_agents.provider import AgentKVModel, AgentKVModelProvider, conversation

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
