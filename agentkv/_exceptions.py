"""agentkv's errors. Every one names what to do about it.

::

    AgentKVError
    ├── ConversationError       bad use of a conversation (unknown tool_call_id, empty rewrite, …)
    │   └── StateError          a saved state that cannot be restored
    ├── RenderError             new messages could not become tokens (template, /tokenize)
    └── ServerCapabilityError   the server lacks what the chosen mode needs

Errors from the ``openai`` package (``openai.APIError`` and its subclasses) pass through
unchanged.
"""

from __future__ import annotations

__all__ = [
    "AgentKVError",
    "ConversationError",
    "RenderError",
    "ServerCapabilityError",
    "StateError",
]


class AgentKVError(Exception):
    """The root of agentkv's errors; ``conversation_id`` names the conversation when known."""

    def __init__(self, message: str, *, conversation_id: str | None = None) -> None:
        super().__init__(message)
        self.conversation_id = conversation_id


class ConversationError(AgentKVError):
    """A conversation was used in a way that would corrupt its history; nothing was changed."""


class StateError(ConversationError):
    """A saved conversation state is malformed or from an incompatible version."""


class RenderError(AgentKVError):
    """New messages could not be turned into token ids."""


class ServerCapabilityError(AgentKVError):
    """The server does not support what this mode needs (e.g. ``/tokenize`` in exact mode)."""
