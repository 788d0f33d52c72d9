"""The Responses API's streamed answer: :class:`ResponsesEncoder` turns a Chat Completions
stream (or answer, or error) into Responses events, as vLLM 0.33's
``SimpleStreamingEventProcessor`` (``entrypoints/openai/responses/streaming_events.py``) emits
them for a chat model, framed as its ``api_router.py`` frames them (``event: <type>`` then
``data: <json>``), each with its ``sequence_number``. The encoder has the methods of the router's
edge ``Encoder``; the request and response mapping is :mod:`agentkv.protocol.responses`.

Differences from vLLM: a custom tool's input is sent in one ``custom_tool_call_input.delta``
when the call closes (vLLM streams it as it decodes), and a broken chat stream ends with an
``error`` event and ``response.failed``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from agentkv.protocol.chunks import plain_text
from agentkv.protocol.responses import LOGPROBS, ItemIds, new_response_id
from agentkv.protocol.responses_output import (
    base_response,
    call_item,
    chat_to_response,
    finish_response,
    item_status,
    reasoning_item,
    response_logprobs,
    response_usage,
    text_part,
)
from agentkv.protocol.responses_tools import tools_of

__all__ = ["ResponsesEncoder", "frame"]


_TEXT_DELTA = (
    b"event: response.output_text.delta\n"
    b'data: {"type":"response.output_text.delta","sequence_number":'
)
_REASONING_DELTA = (
    b"event: response.reasoning_text.delta\n"
    b'data: {"type":"response.reasoning_text.delta","sequence_number":'
)


def frame(event: Mapping[str, Any]) -> bytes:
    """One event as vLLM's ``api_router.py`` writes it."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


@dataclass
class _Open:
    """The output item being streamed (vLLM ``SimpleStreamingState``)."""

    kind: str  # "message" | "reasoning" | "call"
    item_id: str
    parts: list[str] = field(default_factory=list)
    """The item's text (or a call's arguments) as it came, joined when the item closes: a
    string grown by ``+=`` on an attribute is copied whole on every token."""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    call_index: int | None = None
    call_id: str = ""
    name: str = ""

    @property
    def text(self) -> str:
        if len(self.parts) != 1:
            self.parts[:] = ["".join(self.parts)]  # joined once, however often it is read
        return self.parts[0]


class ResponsesEncoder:
    """One turn of ``/v1/responses``: the chat answer (or stream, or error) in the Responses
    format. A fresh encoder per request; after :meth:`response` or :meth:`done`, ``final`` is
    the finished response object (what a response store keeps)."""

    def __init__(
        self,
        request: Mapping[str, Any],
        *,
        response_id: str | None = None,
        created_at: int | None = None,
    ) -> None:
        self.request = request
        self.id = response_id or new_response_id()
        self._ids = ItemIds(self.id)
        self.created_at = created_at if created_at is not None else int(time.time())
        self.final: dict[str, Any] | None = None
        self.failed = False
        self._tools = tools_of(request.get("tools"))
        self._logprobs = LOGPROBS in (request.get("include") or [])
        self._reasoning = request.get("include_reasoning", True) is not False
        self._seq = 0
        self._started = False
        self._model: str | None = None
        self._open: _Open | None = None
        self._output: list[dict[str, Any]] = []
        self._index = 0
        self._finish: Any = None
        self._usage: dict[str, Any] | None = None

    # -- Encoder ------------------------------------------------------------------------------
    def response(self, chat: dict[str, Any]) -> dict[str, Any]:
        self.final = chat_to_response(
            chat, self.request, response_id=self.id, created_at=self.created_at
        )
        return self.final

    def chunk(self, chat: dict[str, Any]) -> list[bytes]:
        open_ = self._open
        if open_ is not None and open_.kind == "message" and not self._logprobs:
            # the common chunk: one more token of the open message, nothing else
            text = plain_text(chat) if not chat.get("usage") and self._model is not None else None
            if text is not None:
                return [self._plain_text_delta(text)]
        out = self._started_frames(chat.get("model"))
        if chat.get("usage"):
            self._usage = chat["usage"]
        for choice in chat.get("choices") or []:
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning and self._reasoning:
                out += [frame(e) for e in self._to("reasoning")]
                out.append(self._reasoning_delta(reasoning))
            if content := delta.get("content"):
                if self._open is None or self._open.kind != "message":
                    out += [frame(e) for e in self._to("message")]
                if self._logprobs:
                    lps = response_logprobs(choice.get("logprobs"))
                    out.append(frame(self._text_delta(content, lps)))
                else:
                    out.append(self._plain_text_delta(content))
            for call in delta.get("tool_calls") or []:
                out += [frame(e) for e in self._call(call)]
        return out

    def done(self) -> list[bytes]:
        if self.failed:
            return []
        events = self._start(None)
        events += self._close(item_status(self._finish))
        response = self._snapshot()
        response["output"] = list(self._output)
        response["usage"] = response_usage(self._usage)
        self.final = finish_response(response, self._finish)
        incomplete = self.final["status"] == "incomplete"
        kind = "response.incomplete" if incomplete else "response.completed"
        events.append(self._event(kind, response=self.final))
        return [frame(e) for e in events]

    def stream_error(self, error: dict[str, Any]) -> list[bytes]:
        if self.failed:
            return []
        self.failed = True
        events = self._start(None)
        code = error.get("code")
        status = code if isinstance(code, int) else 500
        name = "server_error" if status >= 500 else str(error.get("type") or "invalid_request")
        message = str(error.get("message") or "The answer's stream broke.")
        events.append(self._event("error", code=name, message=message, param=error.get("param")))
        response = self._snapshot()
        response["output"] = list(self._output)
        response["status"] = "failed"
        response["error"] = {"code": name, "message": message}
        events.append(self._event("response.failed", response=response))
        return [frame(e) for e in events]

    # -- state --------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return base_response(self.request, self.id, self.created_at, self._model)

    def _start(self, model: Any) -> list[dict[str, Any]]:
        if isinstance(model, str) and model and self._model is None:
            self._model = model
        if self._started:
            return []
        self._started = True
        initial = self._snapshot()
        return [
            self._event("response.created", response=initial),
            self._event("response.in_progress", response=initial),
        ]

    def _started_frames(self, model: Any) -> list[bytes]:
        """:meth:`_start`'s events, framed, the initial response (which echoes the whole
        ``instructions``) serialized once for both."""
        if isinstance(model, str) and model and self._model is None:
            self._model = model
        if self._started:
            return []
        self._started = True
        initial = orjson.dumps(self._snapshot())
        out = []
        for kind in (b"response.created", b"response.in_progress"):
            seq = str(self._seq).encode()
            self._seq += 1
            data = b'{"type":"' + kind + b'","sequence_number":' + seq + b',"response":' + initial
            out.append(b"event: " + kind + b"\ndata: " + data + b"}\n\n")
        return out

    def _to(self, kind: str) -> list[dict[str, Any]]:
        """Close the open item unless it is of ``kind``, and open one of ``kind``."""
        if self._open is not None and self._open.kind == kind:
            return []
        events = self._close("completed")
        item_id = self._ids("msg" if kind == "message" else "rs")
        self._open = _Open(kind, item_id)
        if kind == "message":
            item: dict[str, Any] = {
                "id": item_id,
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part: dict[str, Any] = text_part("", None)
        else:
            item = {"id": item_id, "type": "reasoning", "summary": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        at = self._index
        events.append(self._event("response.output_item.added", output_index=at, item=item))
        events.append(
            self._event(
                "response.content_part.added",
                output_index=self._index,
                item_id=item_id,
                content_index=0,
                part=part,
            )
        )
        return events

    def _text_delta(self, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        assert self._open is not None
        self._open.parts.append(text)
        self._open.logprobs.extend(logprobs)
        stream_lps = [
            {
                "token": lp["token"],
                "logprob": lp["logprob"],
                "top_logprobs": [
                    {"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]
                ],
            }
            for lp in logprobs
        ]
        return self._event(
            "response.output_text.delta",
            output_index=self._index,
            item_id=self._open.item_id,
            content_index=0,
            delta=text,
            logprobs=stream_lps,
        )

    def _plain_text_delta(self, text: str) -> bytes:
        """:meth:`_text_delta` without logprobs, framed: the bytes ``frame`` writes for it."""
        assert self._open is not None
        self._open.parts.append(text)
        return self._delta_frame(_TEXT_DELTA, text, b',"logprobs":[]}\n\n')

    def _reasoning_delta(self, text: str) -> bytes:
        assert self._open is not None
        self._open.parts.append(text)
        return self._delta_frame(_REASONING_DELTA, text, b"}\n\n")

    def _delta_frame(self, kind: bytes, text: str, tail: bytes) -> bytes:
        """``frame`` of ``{"type", "sequence_number", "output_index", "item_id",
        "content_index": 0, "delta"}`` and what ``tail`` closes, from a byte template."""
        assert self._open is not None
        seq = self._seq
        self._seq += 1
        return b"".join(
            (
                kind,
                str(seq).encode(),
                b',"output_index":',
                str(self._index).encode(),
                b',"item_id":',
                orjson.dumps(self._open.item_id),
                b',"content_index":0,"delta":',
                orjson.dumps(text),
                tail,
            )
        )

    def _call(self, call: Mapping[str, Any]) -> list[dict[str, Any]]:
        fn = call.get("function")
        if not isinstance(fn, dict):
            return []
        index = call.get("index")
        events: list[dict[str, Any]] = []
        current = self._open
        if (
            current is None
            or current.kind != "call"
            or (
                index is not None and current.call_index is not None and index != current.call_index
            )
        ):
            events += self._close("completed")
            name = str(fn.get("name") or "")
            call_id = call.get("id") or f"call_{uuid.uuid4().hex[:24]}"
            is_custom = name in self._tools.custom
            item_id = self._ids("ctc" if is_custom else "fc")
            self._open = _Open("call", item_id, call_index=index, call_id=call_id, name=name)
            item = call_item(self._tools, name, "", call_id, "in_progress", item_id)
            events.append(
                self._event("response.output_item.added", output_index=self._index, item=item)
            )
        assert self._open is not None
        arguments = fn.get("arguments") or ""
        if arguments:
            self._open.parts.append(arguments)
            if self._open.name not in self._tools.custom:
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        output_index=self._index,
                        item_id=self._open.item_id,
                        delta=arguments,
                    )
                )
        return events

    def _part_done(
        self, kind: str, at: int, item: _Open, part: dict[str, Any], **extra: Any
    ) -> list[dict[str, Any]]:
        """A text part's closing events: ``response.<kind>.done`` with its text, then the
        part's ``response.content_part.done``."""
        where = {"output_index": at, "item_id": item.item_id, "content_index": 0}
        return [
            self._event(f"response.{kind}.done", **where, text=item.text, **extra),
            self._event("response.content_part.done", **where, part=part),
        ]

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The open item's closing events (vLLM ``emit_simple_*_done``)."""
        item = self._open
        if item is None:
            return []
        self._open = None
        at = self._index
        self._index += 1
        events: list[dict[str, Any]] = []
        if item.kind == "message":
            part = text_part(item.text, item.logprobs)
            done: dict[str, Any] = {
                "id": item.item_id,
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [part] if item.text else [],
            }
            events += self._part_done("output_text", at, item, part, logprobs=[])
        elif item.kind == "reasoning":
            done = reasoning_item(item.text, status, item.item_id)
            part = {"type": "reasoning_text", "text": item.text}
            events += self._part_done("reasoning_text", at, item, part)
        else:
            done = call_item(self._tools, item.name, item.text, item.call_id, status, item.item_id)
            where = {"output_index": at, "item_id": item.item_id}
            if done["type"] == "custom_tool_call":
                kind = "response.custom_tool_call_input"
                if done["input"]:
                    events.append(self._event(f"{kind}.delta", **where, delta=done["input"]))
                events.append(self._event(f"{kind}.done", **where, input=done["input"]))
            else:
                events.append(
                    self._event(
                        "response.function_call_arguments.done",
                        **where,
                        name=done["name"],
                        arguments=item.text,
                    )
                )
        events.append(self._event("response.output_item.done", output_index=at, item=done))
        self._output.append(done)
        return events
