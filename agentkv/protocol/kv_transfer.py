"""``kv_transfer_params``: the NixlConnector handle, with vLLM 0.33's own field names.

The same dict travels both ways (``reference/vllm-protocol.md`` §2):

* router -> P, first turn: :meth:`KVTransferParams.for_prefill` (``do_remote_decode: true``);
* P -> router -> D: P's handle (``do_remote_prefill: true``, P's blocks);
* D -> router: D's handle at the end of a turn (``do_remote_decode: true``, D's blocks, expiry on
  D's private ``perf_counter`` clock);
* router -> P, next turn: D's handle, possibly trimmed (:meth:`trimmed`) or emptied
  (:meth:`release_only`).

Unknown fields are kept (``extra="allow"``) because connectors add their own.

The model validates what crosses a trust boundary; the hot paths (the router once per turn, the
simulator once per request) read and edit the wire dict itself through the plain functions
below, so this module is the one place that spells the handle's field names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "BLOCK_IDS",
    "PULL_FIELDS",
    "HandleAddress",
    "KVTransferParams",
    "address",
    "asks_for_handle",
    "block_ids",
    "can_read_from_decode",
    "engine_id",
    "expiry_time",
    "handle_key",
    "is_prefill_handle",
    "make_handle",
    "mark_processed",
    "mark_read",
    "num_tokens",
    "owner_host",
    "prefill_cached_tokens",
    "with_owner_host",
]

BLOCK_IDS = "remote_block_ids"
"""The field holding D's block ids (one list per KV cache group): the bulk of a handle."""
PULL_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
"""Fields that must all be present (with ``remote_block_ids``) for vLLM to start a read."""


class KVTransferParams(BaseModel):
    """One ``kv_transfer_params`` object (request or response)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_block_ids: list[list[int]] | None = None
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int | None = None
    dcp_size: int | None = None
    pp_size: int | None = None
    remote_num_tokens: int | None = None
    remote_blocks_expiry_time: float | None = None
    """Seconds on the *sender's* ``time.perf_counter()`` clock, never wall time."""
    remote_registration_generation: int | None = None
    transfer_mode: str | None = None
    remote_prefill_cached_tokens: int | None = None
    prompt_token_ids: list[int] | None = Field(default=None)
    """Request-only (vLLM 0.33): skip templating and use these ids as the prompt."""

    @classmethod
    def for_prefill(cls) -> KVTransferParams:
        """What a router sends P on a turn with no reuse (vLLM's proxies send the same)."""
        return cls(
            do_remote_decode=True,
            do_remote_prefill=False,
            remote_engine_id=None,
            remote_block_ids=None,
            remote_host=None,
            remote_port=None,
        )

    @classmethod
    def in_place(cls) -> KVTransferParams:
        """What a router sends D for a turn it decodes in place (no P): a non-empty dict that
        asks for no transfer, so vLLM 0.33's D prefills from its own prefix cache, keeps the
        blocks and returns its handle (``pull_scheduler.request_finished``; an empty one
        would free them and return none)."""
        return cls(do_remote_prefill=False, do_remote_decode=False)

    @classmethod
    def from_wire(cls, data: Any) -> KVTransferParams | None:
        """Parse a wire value (``None`` stays ``None``)."""
        if data is None:
            return None
        return cls.model_validate(data)

    def to_wire(self) -> dict[str, Any]:
        """The dict to put in a JSON body; fields left unset are omitted."""
        return self.model_dump(exclude_unset=True)

    @property
    def is_pullable(self) -> bool:
        """Whether vLLM would start a read with this handle (blocks and all address fields)."""
        fields = self.model_dump(exclude_unset=True)
        return bool(self.remote_block_ids) and all(f in fields for f in PULL_FIELDS)

    @property
    def has_blocks(self) -> bool:
        """Whether the handle names any block groups (a handle without them holds nothing)."""
        return bool(self.remote_block_ids)

    @property
    def num_tokens(self) -> int:
        """The tokens the handle's blocks hold (0 when unset)."""
        return self.remote_num_tokens or 0

    @property
    def num_blocks(self) -> int:
        """Blocks per KV-cache group (the first group's count)."""
        return len(self.remote_block_ids[0]) if self.remote_block_ids else 0

    def for_reading(self) -> KVTransferParams:
        """D's handle as P must receive it to read D's blocks (or notify D): unknown fields such
        as vLLM 0.33's ``remote_registration_generation`` pass through whole."""
        return self.model_copy(update={"do_remote_decode": True, "do_remote_prefill": False})

    def trimmed(self, num_blocks: int, block_size: int) -> KVTransferParams:
        """The same handle cut to its first ``num_blocks`` blocks in every group."""
        groups = [group[:num_blocks] for group in self.remote_block_ids or []]
        tokens = min(num_blocks * block_size, self.remote_num_tokens or 0)
        return self.model_copy(update={"remote_block_ids": groups, "remote_num_tokens": tokens})

    def release_only(self) -> KVTransferParams:
        """The same handle with ``remote_num_tokens: 0``: P only notifies the owner to free it."""
        return self.model_copy(update={"remote_num_tokens": 0})


# -- the wire dict, read and edited without a model ----------------------------------------------
Params = Mapping[str, Any]


@dataclass(frozen=True)
class HandleAddress:
    """Where a handle's blocks live: the owner's side channel and its request."""

    host: str
    port: int
    request_id: str
    engine_id: str


def is_prefill_handle(params: Params) -> bool:
    """P's handle (``do_remote_prefill``): the reader pulls P's prompt KV."""
    return bool(params.get("do_remote_prefill"))


def asks_for_handle(params: Params) -> bool:
    """``do_remote_decode``: the request runs on P, and its answer carries P's handle for D."""
    return bool(params.get("do_remote_decode"))


def can_read_from_decode(params: Params) -> bool:
    """D's handle complete enough for P to read it back (``do_remote_decode``, blocks and every
    address field): vLLM's bidirectional read."""
    return (
        bool(params.get("do_remote_decode"))
        and bool(params.get("remote_block_ids"))
        and all(f in params for f in PULL_FIELDS)
    )


def num_tokens(params: Params) -> int:
    """``remote_num_tokens`` (0 when unset)."""
    return int(params.get("remote_num_tokens") or 0)


def block_ids(params: Params) -> list[int]:
    """The first KV-cache group's block ids."""
    return list((params.get("remote_block_ids") or [[]])[0])


def expiry_time(params: Params) -> float | None:
    """``remote_blocks_expiry_time``: seconds on the owner's private clock, or None."""
    value = params.get("remote_blocks_expiry_time")
    return None if value is None else float(value)


def address(params: Params) -> HandleAddress:
    """The owner's side channel and request, as the reader uses them."""
    return HandleAddress(
        host=str(params.get("remote_host")),
        port=int(params.get("remote_port") or 0),
        request_id=str(params.get("remote_request_id")),
        engine_id=str(params.get("remote_engine_id")),
    )


def engine_id(params: Params) -> str | None:
    """``remote_engine_id``: the engine instance that holds the handle's blocks (a restarted
    engine has a new one), or None."""
    value = params.get("remote_engine_id")
    return value if isinstance(value, str) and value else None


def handle_key(params: Params) -> str:
    """Engine id and request id: unique per handle on one owner."""
    return f"{params.get('remote_engine_id')}|{params.get('remote_request_id')}"


def owner_host(params: Params) -> str:
    """``remote_host`` as a string (empty when unset)."""
    return str(params.get("remote_host") or "")


def with_owner_host(params: Params, host: str) -> dict[str, Any]:
    """A copy of ``params`` whose reader reaches the owner at ``host``."""
    return {**params, "remote_host": host}


def prefill_cached_tokens(params: Params) -> int | None:
    """On D: P's ``remote_prefill_cached_tokens`` when the handle is P's (None otherwise)."""
    if not is_prefill_handle(params):
        return None
    value = params.get("remote_prefill_cached_tokens")
    return int(value) if isinstance(value, int) else None


def mark_read(params: dict[str, Any]) -> None:
    """In place: the handle's transfer is under way (vLLM: one transfer per request)."""
    params["do_remote_prefill"] = False


def mark_processed(params: dict[str, Any]) -> None:
    """In place: the connector has acted on the handle (vLLM's ``_remote_blocks_processed``)."""
    params["_remote_blocks_processed"] = True


def make_handle(
    *,
    prefill_side: bool,
    block_ids: list[int],
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    num_tokens: int,
    expiry_time: float | None,
    cached_tokens: int | None = None,
) -> dict[str, Any]:
    """The handle an engine returns at the end of a request, in vLLM 0.33's NixlConnector shape:
    P's (``prefill_side``: D reads the prompt, ``cached_tokens`` is P's prefix hit) or D's
    (P reads it back next turn, until ``expiry_time``)."""
    handle: dict[str, Any] = {
        "do_remote_prefill": prefill_side,
        "do_remote_decode": not prefill_side,
        "remote_block_ids": [block_ids],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": expiry_time,
        "remote_registration_generation": 1,
        "transfer_mode": "pull",
    }
    if cached_tokens is not None:
        handle["remote_prefill_cached_tokens"] = cached_tokens
    return handle
