"""agentkv: fast, verified multi-turn KV reuse for AI agents on self-hosted vLLM.

The client SDK: :class:`Client` / :class:`AsyncClient` wrap the ``openai`` clients and give
every agent loop a :class:`Conversation` with a stable id, exact token ids and receipts.

Names are imported on first use, so ``agentkv sim`` and ``agentkv router`` processes do not pay
for the ``openai`` package at start-up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from agentkv import _installed
from agentkv.__version__ import __version__

_installed.warn()  # PyPI's `agentkv` is another project with the same import package

if TYPE_CHECKING:
    from agentkv._client import AsyncClient, Client, wrap
    from agentkv._conversation import (
        AsyncConversation,
        AsyncConversationStream,
        Conversation,
        ConversationStream,
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
    from agentkv._retry import RetryPolicy
    from agentkv._turn import AgentKVWarning

_WHERE = {
    "AgentKVError": "_exceptions",
    "AgentKVWarning": "_turn",
    "AsyncClient": "_client",
    "AsyncConversation": "_conversation",
    "AsyncConversationStream": "_conversation",
    "AsyncLocalRenderer": "_rendering",
    "AsyncRemoteRenderer": "_rendering",
    "AsyncRenderer": "_rendering",
    "Client": "_client",
    "Conversation": "_conversation",
    "ConversationError": "_exceptions",
    "ConversationStream": "_conversation",
    "Drift": "_receipt",
    "LocalRenderer": "_rendering",
    "RemoteRenderer": "_rendering",
    "RenderError": "_exceptions",
    "Renderer": "_rendering",
    "RetryPolicy": "_retry",
    "RewriteReport": "_receipt",
    "ServerCapabilityError": "_exceptions",
    "StateError": "_exceptions",
    "TurnReceipt": "_receipt",
    "wrap": "_client",
}

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
    "RetryPolicy",
    "RewriteReport",
    "ServerCapabilityError",
    "StateError",
    "TurnReceipt",
    "__version__",
    "wrap",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'agentkv' has no attribute {name!r}")
    obj = getattr(importlib.import_module(f"agentkv.{module}"), name)
    if getattr(obj, "__module__", "").startswith("agentkv._"):
        obj.__module__ = "agentkv"
    globals()[name] = obj
    return obj


def __dir__() -> list[str]:
    return sorted(__all__)
