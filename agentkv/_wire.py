"""A turn's chat request on the wire: the body encoded once with orjson, the echo not decoded.

``openai``'s ``chat.completions.create`` encodes the body with the standard library's ``json``:
at 128k tokens of history that is the prompt's ids as 128k integers (about 12 ms) and the
messages' text again, on every turn. vLLM's answer carries the prompt's ids back
(``return_token_ids`` returns both lists), another 128k integers to decode into objects the SDK
already holds.

:class:`ChatSend` sends a turn as ``chat.completions.with_raw_response.create(**request)`` does,
through ``create`` itself, so ``openai`` still checks and transforms the arguments and builds the
headers, query, timeout and authentication, but with an empty message list: its type transform
costs about 0.2 ms per message (3 ms for a history of 17, on every turn), and the messages are
the ledger's plain dicts, which it would copy unchanged. The resource's ``post`` is then handed
the body with the messages put back and the extra body merged over it as ``openai`` merges
them, encoded by orjson (``content=``) once per turn whatever the retries, the prompt's ids as a
pre-encoded fragment. (A wrapper of ``Completions.create``, such as a tracing library's, sees
the call's arguments but no messages; agentkv's own spans describe the turn.)

The answer is decoded as ``openai`` decodes it (``json.loads``), but an echo byte-identical to
the ids sent is not: the ``ChatCompletion`` gets a copy of the SDK's own list in its place,
equal to what decoding it would give. An echo that differs is decoded.

An ``openai`` without ``post(content=...)`` (1.60 has none), a client class that builds its
requests its own way (``AzureOpenAI`` puts the model in the URL), or a body orjson would encode
otherwise than ``openai`` (a type it does not know, an integer beyond 64 bits, NaN in the
arguments) takes ``openai``'s own path, unchanged.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Mapping
from typing import Any

import openai
import orjson

from agentkv.protocol import BODY_KV_TRANSFER_PARAMS, BODY_PROMPT_TOKEN_IDS

__all__ = ["ChatSend"]

_ECHO_KEY = b'"' + BODY_PROMPT_TOKEN_IDS.encode() + b'":'
_HOLE = "agentkv: the echo of the prompt's ids, not decoded"
"""What stands in the echo's place while the rest of the answer is decoded."""
_HOLE_JSON = json.dumps(_HOLE).encode()
_OMITTED = tuple(t for t in (getattr(openai, "Omit", None), openai.NotGiven) if t is not None)


def _takes_content(cls: type[openai.OpenAI | openai.AsyncOpenAI]) -> bool:
    return "content" in inspect.signature(cls.post).parameters


_FAST = {cls: _takes_content(cls) for cls in (openai.OpenAI, openai.AsyncOpenAI)}
"""The ``openai`` client classes whose requests may take the orjson road: not a subclass, which
may build its requests its own way (``AzureOpenAI`` puts the model in the URL)."""


def _finite(value: Any) -> bool:
    """No NaN or infinity in ``value`` (openai's encoder refuses them; orjson writes null)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, Mapping):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return True


def _without_echo(content: bytes, ids: bytes, prompt_ids: list[int]) -> Any:
    """The answer's JSON as ``json.loads`` reads it (what httpx's ``Response.json`` does),
    except that a top-level echo of ``ids`` (their encoding) is read as a copy of
    ``prompt_ids`` instead of decoded."""
    at = content.find(_ECHO_KEY)
    start = at + len(_ECHO_KEY)
    end = start + len(ids)
    if at > 0 and content[at - 1 : at] in (b"{", b",") and content.startswith(ids, start):
        data = json.loads(b"".join((content[:start], _HOLE_JSON, content[end:])))
        if isinstance(data, dict) and data.get(BODY_PROMPT_TOKEN_IDS) == _HOLE:
            data[BODY_PROMPT_TOKEN_IDS] = list(prompt_ids)
            return data
    return json.loads(content)


class ChatSend:
    """One turn's ``chat.completions.with_raw_response.create(**request)``: call it (again on
    a retry) for the raw response (an awaitable of it for ``AsyncOpenAI``); :meth:`parse` reads
    a non-streamed one."""

    def __init__(
        self,
        client: openai.OpenAI | openai.AsyncOpenAI,
        request: Mapping[str, Any],
        prompt_ids: list[int] | None,
    ) -> None:
        self._client = client
        self._request = dict(request)
        self._prompt_ids = prompt_ids
        self._ids: bytes | None = None
        self._content: bytes | None = None
        self._fast = _FAST.get(type(client), False)

    def __call__(self) -> Any:
        completions = self._client.chat.completions
        if not self._fast:
            return completions.with_raw_response.create(**self._request)
        request = dict(self._request)
        messages = request.pop("messages")
        resource: Any = type(completions)(self._client)  # type: ignore[arg-type]
        post = resource._post

        def post_encoded(path: str, *, body: Any = None, options: Any = None, **kw: Any) -> Any:
            given = dict(options or {})
            extra = given.pop("extra_json", None) or {}
            if isinstance(body, Mapping) and isinstance(extra, Mapping):
                content = self._encoded({**body, "messages": messages}, extra)
                if content is not None:
                    return post(path, content=content, options=given, **kw)
            body = {**(body or {}), "messages": messages}
            return post(path, body=body, options=dict(options or {}), **kw)  # openai's own

        resource._post = post_encoded
        return resource.with_raw_response.create(messages=[], **request)

    def _encoded(self, body: Mapping[str, Any], extra: Mapping[str, Any]) -> bytes | None:
        """The body ``openai`` would send (its transformed arguments, the extra body over them),
        encoded once; None when orjson would encode it otherwise than ``openai``."""
        if self._content is not None:
            return self._content
        data = {k: v for k, v in {**body, **extra}.items() if not isinstance(v, _OMITTED)}
        params = data.get(BODY_KV_TRANSFER_PARAMS)
        small = {k: v for k, v in data.items() if k not in ("messages", BODY_KV_TRANSFER_PARAMS)}
        if not _finite(small):
            return None
        try:
            if self._prompt_ids is not None and isinstance(params, Mapping):
                ids = params.get(BODY_PROMPT_TOKEN_IDS)
                if ids is self._prompt_ids:
                    self._ids = orjson.dumps(ids)
                    fragment = orjson.Fragment(self._ids)
                    data[BODY_KV_TRANSFER_PARAMS] = {**params, BODY_PROMPT_TOKEN_IDS: fragment}
            self._content = orjson.dumps(data)
        except TypeError:  # a type orjson does not encode: openai's own encoder decides
            self._ids = None
            return None
        return self._content

    def parse(self, raw: Any) -> Any:
        """``raw.parse()``, the echo of the ids sent read without decoding it."""
        if self._ids is not None and self._prompt_ids is not None:
            response = raw.http_response
            ids, prompt_ids = self._ids, self._prompt_ids

            def decode(**kwargs: Any) -> Any:
                if kwargs:
                    return json.loads(response.content, **kwargs)
                return _without_echo(response.content, ids, prompt_ids)

            response.json = decode
        return raw.parse()
