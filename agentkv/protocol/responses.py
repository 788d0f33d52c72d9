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
- :func:`chat_to_response`: a Chat Completions answer as a ``response`` object
  (``build_response_output_items`` in ``responses/utils.py``, ``ResponsesResponse.from_request``
  and the usage of ``responses_full_generator`` in ``responses/serving.py``).
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
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentkv.protocol.errors import APIError

__all__ = [
    "chat_to_response",
    "history_items",
    "input_items",
    "last_response_of",
    "new_response_id",
    "not_found_error",
    "response_of_item",
    "responses_to_chat",
]

NAMESPACE_SEPARATOR = "__"
"""vLLM's ``_NAMESPACE_TOOL_SEPARATOR``: a namespace's functions are ``<namespace>__<name>``."""
CUSTOM_TOOL_INPUT_KEY = "input"
"""The one parameter of the function a ``custom`` tool is shown as (vLLM's name)."""
_CUSTOM_TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        CUSTOM_TOOL_INPUT_KEY: {
            "type": "string",
            "description": "The freeform text payload for this tool.",
        }
    },
    "required": [CUSTOM_TOOL_INPUT_KEY],
    "additionalProperties": False,
}
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


# -- tools ------------------------------------------------------------------------------------
@dataclass
class Tools:
    """A request's tools as the model sees them, and the way back from a call's name."""

    chat: list[dict[str, Any]] = field(default_factory=list)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Flat name -> (namespace, name)."""
    custom: set[str] = field(default_factory=set)
    names: set[str] = field(default_factory=set)
    """Every name the model can call (flat)."""

    def resolve(self, name: str) -> tuple[str, str | None]:
        """A called flat name as (name, namespace) (vLLM ``resolve_responses_tool_call_name``)."""
        if name in self.namespaced:
            namespace, local = self.namespaced[name]
            return local, namespace
        return name, None


def _function(name: Any, tool: Mapping[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise APIError(400, "A function tool needs a `name` (a string).", param=param)
    fn: dict[str, Any] = {"name": name}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def tools_of(raw: Any) -> Tools:
    """vLLM ``get_function_tools``: function tools as they are, namespace functions flattened,
    custom tools as a one-string function; other (built-in) tool types dropped."""
    out = Tools()
    if raw is None:
        return out
    if not isinstance(raw, list):
        raise APIError(400, "`tools` must be a list.", param="tools")
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise APIError(400, "Each tool must be an object.", param=f"tools[{i}]")
        kind = tool.get("type")
        if kind == "function":
            out.chat.append(_function(tool.get("name"), tool, f"tools[{i}]"))
        elif kind == "namespace":
            namespace = tool.get("name")
            inner = tool.get("tools")
            if not isinstance(namespace, str) or not isinstance(inner, list):
                raise APIError(
                    400,
                    "A namespace tool needs a `name` and a list of `tools`.",
                    param=f"tools[{i}]",
                )
            for j, sub in enumerate(inner):
                if not isinstance(sub, dict) or sub.get("type") != "function":
                    continue
                local = sub.get("name")
                flat = f"{namespace}{NAMESPACE_SEPARATOR}{local}"
                out.chat.append(_function(flat, sub, f"tools[{i}].tools[{j}]"))
                out.namespaced[flat] = (namespace, str(local))
        elif kind == "custom":
            fmt = tool.get("format")
            if isinstance(fmt, dict) and fmt.get("type") == "grammar":
                raise APIError(
                    400,
                    "Custom tools with a grammar format are not supported; only free-form text "
                    "custom tools are accepted.",
                    param="tools",
                )
            shim = {"description": tool.get("description"), "parameters": _CUSTOM_TOOL_PARAMETERS}
            out.chat.append(_function(tool.get("name"), shim, f"tools[{i}]"))
            out.custom.add(str(tool.get("name")))
        elif not isinstance(kind, str):
            raise APIError(400, "Each tool needs a `type`.", param=f"tools[{i}]")
        # any other type is a built-in tool: never shown to the model (as vLLM)
    out.names = {t["function"]["name"] for t in out.chat}
    return out


def _tool_choice(choice: Any, tools: Tools, has_tools: bool) -> Any:
    """vLLM ``check_tool_usage`` and ``_resolve_named_tool_choice``, in chat's form."""
    if choice is None or choice == "auto":
        return "auto" if has_tools else "none"
    if choice in ("none", "required"):
        if choice == "required" and not has_tools:
            raise APIError(
                400,
                "Tool choice 'required' must be specified with 'tools' parameter.",
                param="tool_choice",
            )
        if choice == "required" and not tools.chat:
            raise APIError(
                400,
                "tool_choice requires a function call, but tools contains no function tool the "
                "model can call.",
                param="tool_choice",
            )
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        name = choice.get("name")
        if not isinstance(name, str) or not name or not has_tools:
            raise APIError(
                400, "Tool choice 'function' not found in 'tools' parameter.", param="tool_choice"
            )
        if name not in tools.names:
            local = [flat for flat, (_, n) in tools.namespaced.items() if n == name]
            if len(local) > 1:
                raise APIError(
                    400,
                    f"Tool choice '{name}' is ambiguous: it is defined in more than one namespace "
                    f"({', '.join(local)}). Select it by its full '<namespace>__<name>' name.",
                    param="tool_choice",
                )
            if not local:
                raise APIError(
                    400,
                    "Tool choice 'function' not found in 'tools' parameter.",
                    param="tool_choice",
                )
            name = local[0]
        return {"type": "function", "function": {"name": name}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise APIError(
        400,
        f"tool_choice {kind!r} is not supported: the engine runs no built-in tools; offer a "
        "function tool instead.",
        param="tool_choice",
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
    chat["tool_choice"] = _tool_choice(body.get("tool_choice"), tools, has_tools)
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


# -- chat answer -> response ------------------------------------------------------------------
def response_usage(chat_usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    completion = int(chat_usage.get("completion_tokens") or 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(cached)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": int(reasoning)},
        "total_tokens": prompt + completion,
    }


def response_logprobs(chat_logprobs: Any) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` as the Responses ``output_text.logprobs``."""
    content = (chat_logprobs or {}).get("content") if isinstance(chat_logprobs, dict) else None
    out = []
    for lp in content or []:
        top = [
            {"token": t.get("token"), "logprob": t.get("logprob"), "bytes": t.get("bytes")}
            for t in lp.get("top_logprobs") or []
        ]
        out.append(
            {
                "token": lp.get("token"),
                "logprob": lp.get("logprob"),
                "bytes": lp.get("bytes"),
                "top_logprobs": top,
            }
        )
    return out


def base_response(
    request: Mapping[str, Any], response_id: str, created_at: int, model: str | None
) -> dict[str, Any]:
    """``ResponsesResponse.from_request`` without output, status and usage."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": request.get("instructions"),
        "metadata": request.get("metadata"),
        "model": model or request.get("model") or "",
        "output": [],
        "parallel_tool_calls": request.get("parallel_tool_calls", True) is not False,
        "temperature": _or(request.get("temperature"), 1.0),
        "tool_choice": request.get("tool_choice") or ("auto" if request.get("tools") else "none"),
        "tools": list(request.get("tools") or []),
        "top_p": _or(request.get("top_p"), 1.0),
        "background": False,
        "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": request.get("max_tool_calls"),
        "previous_response_id": request.get("previous_response_id"),
        "prompt": None,
        "prompt_cache_key": request.get("prompt_cache_key"),
        "prompt_cache_retention": request.get("prompt_cache_retention"),
        "reasoning": request.get("reasoning"),
        "safety_identifier": request.get("safety_identifier"),
        "service_tier": request.get("service_tier") or "auto",
        "store": request.get("store") is not False,
        "text": request.get("text"),
        "top_logprobs": request.get("top_logprobs"),
        "truncation": request.get("truncation") or "disabled",
        "usage": None,
        "user": request.get("user"),
    }


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def item_status(finish_reason: Any) -> str:
    """vLLM ``response_item_status``: a ``length`` cut is ``incomplete``."""
    return "incomplete" if finish_reason == "length" else "completed"


def finish_response(response: dict[str, Any], finish_reason: Any) -> dict[str, Any]:
    status = item_status(finish_reason)
    response["status"] = status
    if status == "incomplete":
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    return response


def reasoning_item(text: str, status: str | None, item_id: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "encrypted_content": None,
        "status": status,
    }


def text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(
    tools: Tools, name: str, arguments: str, call_id: str, status: str, item_id: str
) -> dict[str, Any]:
    if name in tools.custom:
        return {
            "id": item_id,
            "type": "custom_tool_call",
            "call_id": call_id,
            "name": name,
            "input": _custom_input(arguments),
        }
    local, namespace = tools.resolve(name)
    item: dict[str, Any] = {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": local,
        "arguments": arguments,
        "status": status,
    }
    if namespace is not None:
        item["namespace"] = namespace
    return item


def _custom_input(arguments: str) -> str:
    """vLLM ``decode_custom_tool_input``: the shim's ``input``, or the text as it is."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    value = parsed.get(CUSTOM_TOOL_INPUT_KEY) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else arguments


def _tool_calls_of(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    calls = message.get("tool_calls") or []
    return [c for c in calls if isinstance(c, dict) and isinstance(c.get("function"), dict)]


def chat_to_response(
    chat: Mapping[str, Any],
    request: Mapping[str, Any],
    *,
    response_id: str | None = None,
    created_at: int | None = None,
) -> dict[str, Any]:
    """A non-streamed Chat Completions answer as a ``response`` object (vLLM
    ``build_response_output_items`` and ``ResponsesResponse.from_request``)."""
    response_id = response_id or new_response_id()
    ids = ItemIds(response_id)
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    finish = choice.get("finish_reason")
    last_status = item_status(finish)
    tools = tools_of(request.get("tools"))
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning and request.get("include_reasoning", True) is not False:
        output.append(reasoning_item(reasoning, None, ids("rs")))
    calls = _tool_calls_of(message)
    content = message.get("content")
    if content:
        logprobs = (
            response_logprobs(choice.get("logprobs"))
            if LOGPROBS in (request.get("include") or [])
            else []
        )
        output.append(
            {
                "id": ids("msg"),
                "type": "message",
                "role": "assistant",
                "status": "completed" if calls else last_status,
                "content": [text_part(content, logprobs)],
            }
        )
    for i, call in enumerate(calls):
        fn = call["function"]
        status = last_status if i == len(calls) - 1 else "completed"
        call_id = call.get("id") or f"call_{uuid.uuid4().hex[:24]}"
        name = str(fn.get("name"))
        item_id = ids("ctc" if name in tools.custom else "fc")
        output.append(call_item(tools, name, fn.get("arguments") or "", call_id, status, item_id))
    response = base_response(
        request,
        response_id,
        created_at if created_at is not None else int(chat.get("created") or time.time()),
        chat.get("model"),
    )
    response["output"] = output
    response["usage"] = response_usage(chat.get("usage"))
    if chat.get("kv_transfer_params") is not None:  # vLLM's own field (the router strips it)
        response["kv_transfer_params"] = chat["kv_transfer_params"]
    return finish_response(response, finish)
