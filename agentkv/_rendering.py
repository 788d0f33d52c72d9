"""Renderers: how a conversation's new messages become token ids in exact mode.

The probe algorithm itself is sans-IO (:mod:`agentkv._probe`); a renderer answers its requests:

* :class:`RemoteRenderer` / :class:`AsyncRemoteRenderer`: the server's ``/tokenize`` and
  ``/detokenize`` (exactly what the server would render). Made by a client, it sends them
  through that client's ``openai`` client: the same base URL, API key, headers, timeout and
  HTTP connections. Made with a server root, it uses its own (or the given) ``httpx`` client.
* :class:`LocalRenderer` / :class:`AsyncLocalRenderer`: in-process, a Hugging Face tokenizer
  and chat template (extra ``vllm-agentkv[tokenizers]``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import httpx
import openai

from agentkv._exceptions import RenderError, ServerCapabilityError
from agentkv._ledger import RenderJob
from agentkv._probe import (
    SENTINEL,
    ChatCall,
    FixedProbes,
    Request,
    TextCall,
    ask_backend,
)

if TYPE_CHECKING:
    from agentkv.chat import ChatTemplate, ChatTokenizer

__all__ = [
    "SENTINEL",
    "AsyncLocalRenderer",
    "AsyncRemoteRenderer",
    "AsyncRenderer",
    "LocalRenderer",
    "RemoteRenderer",
    "Renderer",
    "root_url",
]


@runtime_checkable
class Renderer(Protocol):
    """Turns a :class:`~agentkv._ledger.RenderJob` into token ids (sync)."""

    def render(self, job: RenderJob) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...


@runtime_checkable
class AsyncRenderer(Protocol):
    """The async twin of :class:`Renderer`."""

    async def render(self, job: RenderJob) -> list[int]: ...

    async def detokenize(self, ids: Sequence[int]) -> str: ...


def root_url(base_url: Any) -> str:
    """The server root of an OpenAI base URL (``http://h:p/v1/`` → ``http://h:p``)."""
    url = str(base_url).rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


# -- remote: the server's /tokenize ----------------------------------------------------------------
def _tokenize_body(job: RenderJob, model: str | None, call: ChatCall) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": call.messages,
        "add_generation_prompt": call.add_generation_prompt,
        "continue_final_message": call.continue_final_message,
    }
    optional = {
        "model": model,
        "tools": job.tools,
        "chat_template_kwargs": job.chat_template_kwargs,
    }
    return body | {name: value for name, value in optional.items() if value}


def _text_body(model: str | None, text: str) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
    if model:
        body["model"] = model
    return body


@dataclass(frozen=True)
class _Reply:
    """A ``/tokenize`` or ``/detokenize`` answer, whichever HTTP client carried it."""

    status: int
    body: Any
    text: str
    retry: BaseException | None = None
    """429 / 503: the error to raise (the conversation retries it)."""


def _httpx_reply(response: httpx.Response) -> _Reply:
    retry = None
    if response.status_code in (429, 503):
        retry = httpx.HTTPStatusError(
            f"{response.status_code}", request=response.request, response=response
        )
    try:
        body = response.json()
    except ValueError:
        body = None
    text = response.text if response.status_code >= 400 else ""  # only errors quote it
    return _Reply(response.status_code, body, text, retry)


def _openai_error_reply(exc: openai.APIStatusError) -> _Reply:
    retry = exc if exc.status_code in (429, 503) else None
    return _Reply(exc.status_code, exc.body, exc.response.text, retry)


def _check(reply: _Reply, url: str) -> dict[str, Any]:
    if reply.retry is not None:
        raise reply.retry  # retried by the conversation
    if reply.status >= 400:
        raise RenderError(f"{url} answered {reply.status}: {reply.text[:500]}")
    return reply.body if isinstance(reply.body, dict) else {}


def _tokens(reply: _Reply, url: str) -> list[int]:
    if reply.status in (404, 405):
        raise ServerCapabilityError(
            f"{url} answered {reply.status}: exact mode needs the server's /tokenize "
            "(vLLM serves it). Use mode='messages', or renderer=agentkv.LocalRenderer(...)."
        )
    tokens = _check(reply, url).get("tokens")
    if not isinstance(tokens, list):
        raise RenderError(f"{url} returned no 'tokens'.")
    return [int(t) for t in tokens]


def _text(reply: _Reply, url: str) -> str:
    text = _check(reply, url).get("prompt")
    if not isinstance(text, str):
        raise RenderError(f"{url} returned no 'prompt'.")
    return text


def _detokenized(reply: _Reply) -> str:
    """``detokenize()`` (drift diagnosis only): the text, or "" when the server cannot."""
    ok = reply.status == 200 and isinstance(reply.body, dict)
    return str(reply.body.get("prompt", "")) if ok else ""


Parse = Callable[[_Reply, str], Any]


class _Remote:
    """What both remote renderers share: where a probe request goes and how its answer reads
    (no I/O)."""

    def __init__(self, root: str, model: str | None) -> None:
        self.root = root.rstrip("/")
        self.model = model
        self._fixed = FixedProbes()

    def _call(self, job: RenderJob, request: Request) -> tuple[str, dict[str, Any], Parse]:
        if isinstance(request, ChatCall):
            return f"{self.root}/tokenize", _tokenize_body(job, self.model, request), _tokens
        if isinstance(request, TextCall):
            return f"{self.root}/tokenize", _text_body(self.model, request.text), _tokens
        return f"{self.root}/detokenize", {"tokens": request.ids}, _text


def _root_of(root: str | None, openai_client: Any) -> str:
    if root is None and openai_client is None:
        raise ValueError("a remote renderer needs the server root or an openai client")
    return root if root is not None else root_url(openai_client.base_url)


class RemoteRenderer(_Remote):
    """Renders with the server's ``/tokenize`` (what the server itself would render).

    Args:
        root: the server root (``http://host:port``); None with ``openai_client``: its base URL
            without ``/v1``.
        model: sent with every tokenize request.
        headers, http_client, timeout_s: the ``httpx`` client to use without ``openai_client``.
        openai_client: send the requests through this ``openai.OpenAI`` (its base URL, API
            key, headers, timeout and connections; :meth:`for_client` does this).
    """

    def __init__(
        self,
        root: str | None = None,
        *,
        model: str | None = None,
        headers: dict[str, str] | None = None,
        http_client: httpx.Client | None = None,
        timeout_s: float = 60.0,
        openai_client: openai.OpenAI | None = None,
    ) -> None:
        super().__init__(_root_of(root, openai_client), model)
        self._via: openai.OpenAI | httpx.Client = (
            openai_client.with_options(max_retries=0)
            if openai_client is not None
            else http_client or httpx.Client(timeout=timeout_s, headers=headers or {})
        )

    @classmethod
    def for_client(cls, client: openai.OpenAI) -> RemoteRenderer:
        """A renderer that uses ``client``'s HTTP settings and connections."""
        return cls(openai_client=client)

    def _post(self, url: str, body: dict[str, Any]) -> _Reply:
        if isinstance(self._via, httpx.Client):
            return _httpx_reply(self._via.post(url, json=body))
        try:
            answer = self._via.post(url, cast_to=object, body=body)
        except openai.APIStatusError as exc:
            return _openai_error_reply(exc)
        return _Reply(200, answer, "")

    def _answer(self, job: RenderJob, request: Request) -> Any:
        url, body, parse = self._call(job, request)
        return parse(self._post(url, body), url)

    def render(self, job: RenderJob) -> list[int]:
        return self._fixed.run(job, lambda request: self._answer(job, request))

    def detokenize(self, ids: Sequence[int]) -> str:
        return _detokenized(self._post(f"{self.root}/detokenize", {"tokens": list(ids)}))

    def close(self) -> None:
        """Close its own ``httpx`` client (an ``openai`` client is closed by its owner)."""
        if isinstance(self._via, httpx.Client):
            self._via.close()


class AsyncRemoteRenderer(_Remote):
    """The async twin of :class:`RemoteRenderer` (``openai_client``: an ``AsyncOpenAI``)."""

    def __init__(
        self,
        root: str | None = None,
        *,
        model: str | None = None,
        headers: dict[str, str] | None = None,
        http_client: httpx.AsyncClient | None = None,
        timeout_s: float = 60.0,
        openai_client: openai.AsyncOpenAI | None = None,
    ) -> None:
        super().__init__(_root_of(root, openai_client), model)
        self._via: openai.AsyncOpenAI | httpx.AsyncClient = (
            openai_client.with_options(max_retries=0)
            if openai_client is not None
            else http_client or httpx.AsyncClient(timeout=timeout_s, headers=headers or {})
        )

    @classmethod
    def for_client(cls, client: openai.AsyncOpenAI) -> AsyncRemoteRenderer:
        """A renderer that uses ``client``'s HTTP settings and connections."""
        return cls(openai_client=client)

    async def _post(self, url: str, body: dict[str, Any]) -> _Reply:
        if isinstance(self._via, httpx.AsyncClient):
            return _httpx_reply(await self._via.post(url, json=body))
        try:
            answer = await self._via.post(url, cast_to=object, body=body)
        except openai.APIStatusError as exc:
            return _openai_error_reply(exc)
        return _Reply(200, answer, "")

    async def _answer(self, job: RenderJob, request: Request) -> Any:
        url, body, parse = self._call(job, request)
        return parse(await self._post(url, body), url)

    async def render(self, job: RenderJob) -> list[int]:
        return await self._fixed.run_async(job, lambda request: self._answer(job, request))

    async def detokenize(self, ids: Sequence[int]) -> str:
        return _detokenized(await self._post(f"{self.root}/detokenize", {"tokens": list(ids)}))

    async def aclose(self) -> None:
        """Close its own ``httpx`` client (an ``openai`` client is closed by its owner).
        ``close()`` is the same."""
        if isinstance(self._via, httpx.AsyncClient):
            await self._via.aclose()

    close = aclose


# -- local: a Hugging Face tokenizer and chat template ---------------------------------------------
class _LocalBackend:
    def __init__(self, renderer: LocalRenderer, job: RenderJob) -> None:
        self.r, self.job = renderer, job

    def chat(self, call: ChatCall) -> list[int]:
        return self.r.tokenizer.encode(self.r.render_text(call, self.job))

    def encode(self, text: str) -> list[int]:
        return self.r.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.r.tokenizer.decode(ids)


class LocalRenderer:
    """Renders in-process with a ``tokenizer.json`` and a Jinja chat template, exactly as
    ``transformers`` does after vLLM's message preprocessing (needs
    ``pip install "vllm-agentkv[tokenizers]"``).

    Args:
        tokenizer: a ``tokenizer.json`` or its folder; None = the real Qwen3 vocabulary.
        template: a chat template file; None = the tokenizer's own (else Qwen3's).
    """

    def __init__(
        self,
        tokenizer: str | os.PathLike[str] | None = None,
        template: str | os.PathLike[str] | None = None,
    ) -> None:
        try:
            from agentkv.chat import load_template, load_tokenizer
        except ImportError as exc:
            raise ImportError(
                f"LocalRenderer needs the tokenizers extra ({exc}): "
                'pip install "vllm-agentkv[tokenizers]"'
            ) from exc
        self.tokenizer: ChatTokenizer = load_tokenizer(tokenizer)
        self.template: ChatTemplate = load_template(template, self.tokenizer)
        self._fixed = FixedProbes()

    def render_text(self, call: ChatCall, job: RenderJob) -> str:
        """The text the template renders for ``call`` with ``job``'s tools and kwargs."""
        from agentkv.chat import TemplateError

        try:
            return self.template.render_request(
                call.messages,
                tools=job.tools,
                add_generation_prompt=call.add_generation_prompt,
                continue_final_message=call.continue_final_message,
                **(job.chat_template_kwargs or {}),
            )
        except (TemplateError, ValueError, TypeError, KeyError) as exc:
            raise RenderError(f"chat template {self.template.name}: {exc}") from exc

    def render(self, job: RenderJob) -> list[int]:
        backend = _LocalBackend(self, job)
        return self._fixed.run(job, lambda request: ask_backend(backend, request))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def as_async(self) -> AsyncLocalRenderer:
        """This renderer for :class:`~agentkv.AsyncClient`."""
        return AsyncLocalRenderer(self)


class AsyncLocalRenderer:
    """:class:`LocalRenderer` for :class:`~agentkv.AsyncClient` (CPU work, no I/O)."""

    def __init__(self, local: LocalRenderer) -> None:
        self.local = local

    async def render(self, job: RenderJob) -> list[int]:
        return self.local.render(job)

    async def detokenize(self, ids: Sequence[int]) -> str:
        return self.local.detokenize(ids)
