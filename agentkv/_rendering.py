"""How new messages become token ids in exact mode.

The conversation never re-renders what it already sent: the next prompt is the previous
prompt + the generated ids + the tokens of the *new* messages. Those tokens are what the chat
template renders after the end of an assistant turn, up to and including the next generation
prompt. They are found with probe conversations, so any template works:

* ``plain`` = ``[user "x", assistant SENTINEL]``; rendered with ``continue_final_message`` its
  last tokens are the sentinel's (the *marker*); rendered as a finished history, what follows
  the marker is the template's end of an assistant turn (``close``);
* ``base``  = ``plain`` with tool calls that the new tool results answer, when there are any;
  what follows the marker up to ``close`` is the template's rendering of those calls, which the
  model generated itself;
* ``full``  = ``base + new messages`` with the generation prompt; what follows the marker,
  minus the rendered calls and minus the end-of-turn token when the model emitted it, is what to
  append.

The marker is searched for rather than a common prefix taken, because many templates render
earlier turns differently once a new message follows (reasoning pruning, look-ahead).

The probes are rendered by the server's ``/tokenize`` (:class:`RemoteRenderer`, exactly what
the server would render) or in-process with a Hugging Face tokenizer and chat template
(:class:`LocalRenderer`, extra ``agentkv[tokenizers]``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import httpx

from agentkv._conversation import RenderJob
from agentkv._exceptions import RenderError, ServerCapabilityError

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
    "append_ids",
    "probes",
    "render_ids",
    "root_url",
]

SENTINEL = "AGENTKVSENTINEL"
"""Stand-in content of the probe assistant message (one plain word, no whitespace)."""

Tokenize = Callable[[list[dict[str, Any]], bool, bool], list[int]]
"""``(messages, add_generation_prompt, continue_final_message) -> ids``."""


@runtime_checkable
class Renderer(Protocol):
    """Turns a :class:`~agentkv._conversation.RenderJob` into token ids (sync)."""

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


# -- the probe algorithm (sans-IO) ---------------------------------------------------------------
def probes(
    new_messages: Sequence[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(base, plain)``: the probe history for ``new_messages`` and a tool-call-free one."""
    answered = [str(m.get("tool_call_id")) for m in new_messages if m.get("role") == "tool"]
    plain: list[dict[str, Any]] = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": SENTINEL},
    ]
    base = [dict(m) for m in plain]
    if answered:
        base[-1]["tool_calls"] = [
            {"id": tid, "type": "function", "function": {"name": "f", "arguments": "{}"}}
            for tid in answered
        ]
    return base, plain


def _after(seq: Sequence[int], marker: Sequence[int]) -> list[int]:
    """``seq`` after the last occurrence of ``marker``."""
    m = len(marker)
    want = list(marker)
    for i in range(len(seq) - m, -1, -1):
        if list(seq[i : i + m]) == want:
            return list(seq[i + m :])
    raise RenderError(
        "The chat template did not render the probe assistant message verbatim; exact mode "
        "cannot find where new messages start. Use mode='messages' for this template."
    )


def append_ids(tokenize: Tokenize, job: RenderJob) -> list[int]:
    """The ids to append after the previous answer for ``job`` (kind ``append``)."""
    base, plain = probes(job.messages)
    marker = tokenize(plain, False, True)[-3:]
    close = _after(tokenize(plain, False, False), marker)
    calls: list[int] = []
    if base != plain:
        calls = _after(tokenize(base, False, False), marker)
        if close and calls[-len(close) :] == close:
            calls = calls[: -len(close)]
    rest = _after(tokenize([*base, *job.messages], True, False), marker)
    if calls and rest[: len(calls)] == calls:
        rest = rest[len(calls) :]  # the model generated its tool calls itself
    last = job.last_output_ids[-1:]
    if last and rest[:1] == last:
        rest = rest[1:]  # ... and its end-of-turn token
    return rest


def render_ids(tokenize: Tokenize, job: RenderJob) -> list[int]:
    """All ids for a ``full`` job, or the ids to append for an ``append`` job."""
    if job.kind == "full":
        return tokenize(job.messages, True, False)
    return append_ids(tokenize, job)


def _calls(job: RenderJob) -> list[tuple[list[dict[str, Any]], bool, bool]]:
    """The tokenize calls :func:`render_ids` makes, in order (for the async twin)."""
    if job.kind == "full":
        return [(job.messages, True, False)]
    base, plain = probes(job.messages)
    calls = [(plain, False, True), (plain, False, False)]
    if base != plain:
        calls.append((base, False, False))
    calls.append(([*base, *job.messages], True, False))
    return calls


# -- remote: the server's /tokenize ----------------------------------------------------------------
def _tokenize_body(
    job: RenderJob, model: str | None, messages: list[dict[str, Any]], gen: bool, cont: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": messages,
        "add_generation_prompt": gen,
        "continue_final_message": cont,
    }
    if model:
        body["model"] = model
    if job.tools:
        body["tools"] = job.tools
    if job.chat_template_kwargs:
        body["chat_template_kwargs"] = job.chat_template_kwargs
    return body


def _tokens(response: httpx.Response, url: str) -> list[int]:
    if response.status_code in (404, 405):
        raise ServerCapabilityError(
            f"{url} answered {response.status_code}: exact mode needs the server's /tokenize "
            "(vLLM serves it). Use mode='messages', or renderer=agentkv.LocalRenderer(...)."
        )
    if response.status_code in (429, 503):
        response.raise_for_status()  # retried by the conversation
    if response.status_code >= 400:
        raise RenderError(f"{url} answered {response.status_code}: {response.text[:500]}")
    tokens = response.json().get("tokens")
    if not isinstance(tokens, list):
        raise RenderError(f"{url} returned no 'tokens'.")
    return [int(t) for t in tokens]


def _auth_headers(client: Any) -> dict[str, str]:
    key = getattr(client, "api_key", None)
    return {"Authorization": f"Bearer {key}"} if isinstance(key, str) and key else {}


class RemoteRenderer:
    """Renders with the server's ``/tokenize`` (what the server itself would render)."""

    def __init__(
        self,
        root: str,
        *,
        model: str | None = None,
        headers: dict[str, str] | None = None,
        http_client: httpx.Client | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.root = root.rstrip("/")
        self.model = model
        self._http = http_client or httpx.Client(timeout=timeout_s, headers=headers or {})

    @classmethod
    def for_client(cls, client: Any) -> RemoteRenderer:
        return cls(root_url(client.base_url), headers=_auth_headers(client))

    def _tokenize(self, job: RenderJob) -> Tokenize:
        url = f"{self.root}/tokenize"

        def call(messages: list[dict[str, Any]], gen: bool, cont: bool) -> list[int]:
            body = _tokenize_body(job, self.model, messages, gen, cont)
            return _tokens(self._http.post(url, json=body), url)

        return call

    def render(self, job: RenderJob) -> list[int]:
        return render_ids(self._tokenize(job), job)

    def detokenize(self, ids: Sequence[int]) -> str:
        r = self._http.post(f"{self.root}/detokenize", json={"tokens": list(ids)})
        return str(r.json().get("prompt", "")) if r.status_code == 200 else ""

    def close(self) -> None:
        self._http.close()


class AsyncRemoteRenderer:
    """The async twin of :class:`RemoteRenderer`."""

    def __init__(
        self,
        root: str,
        *,
        model: str | None = None,
        headers: dict[str, str] | None = None,
        http_client: httpx.AsyncClient | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.root = root.rstrip("/")
        self.model = model
        self._http = http_client or httpx.AsyncClient(timeout=timeout_s, headers=headers or {})

    @classmethod
    def for_client(cls, client: Any) -> AsyncRemoteRenderer:
        return cls(root_url(client.base_url), headers=_auth_headers(client))

    async def render(self, job: RenderJob) -> list[int]:
        url = f"{self.root}/tokenize"
        seen: dict[tuple[str, bool, bool], list[int]] = {}
        for messages, gen, cont in _calls(job):
            body = _tokenize_body(job, self.model, messages, gen, cont)
            seen[(repr(messages), gen, cont)] = _tokens(await self._http.post(url, json=body), url)
        return render_ids(lambda m, g, c: seen[(repr(m), g, c)], job)

    async def detokenize(self, ids: Sequence[int]) -> str:
        r = await self._http.post(f"{self.root}/detokenize", json={"tokens": list(ids)})
        return str(r.json().get("prompt", "")) if r.status_code == 200 else ""

    async def aclose(self) -> None:
        await self._http.aclose()


# -- local: a Hugging Face tokenizer and chat template ---------------------------------------------
class LocalRenderer:
    """Renders in-process with a ``tokenizer.json`` and a Jinja chat template, exactly as
    ``transformers`` does (needs ``pip install "agentkv[tokenizers]"``).

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
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                'LocalRenderer needs the tokenizers extra: pip install "agentkv[tokenizers]"'
            ) from exc
        self.tokenizer: ChatTokenizer = load_tokenizer(tokenizer)
        self.template: ChatTemplate = load_template(template, self.tokenizer)

    def _tokenize(self, job: RenderJob) -> Tokenize:
        from agentkv.chat import TemplateError

        def call(messages: list[dict[str, Any]], gen: bool, cont: bool) -> list[int]:
            try:
                text = self.template.render_request(
                    messages,
                    tools=job.tools,
                    add_generation_prompt=gen,
                    continue_final_message=cont,
                    **(job.chat_template_kwargs or {}),
                )
            except (TemplateError, ValueError) as exc:
                raise RenderError(f"chat template {self.template.name}: {exc}") from exc
            return self.tokenizer.encode(text)

        return call

    def render(self, job: RenderJob) -> list[int]:
        return render_ids(self._tokenize(job), job)

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
