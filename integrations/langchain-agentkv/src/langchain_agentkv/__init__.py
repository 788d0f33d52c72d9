"""agentkv for LangChain and LangGraph: ``ChatAgentKV``, a chat model whose turns run through
agentkv conversations (one per LangGraph thread), token-exact and rewrite-safe."""

from __future__ import annotations

from langchain_agentkv._install import require_vllm_agentkv

require_vllm_agentkv("langchain-agentkv")  # before agentkv: PyPI's `agentkv` is another

from agentkv.pool import ConversationPool, MemoryStateStore, StateStore, Turn  # noqa: E402
from langchain_agentkv.chat_models import ChatAgentKV, to_openai_message  # noqa: E402
from langchain_agentkv.stores import LangGraphStore  # noqa: E402

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
