"""agentkv for LlamaIndex: ``AgentKV``, a function-calling LLM whose turns run through agentkv
conversations (one per chat session), token-exact and rewrite-safe."""

from __future__ import annotations

try:  # before agentkv: PyPI's unrelated `agentkv` has the same import name
    from vllm_agentkv import require_vllm_agentkv  # shipped by vllm-agentkv
except ImportError as exc:
    raise ImportError("llama-index-llms-agentkv needs `pip install vllm-agentkv`") from exc
require_vllm_agentkv("llama-index-llms-agentkv")

from llama_index.llms.agentkv.base import AgentKV, session, to_openai_message  # noqa: E402

from agentkv.pool import ConversationPool, MemoryStateStore, StateStore, Turn  # noqa: E402

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
