"""agentkv for LangChain and LangGraph: ``ChatAgentKV``, a chat model whose turns run through
agentkv conversations (one per LangGraph thread), token-exact and rewrite-safe."""

from __future__ import annotations

from agentkv.pool import ConversationPool, MemoryStateStore, StateStore, Turn
from agentkv_langchain.chat_models import ChatAgentKV, to_openai_message
from agentkv_langchain.stores import LangGraphStore

__all__ = [
    "ChatAgentKV",
    "ConversationPool",
    "LangGraphStore",
    "MemoryStateStore",
    "StateStore",
    "Turn",
    "to_openai_message",
]
__version__ = "0.1.0"
