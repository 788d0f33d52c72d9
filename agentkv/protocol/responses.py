"""The OpenAI Responses API (``POST /v1/responses``) as a codec over Chat Completions.

vLLM 0.33 serves ``/v1/responses`` for non-Harmony models by mapping the request onto its chat
path and the chat output back into Responses items and events. This module does the same
mapping with plain dicts and no I/O, so the router (whose one turn core speaks Chat Completions)
and the simulator serve the API exactly as vLLM would:

- :func:`responses_to_chat`: a Responses body (plus the items of a ``previous_response_id``
  chain) as one Chat Completions body. Mirrors ``construct_input_messages`` and
  ``construct_chat_messages_with_tool_call`` (vLLM ``entrypoints/openai/responses/utils.py``),
  ``ResponsesRequest``'s validators and ``build_chat_params`` / ``to_sampling_params``
  (``entrypoints/openai/responses/protocol.py``) and ``get_function_tools``
  (``tool_parsers/utils.py``: namespace tools flattened to ``<namespace>__<name>``, custom tools
  shown as a one-string function).
- :func:`~agentkv.protocol.responses_output.chat_to_response` (its own module): a Chat
  Completions answer as a ``response`` object.
- :class:`~agentkv.protocol.responses_stream.ResponsesEncoder` (its own module): the same for a
  streamed answer, event by event.

Where agentkv differs from vLLM, on purpose:

- ``previous_response_id`` history keeps the previous output's reasoning and function calls
  (vLLM keeps only its message text, so a following ``function_call_output`` names a call the
  model never sees); a stored chain is the OpenAI semantics: all items in order, instructions not
  carried over (vLLM's filter of ``system`` messages from the history is kept).
- Text content parts (``input_text``, ``output_text``) are sent as chat ``text`` parts: vLLM's
  chat parser treats them alike, and any chat server accepts ``text``.
- ``reasoning.effort`` also goes into ``chat_template_kwargs`` (as vLLM's ``build_chat_params``
  puts it there), so a prompt rendered by ``/tokenize`` is the one the engine runs.
- Built-in (hosted) tools such as ``web_search`` are dropped as vLLM drops them (the model is
  never shown them; Codex sends ``web_search`` on every request), but a ``tool_choice`` that
  forces one is refused (400): no engine here can run it.
- ``background``, ``prompt`` (templates), ``conversation`` and encrypted reasoning are refused
  (400) with a message that says so.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

from agentkv.protocol.errors import APIError
from agentkv.protocol.responses_tools import (
    CUSTOM_TOOL_INPUT_KEY,
    NAMESPACE_SEPARATOR,
    tool_choice,
    tools_of,
)

__all__ = [
    "history_items",
    "input_items",
    "last_response_of",
    "new_response_id",
    "not_found_error",
    "response_of_item",
    "responses_to_chat",
]

_INCLUDE = frozenset(
    {
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "message.output_text.logprobs",
        "reasoning.encrypted_content",
    }
)
"""``include`` values vLLM's ``ResponsesRequest`` accepts."""
LOGPROBS = "message.output_text.logprobs"
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text"}
_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
# vLLM's sampling extras a Responses request may carry, the same on the chat path
_PASSTHROUGH = (
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "user",
    "cache_salt",
    "session_id",
    "prompt_cache_key",
    "priority",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "ignore_eos",
    "include_reasoning",
    "structured_outputs",
    "vllm_xargs",
    "kv_transfer_params",
    "agentkv_sim",  # the simulator's scripted output (a test hook; vLLM ignores it)
)


def new_response_id() -> str:
    """A fresh response id (``resp_`` and 32 hex digits, as vLLM's ``random_uuid``)."""
    return f"resp_{uuid.uuid4().hex}"


class ItemIds:
    """A response's output item ids: ``<prefix>_<the response id's hex>_<n>``, so an item a
    client sends back names the response it came from (:func:`response_of_item`)."""

    def __init__(self, response_id: str) -> None:
        self.base = response_id.removeprefix("resp_")
        self.n = 0

    def __call__(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}_{self.base}_{self.n}"


_ITEM_ID = re.compile(r"(?:msg|rs|fc|ctc)_([0-9a-f]{32})_[0-9]+")


def response_of_item(item_id: Any) -> str | None:
    """The response id an output item id of this module names (None for any other id)."""
    match = _ITEM_ID.fullmatch(item_id) if isinstance(item_id, str) else None
    return f"resp_{match.group(1)}" if match else None


def last_response_of(items: list[dict[str, Any]]) -> str | None:
    """The response the last of ``items`` that came from a response of this module came from."""
    for item in reversed(items):
        found = response_of_item(item.get("id"))
        if found is not None:
            return found
    return None


def not_found_error(response_id: str, *, previous: bool = True) -> APIError:
    """OpenAI's 404 for an unknown response: a ``previous_response_id``, or (``previous``
    false) the id of ``GET``/``DELETE /v1/responses/{id}``."""
    shown = response_id if len(response_id) <= 80 else response_id[:80] + "…"
    return APIError(
        404,
        f"{'Previous response' if previous else 'Response'} with id '{shown}' not found.",
        type="invalid_request_error",
        param="previous_response_id" if previous else "response_id",
        code="previous_response_not_found" if previous else "not_found",
    )


# -- input items -> chat messages ---------------------------------------------------------------
def _part(part: Any) -> Any:
    """A content part in chat's form: text-like parts as ``text`` parts."""
    if isinstance(part, dict):
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            return {"type": "text", "text": part.get("text", "")}
        if kind == "input_image" and part.get("image_url"):
            image = {"url": part["image_url"]}
            if part.get("detail"):
                image["detail"] = part["detail"]
            return {"type": "image_url", "image_url": image}
    return part


def _content(content: Any) -> Any:
    if isinstance(content, list):
        return [_part(p) for p in content]
    return content


def _first_text(content: Any) -> str | None:
    """The text of a message's first content part (vLLM takes ``content[0].text``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        first = content[0]
        text = first.get("text", first.get("refusal"))
        return text if isinstance(text, str) else ""
    if isinstance(content, list):
        return ""
    return None


def _str_field(item: Mapping[str, Any], key: str, kind: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"A `{kind}` item needs `{key}` (a string).", param="input")
    return value


def _tool_call(item: Mapping[str, Any], kind: str) -> dict[str, Any]:
    call_id = _str_field(item, "call_id", kind)
    name = _str_field(item, "name", kind)
    if kind == "custom_tool_call":
        payload = item.get("input") or ""
        arguments = json.dumps({CUSTOM_TOOL_INPUT_KEY: payload}, ensure_ascii=False)
    else:
        arguments = _str_field(item, "arguments", kind)
        namespace = item.get("namespace")
        if isinstance(namespace, str) and namespace:
            name = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _message(item: Mapping[str, Any], prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM ``_construct_message_from_response_item``: a new chat message, or None when the item
    was merged into ``prev`` (the assistant message it continues)."""
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    kind = item.get("type")
    role = item.get("role")
    if kind in ("function_call", "custom_tool_call"):
        call = _tool_call(item, kind)
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise APIError(400, "Encrypted content is not supported.", param="input")
        reasoning = ""
        content, summary = item.get("content"), item.get("summary")
        if isinstance(content, list) and content:
            reasoning = _first_text(content) or ""
        elif isinstance(summary, list) and summary:
            reasoning = _first_text(summary) or ""
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {
            "role": "tool",
            "content": _content(item.get("output")),
            "tool_call_id": item.get("call_id"),
        }
    if role == "assistant" and kind in (None, "message"):
        text = _first_text(item.get("content"))
        if text is None:
            return dict(item)  # vLLM passes it on as it is; the chat parser decides
        if assistant is not None and assistant.get("content") is None:
            assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    if isinstance(role, str) and kind in (None, "message"):
        message: dict[str, Any] = {"role": role, "content": _content(item.get("content"))}
        if isinstance(item.get("name"), str):
            message["name"] = item["name"]
        return message
    shown = kind if isinstance(kind, str) else type(kind).__name__
    raise APIError(400, f"Unsupported input item type: {shown}", param="input")


def input_items(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A request's ``input`` as a list of items (a string is one user message)."""
    raw = body.get("input")
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not all(isinstance(i, dict) for i in raw):
        raise APIError(
            400, "`input` must be a string or a list of input items (objects).", param="input"
        )
    return list(raw)


def history_items(
    previous: list[dict[str, Any]] | None, body: Mapping[str, Any], response: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """What a stored response remembers for its successor: the chain's earlier items, this
    request's input and this response's output (instructions are not carried over)."""
    return [*(previous or []), *input_items(body), *list(response.get("output") or [])]


def _continue_final(items: list[dict[str, Any]]) -> bool:
    """vLLM ``should_continue_final_message``: the last item is an unfinished assistant message
    or reasoning item (a partial answer to continue)."""
    if not items:
        return False
    last = items[-1]
    if last.get("type", "message") not in ("message", "reasoning"):
        return False
    if last.get("type", "message") == "message" and last.get("role") != "assistant":
        return False
    return last.get("status") in ("in_progress", "incomplete")


def _messages(
    body: Mapping[str, Any], previous: list[dict[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(chat messages, the request's own input items)."""
    items = input_items(body)
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise APIError(400, "`instructions` must be a string.", param="instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    # instructions do not carry over from a previous response (vLLM drops its system messages)
    history = [i for i in previous or [] if i.get("role") != "system"]
    for item in [*history, *items]:
        message = _message(item, messages[-1] if messages else None)
        if message is not None:
            messages.append(message)
    if not messages:
        raise APIError(400, "`input` must not be empty.", param="input")
    return messages, items


# -- the request ------------------------------------------------------------------------------
def _number(body: Mapping[str, Any], key: str, *, low: float, high: float | None = None) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(400, f"`{key}` must be a number.", param=key)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise APIError(400, f"`{key}` must be {bound}, got {value}.", param=key)
    return value


def _check(body: Mapping[str, Any]) -> None:
    """``ResponsesRequest``'s validators, and what agentkv does not serve."""
    if body.get("background"):
        if body.get("store") is False:
            raise APIError(
                400, "background can only be used when `store` is true", param="background"
            )
        raise APIError(
            400,
            "Background responses are not supported: send the request without `background`.",
            param="background",
        )
    if body.get("prompt") is not None:
        raise APIError(400, "prompt template is not supported", param="prompt")
    if body.get("conversation") is not None:
        raise APIError(
            400,
            "`conversation` (stored conversation objects) is not supported: send the whole "
            "input, or chain responses with `previous_response_id`.",
            param="conversation",
        )
    if body.get("previous_input_messages") and body.get("previous_response_id"):
        raise APIError(
            400,
            "Only one of `previous_input_messages` and `previous_response_id` can be set.",
            param="previous_response_id",
        )
    include = body.get("include")
    if include is not None and (
        not isinstance(include, list) or not all(i in _INCLUDE for i in include)
    ):
        raise APIError(
            400, f"`include` must be a list of: {', '.join(sorted(_INCLUDE))}.", param="include"
        )
    for key in ("stream", "store", "parallel_tool_calls"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise APIError(400, f"`{key}` must be a boolean.", param=key)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "`model` must be a string.", param="model")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise APIError(
            400, "`previous_response_id` must be a non-empty string.", param="previous_response_id"
        )


def responses_to_chat(
    body: Mapping[str, Any], previous_items: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The Chat Completions body that serves a Responses request, as vLLM 0.33 maps it.

    ``previous_items``: the items of the ``previous_response_id`` chain (earlier inputs and
    outputs, oldest first), put before this request's input. Raises
    :class:`APIError` for what vLLM (or agentkv) refuses.
    """
    _check(body)
    messages, items = _messages(body, previous_items)
    tools = tools_of(body.get("tools"))
    has_tools = bool(body.get("tools"))
    chat: dict[str, Any] = {"messages": messages}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    if tools.chat:
        chat["tools"] = tools.chat
    chat["tool_choice"] = tool_choice(body.get("tool_choice"), tools, has_tools)
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    most = body.get("max_output_tokens")
    if most is not None:
        if isinstance(most, bool) or not isinstance(most, int) or most < 1:
            raise APIError(
                400, "`max_output_tokens` must be a positive integer.", param="max_output_tokens"
            )
        chat["max_tokens"] = most
    for key, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        value = _number(body, key, low=low, high=high)
        if value is not None:
            chat[key] = value
    for key in _PASSTHROUGH:
        if body.get(key) is not None:
            chat[key] = body[key]
    kwargs = dict(body.get("chat_template_kwargs") or {})
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise APIError(400, "`reasoning` must be an object.", param="reasoning")
    effort = (reasoning or {}).get("effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise APIError(
                400,
                f"`reasoning.effort` must be one of {', '.join(sorted(_EFFORTS))}.",
                param="reasoning.effort",
            )
        chat["reasoning_effort"] = effort
        kwargs["reasoning_effort"] = effort
        kwargs.setdefault("enable_thinking", effort != "none")
    if _continue_final(items):
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    if LOGPROBS in (body.get("include") or []):
        chat["logprobs"] = True
        top = body.get("top_logprobs")
        if top:
            chat["top_logprobs"] = top
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict):
        if fmt.get("type") == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif fmt.get("type") == "json_schema":
            schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat
