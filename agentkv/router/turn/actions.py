"""The turn core's vocabulary: the actions it yields, the outcomes it is sent, how a turn ends
(:mod:`agentkv.router.turn`)."""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from agentkv.protocol import KVTransferParams
from agentkv.router.identity import Pending
from agentkv.router.paths import Curves
from agentkv.router.receipt import Receipt
from agentkv.router.store import StoredHandle, StoreKey, Taken
from agentkv.router.verify import PromptHashes

__all__ = [
    "KEEP_ON_DECODE",
    "Action",
    "Answered",
    "Candidates",
    "CpuHeld",
    "Decode",
    "DecodeFailed",
    "DecodeRefused",
    "DecodeStarted",
    "Discard",
    "End",
    "Fail",
    "Found",
    "Identify",
    "Kept",
    "PickDecode",
    "PickPrefill",
    "Prefill",
    "PrefillChoice",
    "PrefillDone",
    "PrefillFailed",
    "PrefillRefused",
    "PrefillTimedOut",
    "PrefillUnreachable",
    "Record",
    "Release",
    "RememberJob",
    "Renew",
    "Reserve",
    "Resolve",
    "Restore",
    "Retry",
    "Store",
    "Take",
    "Tokenize",
    "Turn",
    "TurnInput",
]


# -- actions ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Resolve:
    """Token identity for the request (:meth:`~agentkv.router.identity.Identity.resolve`);
    answered with a :class:`~agentkv.router.identity.Resolved`."""


@dataclass(frozen=True)
class Tokenize:
    """Render the request's prompt to ids on a tokenizing instance; answered with the ids."""


@dataclass(frozen=True)
class Renew:
    """Start or renew the conversation's lease (``X-AgentKV-Lease``); answered with None."""

    key: StoreKey
    seconds: float


@dataclass(frozen=True)
class Candidates:
    """The conversation's stored handles; answered with :class:`Found`."""

    key: StoreKey


@dataclass(frozen=True)
class CpuHeld:
    """What each healthy D's CPU tier holds of the prompt, from its KV events (an in-sync
    index of ``medium: "CPU"`` blocks, matched by the prompt's own token ids under its
    ``cache_salt``); answered with a mapping D url -> tokens (absent: nothing, or unknown)."""

    prompt: Sequence[int] = field(repr=False)
    cache_salt: str | None


@dataclass(frozen=True)
class Discard:
    """Take a handle out of the store unread and unreleased (D reaps it, or it is gone with a
    restarted D); ``reason``, when set, is counted in ``handles_dropped_total``."""

    key: StoreKey
    handle_id: str
    reason: str | None = None


@dataclass(frozen=True)
class Take:
    """Take one handle from the store (single use); answered with the
    :class:`~agentkv.router.store.Taken` or None (another replica took it first).
    ``releases``: the plan only releases it (``remote_num_tokens: 0``), counted in
    ``handles_released_total`` under this reason once it is taken."""

    key: StoreKey
    handle_id: str
    releases: str | None = None


@dataclass(frozen=True)
class Restore:
    """Put an unspent handle back with its age; answered with the handles it displaced."""

    key: StoreKey
    taken: Taken


@dataclass(frozen=True)
class Store:
    """Store D's new handle; answered with the handles it displaced (the handle itself when the
    store did not take it)."""

    key: StoreKey
    handle: StoredHandle


@dataclass(frozen=True)
class Release:
    """Have a P notify D to free a handle's blocks now (``remote_num_tokens: 0``)."""

    handle: StoredHandle
    reason: str


@dataclass(frozen=True)
class Retry:
    """A step failed and the turn goes on without it: counted in ``retries_total{reason}``."""

    reason: str


@dataclass(frozen=True)
class PickPrefill:
    """Place P (affinity, load, the longest local prefix L); answered with a
    :class:`PrefillChoice`, or None when no P qualifies. ``bidirectional``: the P must be able
    to read from D (a handle is attached)."""

    bidirectional: bool
    prompt: Sequence[int] = field(repr=False)


@dataclass(frozen=True)
class Prefill:
    """P's request (``max_tokens: 1``) for the prompt with ``params`` attached; answered with one
    of :class:`PrefillDone`, :class:`PrefillTimedOut`, :class:`PrefillUnreachable`,
    :class:`PrefillRefused`, :class:`PrefillFailed`."""

    url: str
    prompt: Sequence[int] = field(repr=False)
    params: dict[str, Any]
    reads: bool
    """P reads D's blocks (a handle is attached, not only to release it)."""
    attached: bool
    """A handle is attached (to read or only to release)."""


@dataclass(frozen=True)
class PickDecode:
    """Place D among ``candidates`` (least busy; ``holder``, the D that holds the conversation's
    KV, unless much busier); answered with its URL, or None when there is none."""

    candidates: tuple[str, ...]
    holder: str | None


@dataclass(frozen=True)
class Reserve:
    """Count ``tokens`` new prompt tokens in flight on the D at ``url`` (a decode-in-place
    turn), within its budget; answered with True, or False when the budget is full now. The
    driver gives them back when D's first bytes arrive (a stream's first chunk, a whole
    answer) or the request fails."""

    url: str
    tokens: int


KEEP_ON_DECODE: Mapping[str, Any] = KVTransferParams.in_place().to_wire()
"""``kv_transfer_params`` of a decode-in-place request (docs/paths.md): non-empty but asking for
no transfer, so vLLM's D prefills from its own prefix cache, keeps the blocks and returns a new
handle."""


@dataclass(frozen=True)
class RememberJob:
    """What :func:`remember_plan` needs of the turn once D has answered."""

    key: StoreKey | None
    epoch: int
    prompt: PromptHashes
    pending: Pending | None


@dataclass(frozen=True)
class Decode:
    """D's request with P's handle (or, decoding in place, :data:`KEEP_ON_DECODE`); answered
    with :class:`DecodeStarted`, :class:`DecodeFailed` or :class:`DecodeRefused`. The driver
    runs :func:`remember_plan` with ``remember`` when D's answer carries its handle."""

    url: str
    params: dict[str, Any]
    """P's handle, for D to read the prompt's KV; :data:`KEEP_ON_DECODE` in place."""
    receipt: Receipt
    prefill_url: str | None
    """None: the turn decodes in place, no P."""
    sim_headers: Mapping[str, str]
    remember: RememberJob
    reserved: int = 0
    """New prompt tokens :class:`Reserve`\\ d for this request on D (given back when D's
    first bytes arrive or it fails)."""


@dataclass(frozen=True)
class Record:
    """Keep the conversation's token identity (prompt + generated ids); answered with None once
    kept (before the client sees the end of the turn)."""

    pending: Pending
    prompt: Sequence[int]
    output: Sequence[int]
    message: Mapping[str, Any] | None


@dataclass(frozen=True)
class Identify:
    """D answered as engine ``engine_id`` (before its handle is stored: a new engine behind the
    URL drops its predecessor's handles)."""

    url: str
    engine_id: str | None


Action = (
    Resolve
    | Tokenize
    | Renew
    | Candidates
    | CpuHeld
    | Discard
    | Take
    | Restore
    | Store
    | Release
    | Retry
    | PickPrefill
    | Prefill
    | PickDecode
    | Reserve
    | Decode
    | Record
    | Identify
)


# -- outcomes ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Found:
    """The answer to :class:`Candidates`."""

    handles: Sequence[Taken]
    """Newest first."""
    engines: Mapping[str, str | None]
    """Each configured D's URL -> the engine id confirmed behind it (None: not identified now)."""
    can_pull: bool
    """Some healthy P can read from D."""
    in_flight: Mapping[str, int] = field(default_factory=dict)
    """Each D's new prompt tokens of decode-in-place turns in flight (absent: none)."""
    unhealthy: frozenset[str] = frozenset()
    """The D's out of rotation (no turn decodes in place there)."""
    running: Mapping[str, int] = field(default_factory=dict)
    """Each D's requests running (the router's own count; absent: none)."""
    p_queued_tokens: int = 0
    """Prompt tokens the least loaded healthy P is prefilling (the router's own count)."""


@dataclass(frozen=True)
class PrefillChoice:
    url: str
    local: int | None
    """L: what P holds of the prompt in its own prefix cache (None: unknown)."""


@dataclass(frozen=True)
class PrefillDone:
    """P answered 200."""

    params: dict[str, Any] | None
    """P's handle, with an owner address D can reach (None: P returned none)."""
    sim_headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefillTimedOut:
    """P did not answer within its deadline."""


@dataclass(frozen=True)
class PrefillUnreachable:
    """The request never reached P, or P died on it."""


@dataclass(frozen=True)
class PrefillRefused:
    """P's own client error (4xx but 429): the client's error, passed on unchanged."""

    status: int
    body: bytes


@dataclass(frozen=True)
class PrefillFailed:
    """P answered 5xx or 429."""

    status: int


@dataclass(frozen=True)
class DecodeStarted:
    """D answered 200: the client's response is under way."""


@dataclass(frozen=True)
class DecodeFailed:
    """D failed before its first byte (unreachable, 5xx, 429, nothing within the deadline)."""

    reason: Literal["unreachable", "deadline", "status"] = "status"
    """``unreachable``: never reached D; ``deadline``: nothing by the first-byte deadline;
    ``status``: D answered 5xx or 429 (it is up, its KV readable)."""


@dataclass(frozen=True)
class DecodeRefused:
    """D's own client error (4xx but 429), passed on unchanged."""

    status: int
    body: bytes


# -- how a turn ends --------------------------------------------------------------------------
@dataclass(frozen=True)
class Answered:
    receipt: Receipt
    prefill_url: str | None
    """None: decoded in place."""
    decode_url: str
    prompt: Sequence[int]


@dataclass(frozen=True)
class Fail:
    """The turn's error: the router's own (``message``, OpenAI's shape) or, with ``body``, an
    engine's client error passed on unchanged."""

    status: int
    message: str = ""
    param: str | None = None
    body: bytes | None = None


End = Answered | Fail
Turn = Generator[Action, Any, End]


@dataclass(frozen=True)
class TurnInput:
    """What the turn core reads of the request and the deployment."""

    key: StoreKey | None
    """(tenant, conversation id); None: no conversation, no reuse."""
    epoch: int
    model: str | None
    """The model the request is for (D's served model when it names none)."""
    cache_salt: str | None
    decode_urls: tuple[str, ...]
    prompt_ids: Sequence[int] | None = None
    """The client's own ids (exact mode, or a completions prompt of ids)."""
    lease_s: float | None = None
    max_tokens: object = None
    """``max_completion_tokens`` or ``max_tokens`` as the client sent it."""
    context_limit: int | None = None
    """The smallest ``max_model_len`` the engines serve (None: not known)."""
    curves: Curves = field(default_factory=Curves)
    """The path cost model's curves (config ``paths.costs``)."""


Kept = Literal["stored", "released", "none", "unknown"]
"""What :func:`remember_plan` did with D's handle (``unknown``: a shape it does not know)."""
