"""A turn's prompt as ids when the router has none kept: the client's own ids (exact mode, a
completions prompt of ids), or a tokenizing instance's ``/tokenize`` of the same messages and
template arguments (P's by default: ``upstream.tokenize_with``)."""

from __future__ import annotations

import logging
from typing import Any

import orjson

from agentkv.protocol.errors import APIError, UpstreamError
from agentkv.router.config import RouterConfig
from agentkv.router.http import TransportError
from agentkv.router.ids_json import tokenized
from agentkv.router.logs import safe
from agentkv.router.metrics import RouterMetrics
from agentkv.router.request import ClientRequest, TokenIds, checked_ids
from agentkv.router.upstream import EnginePool

__all__ = ["Tokenizer"]

log = logging.getLogger("agentkv.router")


class Tokenizer:
    """Asks the tokenizing instances, with the turn's retries."""

    def __init__(self, config: RouterConfig, pool: EnginePool, metrics: RouterMetrics) -> None:
        self.config, self.pool, self.metrics = config, pool, metrics

    async def prompt_ids(self, req: ClientRequest) -> TokenIds:
        if req.prompt_ids is not None:
            return req.prompt_ids
        body: dict[str, Any]
        if req.chat:
            keys = (
                "messages",
                "tools",
                "chat_template",
                "chat_template_kwargs",
                "add_generation_prompt",
                "continue_final_message",
                "add_special_tokens",
                "model",
            )
            body = {k: req.body[k] for k in keys if k in req.body}
        else:
            body = {
                k: req.body[k] for k in ("prompt", "add_special_tokens", "model") if k in req.body
            }
            if isinstance(body.get("prompt"), list):
                body["prompt"] = body["prompt"][0]
        raw = await self._answer("/tokenize", body)
        ids = tokenized(raw)  # straight to int32 bytes, else as any answer
        if ids is None:
            ids = checked_ids(orjson.loads(raw).get("tokens"))
        if ids is None:
            raise APIError(502, "The prefill instance's /tokenize returned no token ids.")
        return ids

    async def ask(self, path: str, body: dict[str, Any]) -> Any:
        """The JSON answer of a tokenizing instance (``upstream.tokenize_with``) to ``POST path``,
        tried on ``upstream.retries`` more when one fails; its 4xx is the client's error."""
        return orjson.loads(await self._answer(path, body))

    async def _answer(self, path: str, body: dict[str, Any]) -> bytes:
        """:meth:`ask`'s answer as bytes."""
        engines = (
            self.pool.prefill
            if self.config.upstream.tokenize_with == "prefill"
            else self.pool.decode
        )
        candidates = [e for e in engines if e.healthy] or list(engines)
        last: Exception | None = None
        tries = [candidates[i % len(candidates)] for i in range(self.config.upstream.retries + 1)]
        data = orjson.dumps(body)
        for engine in tries:
            try:
                r = await engine.client.post(path, data)
            except TransportError as exc:
                engine.failed(self.config.upstream.eject_after_failures)
                self.metrics.upstream_errors.labels("prefill", "tokenize").inc()
                last = exc
                continue
            if r.status == 200:
                return r.body
            if r.status < 500:
                raise UpstreamError(r.status, r.body)
            last = RuntimeError(f"{path} answered {r.status}")
        log.warning("could not tokenize a prompt: %s", safe(repr(last)))
        raise APIError(503, "Could not tokenize the prompt: no prefill instance answered.")
