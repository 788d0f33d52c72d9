"""The router's configuration (typed, validated; every duration is ``*_s``): one model,
:class:`RouterConfig`, of nested groups (``upstream``, ``store``, ``retention``, ``tenancy``,
``paths``, ``http``, ``responses``, ``identity``). :mod:`agentkv.router.settings` reads it from a
file, the environment and flags; :mod:`agentkv.router.config_legacy` maps the flat keys of
before the groups onto them (deprecated)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentkv._toml import tomllib
from agentkv.protocol.kv_events import KVEventsConfig
from agentkv.router.config_legacy import migrate
from agentkv.router.paths import load_curves

__all__ = [
    "SHARED_NAMESPACE",
    "Backend",
    "HttpSettings",
    "IdentitySettings",
    "PathSettings",
    "ResponsesSettings",
    "RetentionSettings",
    "RouterConfig",
    "StoreSettings",
    "TenancySettings",
    "Tenant",
    "UpstreamSettings",
]

SHARED_NAMESPACE = "shared"
"""The namespace of sharing tenants' own client salts (``shared:<salt>``); no tenant may have it
as its configured ``cache_salt``."""


class Backend(BaseModel):
    """One vLLM (or simulator) instance."""

    model_config = ConfigDict(extra="forbid")

    url: str
    bidirectional: bool = True
    """P: the instance has ``bidirectional_kv_xfer`` (never attach a handle otherwise).
    D: it returns handles."""
    handle_on_stream: bool = True
    """D: the handle arrives on the ``finish_reason`` chunk of a stream (vLLM ≥ 0.33). False
    (vLLM 0.32): the router reads D without streaming and re-streams to the client, so it still
    gets the handle."""
    kv_events: KVEventsConfig | None = None
    """P: the instance's ``--kv-events-config`` (vLLM's JSON, as given to the engine). The router
    subscribes to its events to know what P holds in its own prefix cache (L): then receipts say
    what P really read from D (not an estimate) and the P with the longest local prefix is
    chosen. D: its events tell what D's CPU tier holds (vLLM's OffloadingConnector with
    ``self_describing_kv_events``), so a turn whose handle is gone can go to the D whose CPU
    tier holds its prefix (path ``cpu``, docs/paths.md). Events are an accelerator: lost ones
    cost accuracy, never a wrong read."""
    side_channel_host: str | None = None
    """What P must use to reach this D's handle (``remote_host``); default: the URL's host."""

    @property
    def host(self) -> str:
        from urllib.parse import urlsplit

        return urlsplit(self.url).hostname or "localhost"

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        """An engine URL is ``http(s)://host:port`` (refused at start-up, not at the first
        request)."""
        parsed = urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(
                f"engine URL {url!r} needs a scheme and a host, e.g. http://127.0.0.1:8100"
            )
        try:
            parsed.port  # noqa: B018 - raises on a port that is not a number in 0-65535
        except ValueError as exc:
            raise ValueError(f"engine URL {url!r}: {exc}") from None
        return url


class Tenant(BaseModel):
    """An API key's owner; conversations never cross tenants."""

    model_config = ConfigDict(extra="forbid")

    name: str
    api_keys: list[str] = Field(min_length=1)
    cache_salt: str | None = None
    """This tenant's prefix-cache namespace, used as it is (tenants with the same salt share
    prefix cache). Unset: derived from the name and ``tenancy.salt_secret``."""
    share_prefix_cache: bool = False
    """True: no salt, this tenant shares the engines' unsalted prefix cache (with the other
    tenants that share and with clients of the engines that bypass the router); a ``cache_salt``
    its clients send goes to the engines as ``shared:<salt>``, never into a salted tenant's
    namespace."""

    @model_validator(mode="after")
    def _check_salt(self) -> Tenant:
        if self.share_prefix_cache and self.cache_salt is not None:
            raise ValueError(f"tenant {self.name!r}: share_prefix_cache and cache_salt conflict")
        if self.cache_salt is not None and (
            not self.cache_salt
            or len(self.cache_salt) > 96
            or any(c in self.cache_salt for c in "@/\\\0:")
        ):
            raise ValueError(
                f"tenant {self.name!r}: cache_salt must be 1-96 characters without '@', '/', "
                "'\\', ':' or NUL (vLLM's rule, with room for a client's own salt)"
            )
        if self.cache_salt == SHARED_NAMESPACE:
            raise ValueError(
                f"tenant {self.name!r}: cache_salt {SHARED_NAMESPACE!r} is reserved (the "
                "namespace of sharing tenants' client salts)"
            )
        return self


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class UpstreamSettings(_Group):
    """``[upstream]``: the engines, and how the router talks to them."""

    prefill: list[Backend] = Field(default_factory=list)
    """Prefill instances (``[[upstream.prefill]]``; at least one)."""
    decode: list[Backend] = Field(default_factory=list)
    """Decode instances (``[[upstream.decode]]``; at least one)."""
    block_size: int = Field(16, ge=1)
    """The engines' KV block size (must equal vLLM's ``--block-size``)."""
    kv_recompute_threshold: int = Field(64, ge=0)
    """Attach a handle only when it brings at least this many verified tokens."""
    prefill_deadline_s: float = Field(30.0, gt=0)
    """Every P request (``max_tokens`` 1) answers within this plus
    ``prefill_deadline_per_1k_s`` per thousand prompt tokens: past it, one carrying a
    handle is retried without it, and one without is retried on another P while the stalled P
    leaves the rotation until its health check passes (a P that hangs but answers its health
    checks never holds a turn longer)."""
    prefill_deadline_per_1k_s: float = Field(0.5, ge=0)
    """What each thousand prompt tokens add to ``prefill_deadline_s``."""
    request_timeout_s: float = Field(600.0, gt=0)
    """The engine connection pools' overall timeout (``/tokenize``, ``/v1/models``, releases)."""
    max_connections: int = Field(256, ge=1)
    """Connections per engine, at most (requests beyond wait for one)."""
    keepalive_s: float = Field(4.0, gt=0)
    """Idle connections to an engine are closed after this (below the engines' own keep-alive
    timeout, uvicorn's 5 s, so the router never sends on a connection the engine is closing)."""
    retries: int = Field(2, ge=0)
    """Extra attempts on another instance when P (or D, before its first byte) fails."""
    health_interval_s: float = Field(2.0, gt=0)
    """Active health checks (``GET /health`` on every engine) this often."""
    eject_after_failures: int = Field(3, ge=1)
    """Consecutive failures that take an instance out until its health check passes."""
    affinity_max_in_flight: int = Field(262_144, ge=1)
    """P affinity yields to the least-loaded P when the preferred one has more prompt tokens in
    flight than this."""
    decode_first_byte_timeout_s: float = Field(30.0, gt=0)
    """A streamed D request that has sent nothing by then is retried on another D (after a
    fresh P pass) and the stalled D leaves the rotation until its health check passes."""
    decode_token_timeout_s: float = Field(0.5, gt=0)
    """A non-streamed D answer (whose first byte is its whole answer) gets
    ``decode_first_byte_timeout_s`` plus this per output token it may generate
    (``max_tokens``, else what the context leaves), then is treated as a stalled D."""
    drain_timeout_s: float = Field(120.0, gt=0)
    """When a client hangs up mid-stream, the router reads D on for up to this long so D
    finishes the turn and its handle is kept."""
    max_drains: int = Field(256, ge=0)
    """At most this many abandoned streams are read on at once (beyond: D aborts)."""
    tokenize_with: Literal["prefill", "decode"] = "prefill"
    """Which instance's ``/tokenize`` renders prompts that arrive without token ids."""


class StoreSettings(_Group):
    """``[store]``: where handles live."""

    backend: str = "memory"
    """``memory`` or a ``redis://`` URL (several router replicas share it)."""
    max_entries: int = Field(100_000, ge=1)
    """Handles the memory store holds, at most."""
    max_entries_per_tenant: int | None = Field(None, ge=1)
    """At most this many handles per tenant (memory and Redis stores), so no tenant's
    conversations can evict another tenant's handles. Default: with tenants, an equal share,
    ``max_entries // len(tenants)``; without, the whole store (memory) or none (Redis)."""
    handles_per_conversation: int = Field(4, ge=1)
    """K: handles kept per (tenant, conversation id), one per branch of history (several agents
    on one thread, sub-agents); a turn takes the one with the longest verified prefix, and the
    oldest beyond K is released."""
    failures_to_open: int = Field(3, ge=1)
    """Consecutive store errors that open the circuit breaker (turns then miss without calling
    the store)."""
    open_s: float = Field(2.0, gt=0)
    """How long the breaker stays open before one call probes the store again."""


class RetentionSettings(_Group):
    """``[retention]``: how long D's KV is used, leases, KV pressure."""

    decoder_kv_blocks_ttl_s: float = Field(480.0, gt=0)
    """D's ``decoder_kv_blocks_ttl``."""
    ttl_margin_s: float = Field(30.0, ge=0)
    """The router drops a handle this long before D would: router TTL = D TTL − margin."""
    lease_check_interval_s: float = Field(0.5, gt=0)
    """How often lapsed leases (``X-AgentKV-Lease``) are looked for and their handles released."""
    max_leases_per_tenant: int = Field(10_000, ge=1)
    """At most this many leases per tenant (lapsed ones not yet released count): past it a lease
    call for a new conversation is 429 and a turn's ``X-AgentKV-Lease`` starts none (the turn
    is served, its KV keeps D's TTL). Renewals of held leases always succeed."""
    kv_pressure_watermark: float | None = Field(0.9, gt=0, le=1)
    """Above this KV-cache usage on a D (its ``vllm:kv_cache_usage_perc``), the router releases
    that D's oldest stored handles, a tenth per health interval, so retained blocks never starve
    running requests; None turns it off."""

    @property
    def router_ttl_s(self) -> float:
        """How long the router uses a handle: D's TTL − the margin."""
        return self.decoder_kv_blocks_ttl_s - self.ttl_margin_s

    def ttl_problem(self) -> str | None:
        """What is wrong with the TTLs (the router must stop using a handle before D frees its
        blocks), or None."""
        if self.router_ttl_s > 0:
            return None
        return (
            f"retention.ttl_margin_s ({self.ttl_margin_s:g}) must be below "
            f"retention.decoder_kv_blocks_ttl_s ({self.decoder_kv_blocks_ttl_s:g})"
        )


class TenancySettings(_Group):
    """``[tenancy]``: API keys, tenants and their prefix-cache salts."""

    tenants: list[Tenant] = Field(default_factory=list)
    """API keys → tenants (``[[tenancy.tenants]]``). Empty: no authentication, one anonymous
    tenant."""
    salt_secret: str | None = None
    """Key of the HMAC that derives each tenant's ``cache_salt`` from its name (every replica
    must have the same; a long random string). Unset while some tenant's salt is derived: a
    random secret is generated once and kept in the user's state directory
    (:func:`agentkv.router.tenancy.secret_path`), which replicas on one host share and replicas
    on other hosts do not (a warning says so)."""
    admin_api_keys: list[str] = Field(default_factory=list)
    """Bearer keys that see ``/health``'s internals and, with tenants, ``/metrics``."""


class PathSettings(_Group):
    """``[paths]``: each turn's path (docs/paths.md): pull D's KV back, or decode in place."""

    mode: Literal["choose", "pull", "decode"] = "choose"
    """How a turn whose verified handle lives on a D reaches its first token. ``choose`` (the
    default): the path the cost model (:mod:`agentkv.router.paths`) estimates fastest within
    D's budget: ``decode`` (straight to that D, which prefills the new tokens from its own
    prefix cache) or the P path. ``pull``: always through P, which reads D's KV back (the only
    path before issue 24; what vLLM's example proxy does). ``decode``: decode in place whenever
    D's budget allows it (benchmarks by path)."""
    reuse_policy: Literal["verified", "unverified"] = "verified"
    """``unverified`` attaches a conversation's handle without checking it, like vLLM's example
    proxy. It reads wrong KV after a rewrite: for benchmarks and conformance tests only."""
    decode_max_new_tokens: int = Field(2048, ge=0)
    """A decode-in-place turn prefills at most this many new prompt tokens on D (Dynamo's
    conditional-disaggregation threshold)."""
    decode_tokens_in_flight: int = Field(8192, ge=0)
    """Prompt tokens decode-in-place turns may have prefilling on one D at once (one step's
    ``max_num_batched_tokens``); from the request until D's first bytes arrive (a stream's
    first chunk: vLLM sends it after the prefill) or it fails."""
    costs: str | None = None
    """A cost file written by ``agentkv calibrate --out`` (JSON; its ``curves``) for the cost
    model. Unset: the published figures of ``agentkv.router.paths.Curves``."""

    @field_validator("costs")
    @classmethod
    def _check_costs(cls, path: str | None) -> str | None:
        """A cost file that does not load is refused at start-up, not at the first turn."""
        load_curves(path)
        return path


class HttpSettings(_Group):
    """``[http]``: the router's own HTTP server, its limits and its logs."""

    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = Field(8000, ge=1, le=65535)
    """Port to listen on (clients use ``http://HOST:PORT/v1``)."""
    metrics_port: int | None = Field(None, ge=1, le=65535)
    """Serve ``/metrics`` on this port instead of the main one (same process, same host, no
    key: keep it off public networks)."""
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    """Larger request bodies get a 413."""
    max_header_bytes: int = Field(64 * 1024, ge=4096)
    """A request's line and header fields together, at most; over it (or over ``max_headers``
    fields) the router answers 431 and closes the connection before reading the rest or
    checking the key."""
    max_headers: int = Field(100, ge=16)
    """Header fields in one request, at most."""
    parser: Literal["auto", "httptools", "h11"] = "auto"
    """uvicorn's HTTP/1.1 implementation (``auto``: httptools when installed, as uvicorn picks);
    both enforce ``max_header_bytes`` and ``max_headers``."""
    log_format: Literal["text", "json"] = "text"
    """``json``: one JSON object per log line."""
    heap_trim_interval_s: float = Field(1.0, ge=0)
    """Every this many seconds, return the heap's free memory to the system when at least a MiB
    is free (glibc's ``malloc_trim``; agent-sized turns leave megabytes free, fragmented by what
    stays live); 0: never."""


class ResponsesSettings(_Group):
    """``[responses]``: stored responses of ``/v1/responses`` (``previous_response_id``)."""

    ttl_s: float = Field(3600.0, gt=0)
    """A stored response (what ``previous_response_id`` continues from) lives this long. It is
    kept in the handle store's backend: this process's memory, or the same Redis."""
    max_per_tenant: int = Field(1000, ge=1)
    """Memory: at most this many stored responses per tenant (least recently used go first)."""
    max_bytes_per_tenant: int = Field(256 * 1024 * 1024, ge=1024)
    """Memory: at most this many bytes of stored responses per tenant (a stored response holds
    its whole chain's items)."""


class IdentitySettings(_Group):
    """``[identity]``: token identity for clients that send messages
    (:mod:`agentkv.router.identity`)."""

    keep: bool = True
    """When a chat request's history repeats the conversation's previous answer as the engine
    returned it, prompt with the previous prompt's ids + the generated ids + the new messages'
    ids (the SDK's exact mode), so the answer is pulled too instead of trimmed as drift. False:
    every request's messages are rendered whole."""
    max_tokens_per_conversation: int = Field(262_144, ge=1)
    """Token ids kept per conversation (its branches together, up to
    ``store.handles_per_conversation`` of them); a longer turn is not kept (the next is
    rendered)."""
    max_tokens: int = Field(16_777_216, ge=1)
    """Token ids kept in all by the memory ledger (4 bytes each; least recently used
    conversations go first). With a Redis store the entries live in Redis."""
    ttl_s: float = Field(3_600.0, gt=0)
    """How long a conversation's token identity is kept after its last turn (never shorter than
    the router TTL). It does not depend on D's KV: a turn after a longer pause than the router
    TTL is recomputed, but still prompts with the answers' generated ids where the client sent
    them back unchanged, so its history stays what the model generated (as the SDK's exact
    mode keeps it) instead of a re-rendering (tool calls re-serialized, think blocks dropped)
    that every later turn of the conversation would carry. Memory: ``max_tokens`` bounds the
    memory ledger; with Redis each conversation's entry (at most
    ``max_tokens_per_conversation`` ids) lives this long."""


class RouterConfig(BaseModel):
    """Everything ``agentkv router`` needs, in groups (a TOML table each)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    complete: ClassVar[bool] = True
    """False in a part of a larger configuration (a profile's ``[router]``) that brings the
    engines and D's TTL itself: they are not checked here."""

    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    """The engines, and how the router talks to them."""
    store: StoreSettings = Field(default_factory=StoreSettings)
    """Where handles live."""
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
    """How long D's KV is used, leases, KV pressure."""
    tenancy: TenancySettings = Field(default_factory=TenancySettings)
    """API keys, tenants and their prefix-cache salts."""
    paths: PathSettings = Field(default_factory=PathSettings)
    """Each turn's path: pull D's KV back, or decode in place."""
    http: HttpSettings = Field(default_factory=HttpSettings)
    """The router's own HTTP server, its limits and its logs."""
    responses: ResponsesSettings = Field(default_factory=ResponsesSettings)
    """Stored responses of /v1/responses."""
    identity: IdentitySettings = Field(default_factory=IdentitySettings)
    """Token identity for clients that send messages."""

    @model_validator(mode="before")
    @classmethod
    def _flat_keys(cls, data: Any) -> Any:
        """The flat keys of before the groups (``store_max_entries``, ``port``, …), each mapped
        onto its group with a DeprecationWarning naming the new key."""
        return migrate(data) if isinstance(data, dict) else data

    @property
    def tenant_bound(self) -> int | None:
        """Handles a tenant may hold: ``store.max_entries_per_tenant``, else with tenants an
        equal share of ``store.max_entries``; ``None``: no per-tenant bound."""
        if self.store.max_entries_per_tenant is not None:
            return self.store.max_entries_per_tenant
        if self.tenancy.tenants:
            return max(1, self.store.max_entries // len(self.tenancy.tenants))
        return None

    @property
    def router_ttl_s(self) -> float:
        """How long the router uses a handle: D's TTL − the margin."""
        return self.retention.router_ttl_s

    @property
    def identity_keep_s(self) -> float:
        """How long token identity is kept: ``identity.ttl_s``, at least the router TTL."""
        return max(self.identity.ttl_s, self.router_ttl_s)

    @model_validator(mode="after")
    def _check_engines(self) -> RouterConfig:
        """At least one prefill and one decode instance."""
        if not self.complete:
            return self
        missing = [role for role in ("prefill", "decode") if not getattr(self.upstream, role)]
        if missing:
            raise ValueError("; ".join(f"upstream.{role}: required" for role in missing))
        return self

    @model_validator(mode="after")
    def _check_ttl(self) -> RouterConfig:
        problem = self.retention.ttl_problem()
        if problem is not None and self.complete:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _check(self) -> RouterConfig:
        keys: set[str] = set()
        for tenant in self.tenancy.tenants:
            for key in tenant.api_keys:
                if key in keys:
                    raise ValueError(f"API key of tenant {tenant.name!r} is used twice")
                keys.add(key)
        if keys & set(self.tenancy.admin_api_keys):
            raise ValueError("an admin API key is also a tenant's API key")
        metrics_port = self.http.metrics_port
        if metrics_port is not None and metrics_port == self.http.port:
            raise ValueError(f"http.metrics_port ({metrics_port}) must differ from http.port")
        return self

    @classmethod
    def load(cls, path: str | Path) -> RouterConfig:
        """From a TOML or JSON file (:func:`agentkv.router.settings.load_settings` adds the
        environment and flags)."""
        return cls.model_validate(read_file(path))


def read_file(path: str | Path) -> dict[str, Any]:
    """A TOML or JSON configuration file's data (``.json``: JSON, else TOML)."""
    p = Path(path)
    text = p.read_text()
    data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a table of settings")
    return data
