"""``Client`` / ``AsyncClient``: the ``openai`` clients, with conversations that stay exact.

:class:`_BaseClient` holds what the twins share (the ``openai`` client without its own retries,
the renderer, the retry policy, the lease renewer, making and resuming conversations); each
twin only names its ``openai`` class, its remote renderer, its lease driver, its conversation
class and how it closes.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar, overload

import openai
from typing_extensions import Self

from agentkv._conversation import AsyncConversation, Conversation
from agentkv._lease import AsyncLeaseRenewer, LeaseRenewer, LeaseStats, _Driver
from agentkv._ledger import Ledger
from agentkv._receipt import Mode
from agentkv._rendering import AsyncRemoteRenderer, AsyncRenderer, RemoteRenderer, Renderer
from agentkv._retry import RetryPolicy

__all__ = ["AsyncClient", "Client", "wrap"]

OpenAIT = TypeVar("OpenAIT", openai.OpenAI, openai.AsyncOpenAI)
R = TypeVar("R", Renderer, AsyncRenderer)
V = TypeVar("V", Conversation, AsyncConversation)


class _BaseClient(Generic[OpenAIT, R, V]):
    """What :class:`Client` and :class:`AsyncClient` share (no I/O)."""

    _RENDERER: ClassVar[str]
    """How the error for a bad ``renderer`` names the accepted type."""

    def __init__(
        self,
        *,
        renderer: str | R = "remote",
        retries: int | RetryPolicy = 2,
        openai_client: OpenAIT | None = None,
        lease_s: float | None = None,
        **openai_kwargs: Any,
    ) -> None:
        if openai_client is None:
            openai_kwargs.setdefault("max_retries", 0)
            openai_client = self._new_openai(**openai_kwargs)
        else:
            openai_client = openai_client.with_options(max_retries=0)
        self.openai: OpenAIT = openai_client
        self.retry = RetryPolicy.of(retries)
        """How failed requests are retried (``retries=``: an int is ``RetryPolicy(retries=n)``)."""
        if isinstance(renderer, str):
            if renderer != "remote":
                raise ValueError(f"renderer must be 'remote' or {self._RENDERER} instance")
            renderer = self._remote_renderer(openai_client)
        self.renderer: R = renderer
        self._lease: _Driver[Any] | None = (
            None if lease_s is None else self._new_lease(openai_client, lease_s)
        )
        if self._lease is not None:
            weakref.finalize(self, self._lease.close)

    # -- what each twin names -----------------------------------------------------------------
    _OPENAI: ClassVar[type[openai.OpenAI | openai.AsyncOpenAI]]
    _REMOTE_RENDERER: ClassVar[type[RemoteRenderer | AsyncRemoteRenderer]]
    _LEASE_RENEWER: ClassVar[type[LeaseRenewer | AsyncLeaseRenewer]]
    _CONVERSATION: ClassVar[type[Conversation | AsyncConversation]]

    def _new_openai(self, **kwargs: Any) -> OpenAIT:
        return self._OPENAI(**kwargs)  # type: ignore[return-value]

    def _remote_renderer(self, client: OpenAIT) -> R:
        return self._REMOTE_RENDERER.for_client(client)  # type: ignore[arg-type,return-value]

    def _new_lease(self, client: OpenAIT, lease_s: float) -> _Driver[Any]:
        return self._LEASE_RENEWER.for_openai(client, lease_s)

    def _conversation(self, ledger: Ledger) -> V:
        return self._CONVERSATION(self, ledger)  # type: ignore[arg-type,return-value]

    # -- shared -------------------------------------------------------------------------------
    @property
    def lease_stats(self) -> LeaseStats | None:
        """What the lease renewer has done; None without ``lease_s``."""
        return None if self._lease is None else self._lease.stats

    def conversation(
        self,
        id: str | None = None,
        *,
        model: str | None = None,
        system: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        mode: Mode = "exact",
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> V:
        """A conversation with a stable id (a new uuid4 unless given)."""
        ledger = Ledger(
            id=id,
            model=model,
            system=system,
            tools=tools,
            mode=mode,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self._conversation(ledger)

    def resume(self, state: Mapping[str, Any]) -> V:
        """The conversation saved by ``conversation.to_state()``."""
        return self._conversation(Ledger.from_state(state))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.openai, name)


class Client(_BaseClient[openai.OpenAI, Renderer, Conversation]):
    """``openai.OpenAI`` with agentkv conversations. Takes ``openai.OpenAI``'s arguments.

    Args:
        renderer: how new messages become token ids in exact mode: ``"remote"`` (the server's
            ``/tokenize``, through this client's ``openai`` client; default) or a
            :class:`~agentkv._rendering.Renderer` such as ``agentkv.LocalRenderer(...)``.
        retries: attempts after the first on connection errors, 429 and 503 (tenacity), or a
            :class:`~agentkv.RetryPolicy` (its wait and sleep too).
        openai_client: an ``openai.OpenAI`` to use (a copy without its own retries).
        lease_s: a retention lease (seconds): every turn carries ``X-AgentKV-Lease`` and a
            background thread renews the lease of every open conversation with one batched
            request every ``lease_s / 3`` (see docs/sdk.md, "Leases"). None: no lease.
        **openai_kwargs: passed to ``openai.OpenAI`` (``base_url``, ``api_key``, ...).
    """

    _RENDERER = "a Renderer"
    _OPENAI = openai.OpenAI
    _REMOTE_RENDERER = RemoteRenderer
    _LEASE_RENEWER = LeaseRenewer
    _CONVERSATION = Conversation

    def close(self) -> None:
        """Stop the lease renewer; close the HTTP connections (the openai client's and the
        renderer's)."""
        if self._lease is not None:
            self._lease.close()
        self.openai.close()
        closer = getattr(self.renderer, "close", None)
        if callable(closer):
            closer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_BaseClient[openai.AsyncOpenAI, AsyncRenderer, AsyncConversation]):
    """``openai.AsyncOpenAI`` with agentkv conversations (see :class:`Client`)."""

    _RENDERER = "an AsyncRenderer"
    _OPENAI = openai.AsyncOpenAI
    _REMOTE_RENDERER = AsyncRemoteRenderer
    _LEASE_RENEWER = AsyncLeaseRenewer
    _CONVERSATION = AsyncConversation

    async def aclose(self) -> None:
        """Like :meth:`Client.close`; ``close()`` is the same (``openai.AsyncOpenAI``'s
        spelling)."""
        if self._lease is not None:
            await self._lease.aclose()
        await self.openai.close()
        closer = getattr(self.renderer, "aclose", None)
        if callable(closer):
            await closer()

    close = aclose

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@overload
def wrap(client: openai.AsyncOpenAI, **kwargs: Any) -> AsyncClient: ...
@overload
def wrap(client: openai.OpenAI, **kwargs: Any) -> Client: ...
def wrap(client: openai.OpenAI | openai.AsyncOpenAI, **kwargs: Any) -> Client | AsyncClient:
    """An agentkv client around an existing ``openai`` client."""
    if isinstance(client, openai.AsyncOpenAI):
        return AsyncClient(openai_client=client, **kwargs)
    if isinstance(client, openai.OpenAI):
        return Client(openai_client=client, **kwargs)
    raise TypeError(
        f"wrap() takes an openai.OpenAI or openai.AsyncOpenAI, not {type(client).__name__}"
    )
