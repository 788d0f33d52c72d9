"""agentkv for LangChain and LangGraph: ``ChatAgentKV``, a chat model whose turns run through
agentkv conversations (one per LangGraph thread), token-exact and rewrite-safe."""

from __future__ import annotations

try:  # before agentkv: PyPI's unrelated `agentkv` has the same import name
    from vllm_agentkv import require_vllm_agentkv  # shipped by vllm-agentkv
except ImportError as exc:
    raise ImportError("langchain-agentkv needs `pip install vllm-agentkv`") from exc
require_vllm_agentkv("langchain-agentkv")

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
