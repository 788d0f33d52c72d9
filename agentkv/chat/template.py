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

import copy
import dataclasses
import json
import logging
import os
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.sandbox
import jinja2.utils

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

ContentFormat = Literal["string", "openai"]
"""vLLM's two content formats: ``"string"`` joins text parts; ``"openai"`` keeps a list."""

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Names a message's reasoning goes under; the first is the one templates read (transformers).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Text-like content part types (vLLM ``TEXT_PART_TYPES``) and the key holding their text.
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# Keys of vLLM's content part types; the others are kept on text parts in "openai" format.
_KNOWN_PART_KEYS = frozenset(
    {
        "type", "text", "refusal", "thinking", "closed", "image_url", "input_audio", "file",
        "audio_url", "video_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds",
        "data", "uuid", "name",
    }
)  # fmt: skip
_CLAUDE_CODE_BILLING_HEADER = "x-anthropic-billing-header"


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
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise TemplateError(_error_reason(e), template=name) from e
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
        chat = _normalize_messages(messages)
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
        tool_list = _plain(tool_list)
        doc_list = _plain(doc_list)
        kwargs = _plain(kwargs)
        chat = _alias_reasoning_fields(_plain(chat))
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
            raise TemplateError(_error_reason(e), template=self.name) from e
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
            conversation = _consolidate_system_messages(_developer_to_system(conversation))
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
        if key in _REASONING_FIELDS:
            fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
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


# --------------------------------------------------------------------------------------------
# vLLM message preprocessing


def preprocess_messages(
    messages: Sequence[Mapping[str, Any]],
    *,
    content_format: ContentFormat,
) -> list[dict[str, Any]]:
    """vLLM's ``parse_chat_messages`` for text content; returns new dicts, never edits inputs.

    Each message keeps ``role`` and ``content`` plus: ``tool_calls`` and the reasoning
    (``reasoning``, else the deprecated ``reasoning_content``, copied to both names) on
    assistant messages, ``tool_call_id`` on tool messages, ``name`` and ``task`` when strings,
    ``tools`` on developer messages. Other fields are dropped, as vLLM drops them.

    Content: in ``"string"`` format, ``None`` becomes ``""`` and text parts are joined with
    ``"\\n"``; in ``"openai"`` format a string becomes ``[{"type": "text", "text": ...}]`` and
    ``None`` ``[]``. Tool results made only of text parts become one string in both formats.
    Tool-call ``arguments`` strings are ``json.loads``-ed; invalid JSON, non-objects and empty
    values become ``{}`` (vLLM logs a warning and goes on), and an empty ``tool_calls`` list is
    removed. Non-text content parts (images, audio, ...) raise ``ValueError``.
    """
    conversation = [_parse_message(m, content_format) for m in messages]
    _postprocess_tool_calls(conversation)
    return conversation


def _parse_message(message: Mapping[str, Any], content_format: ContentFormat) -> dict[str, Any]:
    role = message["role"]
    content = message.get("content")
    # ChatCompletionRequest renames the deprecated ``reasoning_content`` to ``reasoning``.
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")

    parts: list[Any]
    if content is None:
        parts = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list | tuple):
        parts = list(content)
    else:
        raise ValueError(
            f"Message content must be a string or a list of content parts, "
            f"not {type(content).__name__}."
        )
    if role == "system":
        parts = _strip_billing_header(parts)
    wrap = content_format == "openai"
    parsed = [p for p in (_parse_part(part, wrap) for part in parts) if p]
    result: dict[str, Any] = {
        "role": role,
        "content": parsed if wrap else "\n".join(parsed),
    }
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            result["tool_calls"] = copy.deepcopy(list(tool_calls))
        if reasoning is not None:
            result["reasoning"] = reasoning
            result["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        items = result["content"]
        if isinstance(items, list) and not any(
            isinstance(i, dict) and i.get("type") != "text" for i in items
        ):
            texts = [i.get("text", "") for i in items if isinstance(i, dict)]
            result["content"] = "\n".join(texts) if texts else ""
    if isinstance(message.get("name"), str):
        result["name"] = message["name"]
    if isinstance(message.get("task"), str):
        result["task"] = message["task"]
    if role == "developer":
        result["tools"] = copy.deepcopy(message.get("tools"))
    return result


def _parse_part(part: Any, wrap: bool) -> Any:
    """One content part as vLLM's ``parse_chat_message_content_part`` (text-only)."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if wrap else part
    if not isinstance(part, Mapping):
        raise ValueError(f"Invalid content part: {part!r}")
    part_type = part.get("type")
    if part_type is None:
        if "tool_reference" in part:
            part_type = "tool_reference"
        else:
            raise ValueError("Missing 'type' field in multimodal part.")
    if part_type == "tool_reference":
        name = part.get("name")
        return {"type": "tool_reference", "name": name} if wrap else name
    if part_type not in _TEXT_PARTS:
        raise ValueError(
            f"Unsupported content part type for the simulator (text only): {part_type!r}"
        )
    text = part.get(_TEXT_PARTS[part_type])
    if text is None and part_type in ("text", "refusal"):
        logger.warning("Skipping content part %r with empty content.", part_type)
        return None
    if not wrap:
        return text
    extra = {k: copy.deepcopy(v) for k, v in part.items() if k not in _KNOWN_PART_KEYS}
    return {"type": "text", "text": text, **extra}


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """Drop Claude Code's per-request ``x-anthropic-billing-header`` line from system text."""
    out: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            text: object = part
        elif isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(_CLAUDE_CODE_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _postprocess_tool_calls(conversation: list[dict[str, Any]]) -> None:
    """vLLM ``_postprocess_messages``: tool-call arguments become dicts."""
    for message in conversation:
        if message["role"] != "assistant" or "tool_calls" not in message:
            continue
        tool_calls = message["tool_calls"]
        if not isinstance(tool_calls, list):
            continue
        if not tool_calls:
            del message["tool_calls"]  # keeps templates on the plain assistant path
            continue
        for item in tool_calls:
            if not isinstance(item, dict):
                raise ValueError("assistant tool_calls entries must be objects.")
            function = item.get("function")
            if item.get("type", "function") != "function" or not isinstance(function, dict):
                raise ValueError(
                    "chat completions only support assistant tool_calls of type 'function'."
                )
            arguments = function.get("arguments")
            parsed: Any = {}
            if isinstance(arguments, dict) and arguments:
                parsed = arguments
            elif isinstance(arguments, str) and arguments:
                try:
                    parsed = json.loads(arguments)
                except json.JSONDecodeError:
                    logger.warning(
                        "Tool call has arguments that are not valid JSON (%d chars); "
                        "coercing to an empty object so the conversation can continue.",
                        len(arguments),
                    )
                    parsed = None
            elif arguments:
                parsed = arguments
            if not isinstance(parsed, dict):
                if parsed is not None:
                    logger.warning(
                        "Tool call arguments decoded to %s, not a JSON object; "
                        "coercing to an empty object.",
                        type(parsed).__name__,
                    )
                parsed = {}
            function["arguments"] = parsed


def _developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for msg in conversation:
        if msg["role"] == "developer":
            msg = {k: v for k, v in msg.items() if k != "tools"}
            msg["role"] = "system"
        out.append(msg)
    return out


def _consolidate_system_messages(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge all system messages into one at position 0 (vLLM)."""
    contents: list[str] = []
    others: list[dict[str, Any]] = []
    needed = False
    for i, msg in enumerate(conversation):
        if msg["role"] != "system":
            others.append(msg)
            continue
        if i > 0 or contents:
            needed = True
        content = msg.get("content", "")
        if isinstance(content, list):
            texts = [
                p["text"] if isinstance(p, dict) else p
                for p in content
                if (isinstance(p, dict) and "text" in p) or isinstance(p, str)
            ]
            content = "\n".join(texts)
        if content:
            contents.append(content)
    if not needed:
        return conversation
    return [{"role": "system", "content": "\n\n".join(contents)}, *others]


# --------------------------------------------------------------------------------------------
# transformers' input normalisation


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``_normalize_chat_messages``: objects to dicts, then drop keys whose value is ``None``."""
    out = []
    for message in _objects_to_dicts(list(messages)):
        if not isinstance(message, dict):
            raise TypeError(
                "Chat messages should be dicts, dataclasses or pydantic models, "
                f"but got {message!r}."
            )
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def _objects_to_dicts(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _objects_to_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_objects_to_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_objects_to_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _objects_to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)
        }
    if callable(getattr(value, "model_dump", None)):
        return _objects_to_dicts(value.model_dump())
    return value


def _plain(value: Any) -> Any:
    """``_plain_template_data``: rebuild what the template sees from plain JSON types."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        return _plain(value.item())  # numpy scalars (``np.generic``)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning_fields(chat: list[Any]) -> list[Any]:
    """Fill ``reasoning_content`` (and ``thinking``, read by gpt-oss) from any reasoning name."""
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next(
                (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
            )
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _error_reason(exc: BaseException) -> str:
    """vLLM ``_template_error_reason``: the innermost Jinja error's text, else ``str(exc)``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(exc)


# --------------------------------------------------------------------------------------------
# The Jinja environment (transformers ``_cached_compile_jinja_template``)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (assistant-mask marker)."""

    tags = {"generation"}  # noqa: RUF012 (Extension API)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_generation_support")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(
        self, context: jinja2.nodes.EvalContext, caller: jinja2.runtime.Macro
    ) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' override: no HTML escaping, and json.dumps' options exposed.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates: calling it builds a dict, but it has no attributes to abuse."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` that refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}. Please rename the attribute."
            )


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


# --------------------------------------------------------------------------------------------
# Content format detection (vLLM ``_detect_content_format``): "openai" when the template loops
# over a message's content.

_N = jinja2.nodes


@lru_cache(maxsize=32)
def detect_content_format(source: str) -> ContentFormat:
    """``"openai"`` when the template iterates over ``message['content']`` (directly, through
    an alias, or through a macro parameter), else ``"string"``; unparsable templates are
    ``"string"``. This is vLLM's AST probe for ``--chat-template-content-format auto``."""
    try:
        ast = _environment().parse(source)
        next(_content_loops(ast))
    except StopIteration:
        return "string"
    except Exception:
        return "string"
    return "openai"


def _is_var(node: jinja2.nodes.Node, varname: str) -> bool:
    if isinstance(node, _N.Name):
        return node.ctx == "load" and node.name == varname
    if isinstance(node, _N.Getattr) and "." in varname:  # `ns.rest`
        base, _, attr = varname.rpartition(".")
        return node.attr == attr and _is_var(node.node, base)
    return False


def _is_attr(node: jinja2.nodes.Node, varname: str, key: str) -> bool:
    if isinstance(node, _N.Getitem):
        return (
            _is_var(node.node, varname) and isinstance(node.arg, _N.Const) and node.arg.value == key
        )
    if isinstance(node, _N.Getattr):
        return _is_var(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, varname: str, key: str | None = None) -> bool:
    if isinstance(node, _N.Filter):
        return node.node is not None and _is_var_or_elems(node.node, varname, key)
    if isinstance(node, _N.Test):
        return _is_var_or_elems(node.node, varname, key)
    if isinstance(node, _N.Getitem) and isinstance(node.arg, _N.Slice):
        return _is_var_or_elems(node.node, varname, key)
    return _is_attr(node, varname, key) if key else _is_var(node, varname)


def _dotted_name(node: jinja2.nodes.Node) -> str | None:
    if isinstance(node, _N.NSRef):
        return f"{node.name}.{node.attr}"
    parts = []
    while isinstance(node, _N.Getattr):
        parts.append(node.attr)
        node = node.node
    if isinstance(node, _N.Name):
        parts.append(node.name)
        return ".".join(reversed(parts))
    return None


def _aliases_of(root: jinja2.nodes.Template, varname: str) -> Iterator[str]:
    """``varname`` and every variable assigned from it (breadth first)."""
    yield varname
    seen = {varname}
    pending = deque([varname])
    while pending:
        related = pending.popleft()
        for assign in root.find_all(_N.Assign):
            lhs, rhs = assign.target, assign.node
            if isinstance(lhs, _N.Name) and _is_var_or_elems(rhs, related):
                yield lhs.name
                if lhs.name != related and lhs.name not in seen:
                    seen.add(lhs.name)
                    pending.append(lhs.name)
            aliases: list[str] = []
            if (
                isinstance(lhs, _N.Name)
                and isinstance(rhs, _N.Call)
                and isinstance(rhs.node, _N.Name)
                and rhs.node.name == "namespace"
            ):
                aliases = [
                    f"{lhs.name}.{kw.key}"
                    for kw in rhs.kwargs
                    if _is_var_or_elems(kw.value, related)
                ]
            elif isinstance(lhs, (_N.Getattr, _N.NSRef)) and _is_var_or_elems(rhs, related):
                dotted = _dotted_name(lhs)
                aliases = [dotted] if dotted is not None else []
            for alias in aliases:
                yield alias
                if alias != related and alias not in seen:
                    seen.add(alias)
                    pending.append(alias)


def _message_loops(root: jinja2.nodes.Template) -> Iterator[str]:
    """Loop variables of ``{% for message in messages %}``-like loops."""
    names = list(_aliases_of(root, "messages"))
    for loop in root.find_all(_N.For):
        for varname in names:
            if _is_var_or_elems(loop.iter, varname):
                if not isinstance(loop.target, _N.Name):
                    raise TypeError("unexpected loop target")
                yield loop.target.name
                break


def _content_loops(root: jinja2.nodes.Template) -> Iterator[str]:
    """Loop variables of loops over a message's content (or a macro parameter bound to it)."""
    message_names = list(_message_loops(root))
    params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(_N.Macro):
        param_names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(_N.Call):
            if not (isinstance(call.node, _N.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(
                    _is_var_or_elems(arg, v, "content") for v in message_names
                ):
                    content_params.add(macro.args[i].name)
            for kw in call.kwargs:
                if (
                    isinstance(kw, _N.Keyword)
                    and kw.key in param_names
                    and any(_is_var_or_elems(kw.value, v, "content") for v in message_names)
                ):
                    content_params.add(kw.key)
        for loop in macro.find_all(_N.For):
            loops_in_macros.add(id(loop))
            if content_params:
                params_by_loop[id(loop)] = content_params

    for loop in root.find_all(_N.For):
        target = loop.target
        if any(_is_var_or_elems(loop.iter, v, "content") for v in message_names):
            if not isinstance(target, _N.Name):
                raise TypeError("unexpected loop target")
            yield target.name
            continue
        params = params_by_loop.get(id(loop))
        if isinstance(loop.iter, _N.Name) and (
            (params is not None and loop.iter.name in params)
            or (id(loop) not in loops_in_macros and loop.iter.name == "content")
        ):
            if not isinstance(target, _N.Name):
                raise TypeError("unexpected loop target")
            yield target.name
