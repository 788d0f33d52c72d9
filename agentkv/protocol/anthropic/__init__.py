"""The Anthropic Messages API over Chat Completions, as vLLM 0.33 maps one onto the other.

vLLM serves ``POST /v1/messages`` by converting the request into a ``ChatCompletionRequest``,
running its chat path and converting the answer back. This package is that codec, mirrored from
vLLM 0.33.0's ``vllm/entrypoints/anthropic/protocol.py`` (the request models and the error
vocabulary) and ``vllm/entrypoints/anthropic/serving.py`` (``to_chat_completion_request``,
``messages_full_converter``, ``message_stream_converter``, ``count_tokens``), so that the router
and the simulator put exactly vLLM's chat request in front of the engines:

* request (:mod:`.models`, :mod:`.request`): :func:`parse_request` validates a body as vLLM's
  pydantic models do (unknown fields, such as Claude Code's ``context_management`` or a block's
  ``cache_control``, are ignored, as there), :func:`to_chat` builds the Chat Completions body;
  :func:`messages_to_chat` does both;
* answer (:mod:`.answer`): :func:`chat_to_message` (a non-streamed answer), :class:`MessageStream`
  (the chat SSE chunks as Anthropic's ``event:``/``data:`` events), :func:`error_body`
  (Anthropic's error shape).

Pure functions, no I/O. Where this departs from vLLM it says so: the message id is ``msg_…``
(vLLM returns the chat completion's id), vLLM's template-dependent choices (merging inline
``system`` messages, the effort of ``thinking: disabled``) are the caller's arguments, and the
``reasoning_effort`` is also folded into ``chat_template_kwargs`` as vLLM's chat path does when it
renders (``ChatCompletionRequest.build_chat_params``), so that ``/tokenize`` renders the same
prompt as the chat endpoint.
"""

from __future__ import annotations

from agentkv.protocol.anthropic.answer import (
    MessageStream,
    chat_to_message,
    error_body,
    error_type,
)
from agentkv.protocol.anthropic.models import (
    EFFORTS,
    BadRequest,
    ContentBlock,
    CountTokensRequest,
    Message,
    MessagesRequest,
    parse_request,
)
from agentkv.protocol.anthropic.request import (
    BILLING_HEADER,
    count_tokens_body,
    messages_to_chat,
    to_chat,
)

__all__ = [
    "BILLING_HEADER",
    "EFFORTS",
    "BadRequest",
    "ContentBlock",
    "CountTokensRequest",
    "Message",
    "MessageStream",
    "MessagesRequest",
    "chat_to_message",
    "count_tokens_body",
    "error_body",
    "error_type",
    "messages_to_chat",
    "parse_request",
    "to_chat",
]
