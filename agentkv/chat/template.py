"""Chat templates rendered the way vLLM's Hugging Face path renders them.

Two steps, as in vLLM 0.33 with ``transformers`` 5:

1. :func:`preprocess_messages` is vLLM's message parsing (``parse_chat_messages``): new message
   dicts with only the fields vLLM forwards, content as a string or as a list of text parts
   depending on the template's content format (:func:`detect_content_format`, vLLM's AST probe),
   reasoning copied to ``reasoning`` and ``reasoning_content``, tool-call ``arguments`` strings
   parsed into dicts.
2. :meth:`ChatTemplate.render` is ``tokenizer.apply_chat_template(..., tokenize=False)``: the
   same Jinja sandbox, filters and globals as ``transformers``, ``None``-valued keys dropped,
   reasoning aliased to ``thinking``, the tokenizer's special tokens as variables, and
   ``continue_final_message`` handled as ``transformers`` does.

:meth:`ChatTemplate.render_request` does both, plus vLLM's ``developer`` → ``system`` rewrite.
Errors raised while the template runs become :class:`TemplateError` with the template's own
message, which is what vLLM returns in its 400 response.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2

from agentkv.chat.content_format import ContentFormat, detect_content_format
from agentkv.chat.environment import environment
from agentkv.chat.messages import (
    REASONING_FIELDS,
    alias_reasoning_fields,
    consolidate_system_messages,
    developer_to_system,
    error_reason,
    normalize_messages,
    plain,
    preprocess_messages,
)
from agentkv.chat.tokenizer import DEFAULT_CHAT_TEMPLATE_PATH

if TYPE_CHECKING:
    from agentkv.chat.tokenizer import ChatTokenizer

__all__ = [
    "ChatTemplate",
    "ContentFormat",
    "TemplateError",
    "detect_content_format",
    "load_template",
    "preprocess_messages",
]

logger = logging.getLogger(__name__)


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateError(Exception):
    """The chat template failed: it called ``raise_exception``, hit a Jinja or sandbox error
    (``SecurityError``), or raised while running (e.g. ``TypeError`` on a dict argument).

    ``str(error)`` is the template's own message, as vLLM reports it; the original exception
    is ``__cause__``.
    """

    def __init__(self, message: str, *, template: str = "template") -> None:
        super().__init__(message)
        self.message = message
        self.template = template


class ChatTemplate:
    """A Jinja chat template, compiled once in ``transformers``' sandbox.

    ``special_tokens`` are the variables ``transformers`` adds from the tokenizer
    (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``: those that are set).
    """

    def __init__(
        self,
        source: str,
        *,
        name: str = "template",
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self.source = source
        self.name = name
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        try:
            self._template = environment().from_string(source)
        except jinja2.TemplateError as e:
            raise TemplateError(error_reason(e), template=name) from e
        self.content_format: ContentFormat = detect_content_format(source)
        # vLLM ``_detect_developer_role_support``
        self.supports_developer_role = '"developer"' in source or "'developer'" in source

    def __repr__(self) -> str:
        return f"ChatTemplate(name={self.name!r}, content_format={self.content_format!r})"

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool | str = False,
        bos_token: str | None = None,
        eos_token: str | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` as ``apply_chat_template(..., tokenize=False)`` would.

        ``messages`` should already be what vLLM hands the template (see
        :func:`preprocess_messages`). ``continue_final_message`` (or the name of the field to
        continue, e.g. ``"reasoning_content"``) cuts the text after the final message's content
        so generation carries it on. ``bos_token``/``eos_token`` override ``special_tokens``;
        ``template_kwargs`` are vLLM's ``chat_template_kwargs`` (``enable_thinking``, ...).
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        if not messages:
            raise ValueError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        chat = normalize_messages(messages)
        kwargs: dict[str, Any] = {**self.special_tokens, **template_kwargs}
        if bos_token is not None:
            kwargs["bos_token"] = bos_token
        if eos_token is not None:
            kwargs["eos_token"] = eos_token
        tool_list: list[Any] | None = None
        if tools is not None:
            tool_list = list(tools)
            if not all(isinstance(t, Mapping) for t in tool_list):
                raise ValueError("Tools should be JSON schemas (dicts).")
        doc_list: list[Any] | None = None
        if documents is not None:
            doc_list = list(documents)
            if not all(isinstance(d, Mapping) for d in doc_list):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")

        # transformers ``render_jinja_template`` from here on.
        tool_list = plain(tool_list)
        doc_list = plain(doc_list)
        kwargs = plain(kwargs)
        chat = alias_reasoning_fields(plain(chat))
        final_text: str | None = None
        if continue_final_message:
            final_text = self._tag_final_message(chat, continue_final_message)
        try:
            rendered = self._template.render(
                messages=chat,
                tools=tool_list,
                documents=doc_list,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except Exception as e:
            raise TemplateError(error_reason(e), template=self.name) from e
        if final_text is not None:
            rendered = self._cut_at_tag(rendered, final_text)
        return rendered

    def render_request(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **chat_template_kwargs: Any,
    ) -> str:
        """vLLM's whole chat-completions rendering of request ``messages`` (as a client sends
        them): :func:`preprocess_messages` in this template's content format, ``developer``
        messages turned into one leading ``system`` message when the template does not know
        that role, then :meth:`render`."""
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        conversation = preprocess_messages(messages, content_format=self.content_format)
        if not self.supports_developer_role and any(m["role"] == "developer" for m in conversation):
            conversation = consolidate_system_messages(developer_to_system(conversation))
        return self.render(
            conversation,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            documents=documents,
            **chat_template_kwargs,
        )

    def _tag_final_message(self, chat: list[dict[str, Any]], field: bool | str) -> str:
        """Append the continuation tag to the final message (``render_jinja_template``)."""
        key = field if isinstance(field, str) else "content"
        final = chat[-1].get(key)
        if final is None:
            raise ValueError(
                f'continue_final_message is set but the final message has no "{key}" to continue!'
            )
        fields = [key]
        if key in REASONING_FIELDS:
            fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final]
        if not any(f in self.source for f in fields):
            raise ValueError(
                f'continue_final_message is set to "{key}" but this is not an accepted field '
                "in the chat_template"
            )
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError(
                    "continue_final_message is set but we could not find any text to continue "
                    "in the final message!"
                )
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
        return str(final)

    def _cut_at_tag(self, rendered: str, final_text: str) -> str:
        tag = _CONTINUE_TAG.strip()
        if final_text.strip() not in rendered or tag not in rendered:
            raise ValueError(
                "continue_final_message is set but the final message does not appear in the "
                "chat after applying the chat template! This can happen if the chat template "
                "deletes portions of the final message."
            )
        at = rendered.rindex(tag)
        if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:at]
        return rendered[:at].rstrip()


def load_template(
    path: str | os.PathLike[str] | None = None,
    tokenizer: ChatTokenizer | None = None,
) -> ChatTemplate:
    """A template file (read as vLLM reads ``--chat-template``: text mode, so CRLF becomes LF);
    ``None`` means the tokenizer's own template, else the packaged Qwen3 one. The tokenizer's
    special tokens become template variables."""
    special = tokenizer.special_tokens_map if tokenizer is not None else None
    if path is not None:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        return ChatTemplate(source, name=Path(path).name, special_tokens=special)
    if tokenizer is not None and tokenizer.chat_template is not None:
        return ChatTemplate(tokenizer.chat_template, name=tokenizer.name, special_tokens=special)
    with open(DEFAULT_CHAT_TEMPLATE_PATH, encoding="utf-8") as f:
        source = f.read()
    return ChatTemplate(source, name=DEFAULT_CHAT_TEMPLATE_PATH.name, special_tokens=special)
