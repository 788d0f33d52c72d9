"""A client request, parsed and checked before anything is touched.

Everything that can be wrong with a request is found here, so a bad request never consumes a
stored handle: OpenAI's error shape, 4xx, and no state change.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentkv.protocol import (
    BODY_CONVERSATION_ID,
    BODY_KV_TRANSFER_PARAMS,
    BODY_PROMPT_CACHE_KEY,
    BODY_PROMPT_TOKEN_IDS,
    BODY_SESSION_ID,
    HEADER_CONVERSATION_ID,
    HEADER_EPOCH,
    HEADER_SESSION_ID,
)
from agentkv.router.config import RouterConfig

__all__ = ["ClientRequest", "RouterError", "parse_request", "tenant_for"]


class RouterError(Exception):
    """A request the router answers itself, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class _Common(BaseModel):
    """Types of the fields the router relies on (the engine checks the rest)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    return_token_ids: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None


class _Chat(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)


class _Completion(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]


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
    prompt_ids: list[int] | None
    """Exact prompt ids when the client sent them."""

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def wants_token_ids(self) -> bool:
        return bool(self.body.get("return_token_ids"))

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def copy_body(self) -> dict[str, Any]:
        return copy.deepcopy(self.body)


def tenant_for(config: RouterConfig, authorization: str | None) -> tuple[str, str | None]:
    """(tenant name, cache salt) for an ``Authorization`` header; 401 when keys are configured
    and this one is unknown."""
    if not config.tenants:
        return "default", None
    token = ""
    if authorization and authorization.lower().startswith("bearer "):
        token = authorization[7:].strip()
    for tenant in config.tenants:
        if token in tenant.api_keys:
            return tenant.name, tenant.cache_salt
    raise RouterError(401, "Invalid or missing API key (Authorization: Bearer <key>).")


def _ids(value: Any, param: str) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        raise RouterError(
            400, f"`{param}` must be a non-empty list of non-negative integers.", param=param
        )
    return list(value)


def parse_request(
    raw: bytes, headers: dict[str, str], *, chat: bool, config: RouterConfig
) -> ClientRequest:
    """Parse and check a request body and its headers (raises :class:`RouterError`)."""
    if len(raw) > config.max_body_bytes:
        raise RouterError(413, f"Request body larger than {config.max_body_bytes} bytes.")
    tenant, salt = tenant_for(config, headers.get("authorization"))
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RouterError(400, f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise RouterError(400, "The request body must be a JSON object.")
    try:
        (_Chat if chat else _Completion).model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise RouterError(400, f"Invalid `{loc}`: {first['msg']}.", param=loc or None) from None
    epoch_raw = headers.get(HEADER_EPOCH.lower(), "0")
    try:
        epoch = int(epoch_raw)
    except ValueError:
        raise RouterError(400, f"{HEADER_EPOCH} must be an integer, got {epoch_raw!r}.") from None
    conversation = (
        headers.get(HEADER_CONVERSATION_ID.lower())
        or _str(body.get(BODY_CONVERSATION_ID))
        or headers.get(HEADER_SESSION_ID.lower())
        or _str(body.get(BODY_SESSION_ID))
        or _str(body.get(BODY_PROMPT_CACHE_KEY))
    )
    if conversation is not None and len(conversation) > 512:
        raise RouterError(400, "The conversation id is longer than 512 characters.")
    body.pop(BODY_CONVERSATION_ID, None)
    # A client never sends its own transfer handle; only exact prompt ids are honoured.
    params = body.pop(BODY_KV_TRANSFER_PARAMS, None) or {}
    prompt_ids = None
    if BODY_PROMPT_TOKEN_IDS in params:
        if not chat:
            raise RouterError(400, "kv_transfer_params.prompt_token_ids is for the chat endpoint.")
        prompt_ids = _ids(params[BODY_PROMPT_TOKEN_IDS], "kv_transfer_params.prompt_token_ids")
    elif not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = _ids(prompt, "prompt")
        elif isinstance(prompt, list) and len(prompt) != 1:
            raise RouterError(
                400, "The router serves one prompt per completions request.", param="prompt"
            )
    if salt is not None:
        body["cache_salt"] = salt if not body.get("cache_salt") else f"{salt}:{body['cache_salt']}"
    return ClientRequest(
        chat=chat,
        body=body,
        tenant=tenant,
        cache_salt=body.get("cache_salt"),
        conversation_id=conversation,
        epoch=epoch,
        prompt_ids=prompt_ids,
    )


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
