"""agentkv for LlamaIndex: ``AgentKV``, a function-calling LLM whose turns run through agentkv
conversations (one per chat session), token-exact and rewrite-safe."""

from __future__ import annotations

from agentkv.pool import ConversationPool, MemoryStateStore, StateStore, Turn
from agentkv_llamaindex.llms import AgentKV, session, to_openai_message

__all__ = [
    "AgentKV",
    "ConversationPool",
    "MemoryStateStore",
    "StateStore",
    "Turn",
    "session",
    "to_openai_message",
]
__version__ = "0.1.0"
