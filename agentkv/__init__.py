"""agentkv: fast, verified multi-turn KV reuse for AI agents on self-hosted vLLM.

The client SDK: :class:`Client` / :class:`AsyncClient` wrap the ``openai`` clients and give
every agent loop a :class:`Conversation` with a stable id, exact token ids and receipts.
"""

from __future__ import annotations

from agentkv.__version__ import __version__
from agentkv._client import (
    AsyncClient,
    AsyncConversation,
    AsyncConversationStream,
    Client,
    Conversation,
    ConversationStream,
    wrap,
)
from agentkv._exceptions import (
    AgentKVError,
    ConversationError,
    RenderError,
    ServerCapabilityError,
    StateError,
)
from agentkv._receipt import Drift, RewriteReport, TurnReceipt
from agentkv._rendering import (
    AsyncLocalRenderer,
    AsyncRemoteRenderer,
    AsyncRenderer,
    LocalRenderer,
    RemoteRenderer,
    Renderer,
)
from agentkv._turn import AgentKVWarning

__all__ = [
    "AgentKVError",
    "AgentKVWarning",
    "AsyncClient",
    "AsyncConversation",
    "AsyncConversationStream",
    "AsyncLocalRenderer",
    "AsyncRemoteRenderer",
    "AsyncRenderer",
    "Client",
    "Conversation",
    "ConversationError",
    "ConversationStream",
    "Drift",
    "LocalRenderer",
    "RemoteRenderer",
    "RenderError",
    "Renderer",
    "RewriteReport",
    "ServerCapabilityError",
    "StateError",
    "TurnReceipt",
    "__version__",
    "wrap",
]

for _name in __all__:
    _obj = globals()[_name]
    if hasattr(_obj, "__module__") and _obj.__module__.startswith("agentkv._"):
        _obj.__module__ = "agentkv"
