"""A client request, parsed and checked before anything is touched.

Everything that can be wrong with a request is found here, so a bad request never consumes a
stored handle: OpenAI's error shape, 4xx, and no state change.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.requests import Request

from agentkv.protocol import (
    BODY_CONVERSATION_ID,
    BODY_KV_TRANSFER_PARAMS,
    BODY_PROMPT_TOKEN_IDS,
    HEADER_ECHO_PROMPT_TOKEN_IDS,
    HEADER_EPOCH,
    HEADER_LEASE,
)
from agentkv.protocol.errors import APIError
from agentkv.protocol.http import json_object
from agentkv.router.config import RouterConfig
from agentkv.router.ids_json import fast_body
from agentkv.router.session import conversation_of
from agentkv.router.tenancy import ANONYMOUS, Caller
from agentkv.router.token_ids import MAX_TOKEN_ID, TokenIds, int32_le, wire_ids

__all__ = [
    "MAX_TOKEN_ID",
    "ClientRequest",
    "TokenIds",
    "checked_ids",
    "int32_le",
    "parse_body",
    "parse_request",
    "read_body",
    "wire_ids",
]

INT64_MAX = (1 << 63) - 1
_EPOCH = re.compile(r"-?[0-9]{1,19}")
_SALT_FORBIDDEN = ("@", "/", "\\", "\0")
_MAX_SALT = 128  # vLLM's limit on cache_salt

_CLOSE = {"connection": "close"}
"""On a refusal before the request body was read to its end: the rest is not read."""


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, never more than ``limit`` bytes of it in memory: a declared
    ``Content-Length`` above the limit is refused before anything is read, and a body (chunked
    or not) that grows past it is refused there, without reading the rest (413 either way).

    A client that hangs up while sending raises starlette's ``ClientDisconnect``."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.strip().isascii() and declared.strip().isdigit()):
            raise APIError(400, "Invalid Content-Length header.", headers=_CLOSE)
        if int(declared) > limit:
            raise APIError(413, f"Request body larger than {limit} bytes.", headers=_CLOSE)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"Request body larger than {limit} bytes.", headers=_CLOSE)
        chunks.append(chunk)
    return b"".join(chunks)


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(BaseModel):
    """Types of the fields the router relies on, as vLLM's request models type them (lax
    pydantic: ``"false"`` and ``0`` are false, ``"5"`` is 5); the engine checks the rest."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    n: int | None = Field(1, ge=1, le=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    return_token_ids: bool | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    min_tokens: int | None = Field(None, ge=0, le=INT64_MAX)

    @model_validator(mode="after")
    def _min_within_max(self) -> _Common:
        # vLLM's SamplingParams rule, checked here so D's rejection cannot cost the handle
        # that P read on this turn (issue 11: a failed turn never spends a conversation's KV)
        most = self.max_completion_tokens or self.max_tokens
        if self.min_tokens is not None and most is not None and self.min_tokens > most:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be less than or equal to max_tokens ({most})"
            )
        return self


class _Chat(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)


class _Completion(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]


# the fields the router itself reads: the body it uses carries their validated values, so no
# decision is ever taken on a raw string's truthiness
_READ_BY_ROUTER = (
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "return_token_ids",
    "prompt",
)


@dataclass
class ClientRequest:
    """One parsed request."""

    chat: bool
    body: dict[str, Any]
    """The client's body without routing fields (``conversation_id``, handles)."""
    tenant: str
    cache_salt: str | None
    conversation_id: str | None
    epoch: int
    prompt_ids: TokenIds | None
    """Exact prompt ids when the client sent them."""
    conversation_source: str = "none"
    """Which signal named the conversation (:data:`agentkv.router.session.SOURCES`)."""
    lease_s: float | None = None
    """``X-AgentKV-Lease``: keep the conversation's handles while the agent lives."""
    echo_prompt_ids: bool = False
    """The client asked (``X-AgentKV-Echo-Prompt-Token-Ids: 1``) for the echo of the prompt ids
    it sent."""

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def wants_token_ids(self) -> bool:
        return bool(self.body.get("return_token_ids"))

    @property
    def wants_prompt_ids(self) -> bool:
        """Whether the response keeps ``prompt_token_ids``: the client asked for token ids and
        did not send the prompt's itself (``kv_transfer_params.prompt_token_ids``), unless it
        asked for the echo explicitly."""
        if not self.wants_token_ids:
            return False
        return self.echo_prompt_ids or not (self.chat and self.prompt_ids is not None)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def copy_body(self) -> dict[str, Any]:
        """A copy to set top-level fields on (shallow: the messages of a long history are not
        copied on every turn; nested values must not be changed in place)."""
        return dict(self.body)


def _check_salt(value: Any) -> str | None:
    """vLLM's rule for ``cache_salt``: absent, or a non-empty string of at most 128 characters
    without ``@``, ``/``, ``\\`` or NUL."""
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not value
        or len(value) > _MAX_SALT
        or any(c in value for c in _SALT_FORBIDDEN)
    ):
        raise APIError(
            400,
            "`cache_salt` must be a non-empty string of at most 128 characters without "
            "'@', '/', '\\' or NUL.",
            param="cache_salt",
        )
    return value


def checked_ids(value: Any) -> TokenIds | None:
    """``value`` as token ids (integers from 0 to :data:`MAX_TOKEN_ID`, at least one), or None.

    Checked in C, whatever the length: the int32 array refuses what is not an integer (and
    what is past int32), its sign bytes the negative ids, and the JSON (made anyway for the
    engines) booleans, which the array would take for 0 and 1. Ids the body's parse made
    (:mod:`~agentkv.router.ids_json`) are checked already."""
    if isinstance(value, TokenIds):
        return value
    if not isinstance(value, list) or not value:
        return None
    try:
        data = int32_le(value)
    except (TypeError, OverflowError):
        return None
    if not data[3::4].isascii():  # a sign bit set: a negative id
        return None
    encoded = orjson.dumps(value)
    if b"t" in encoded or b"f" in encoded:  # true / false
        return None
    ids = TokenIds(value, data=data)
    ids._json = encoded
    return ids


def _ids(value: Any, param: str) -> TokenIds:
    ids = checked_ids(value)
    if ids is None:
        raise APIError(
            400,
            f"`{param}` must be a non-empty list of token ids (integers from 0 to {MAX_TOKEN_ID}).",
            param=param,
        )
    return ids


def _epoch(raw: str) -> int:
    """``X-AgentKV-Epoch``: a decimal integer in int64's range."""
    value = raw.strip()
    if _EPOCH.fullmatch(value) and -INT64_MAX - 1 <= int(value) <= INT64_MAX:
        return int(value)
    shown = raw if len(raw) <= 40 else raw[:40] + "…"
    raise APIError(
        400, f"{HEADER_EPOCH} must be an integer in int64's range, got {shown!r}.", param=None
    )


def parse_request(
    raw: bytes,
    headers: dict[str, str],
    *,
    chat: bool,
    config: RouterConfig,
    session_body: dict[str, Any] | None = None,
    caller: Caller = ANONYMOUS,
) -> ClientRequest:
    """Parse and check a request body and its headers (raises :class:`APIError`) for
    ``caller`` (its API key's tenant: :meth:`~agentkv.router.tenancy.Tenancy.tenant_for`).

    ``session_body``: the body as the client sent it, when ``raw`` is another API's request
    converted to Chat Completions (its session signals, such as Claude Code's
    ``metadata.user_id``, are read there)."""
    if len(raw) > config.http.max_body_bytes:
        raise APIError(413, f"Request body larger than {config.http.max_body_bytes} bytes.")
    fast = fast_body(raw, chat=chat)
    if fast is not None:
        body = fast[0]
    else:
        try:
            body = json_object(raw)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
    return parse_body(body, headers, chat=chat, session_body=session_body, caller=caller)


def parse_body(
    body: dict[str, Any],
    headers: dict[str, str],
    *,
    chat: bool,
    session_body: dict[str, Any] | None = None,
    caller: Caller = ANONYMOUS,
) -> ClientRequest:
    """:func:`parse_request` of a body already parsed: another API's request converted to Chat
    Completions by its codec (one JSON parse per request). ``body`` becomes the request's: its
    top-level fields are changed in place, nothing nested is. It must be what JSON can say
    (dicts, lists, strings, numbers, booleans, None), as a codec's conversion of parsed JSON
    is (the size limit is the client's own body's, checked as it was read)."""
    # ids parsed as int32 bytes (ids_json) are checked already: the model sees one id instead
    parsed = body.get("prompt")
    if not isinstance(parsed, TokenIds) and not (
        isinstance(parsed, list) and len(parsed) == 1 and isinstance(parsed[0], TokenIds)
    ):
        parsed = None
    else:
        body["prompt"] = [0] if isinstance(parsed, TokenIds) else [[0]]
    try:
        model = (_Chat if chat else _Completion).model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise APIError(400, f"Invalid `{loc}`: {first['msg']}.", param=loc or None) from None
    for name in _READ_BY_ROUTER:
        if name in body:
            value = getattr(model, name)
            body[name] = (
                value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value
            )
    if parsed is not None:
        body["prompt"] = parsed
    client_salt = _check_salt(body.get("cache_salt"))
    epoch = _epoch(headers.get(HEADER_EPOCH.lower(), "0"))
    conversation, source = conversation_of(headers, session_body or body)
    if conversation is not None and len(conversation) > 512:
        raise APIError(400, "The conversation id is longer than 512 characters.")
    body.pop(BODY_CONVERSATION_ID, None)
    # A client never sends its own transfer handle; only exact prompt ids are honoured.
    params = body.pop(BODY_KV_TRANSFER_PARAMS, None) or {}
    prompt_ids = None
    if BODY_PROMPT_TOKEN_IDS in params:
        if not chat:
            raise APIError(400, "kv_transfer_params.prompt_token_ids is for the chat endpoint.")
        prompt_ids = _ids(params[BODY_PROMPT_TOKEN_IDS], "kv_transfer_params.prompt_token_ids")
    elif not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list | TokenIds):
            prompt = prompt[0]
        if isinstance(prompt, TokenIds) or (
            isinstance(prompt, list) and prompt and type(prompt[0]) is int
        ):
            prompt_ids = _ids(prompt, "prompt")
            # the body's prompt is their JSON (D's body replaces it with the same)
            body["prompt"] = prompt_ids.wire if body["prompt"] is prompt else [prompt_ids.wire]
        elif isinstance(prompt, list) and len(prompt) != 1:
            raise APIError(
                400, "The router serves one prompt per completions request.", param="prompt"
            )
    effective = caller.cache_salt(client_salt)
    if effective is not None:
        body["cache_salt"] = effective
    return ClientRequest(
        chat=chat,
        body=body,
        tenant=caller.tenant,
        cache_salt=body.get("cache_salt"),
        conversation_id=conversation,
        conversation_source=source,
        epoch=epoch,
        prompt_ids=prompt_ids,
        lease_s=lease_seconds(headers.get(HEADER_LEASE.lower())),
        echo_prompt_ids=headers.get(HEADER_ECHO_PROMPT_TOKEN_IDS.lower(), "").lower()
        in ("1", "true", "yes"),
    )


def lease_seconds(raw: Any) -> float | None:
    """A lease length from a header or a body (400 unless a positive number up to a day)."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if not (0 < value <= 86_400):
        raise APIError(
            400, f"{HEADER_LEASE} must be a number of seconds in (0, 86400], got {str(raw)[:40]!r}."
        )
    return value


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
