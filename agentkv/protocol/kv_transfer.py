"""``kv_transfer_params``: the NixlConnector handle, with vLLM 0.33's own field names.

The same dict travels both ways (``reference/vllm-protocol.md`` §2):

* router -> P, first turn: :meth:`KVTransferParams.for_prefill` (``do_remote_decode: true``);
* P -> router -> D: P's handle (``do_remote_prefill: true``, P's blocks);
* D -> router: D's handle at the end of a turn (``do_remote_decode: true``, D's blocks, expiry on
  D's private ``perf_counter`` clock);
* router -> P, next turn: D's handle, possibly trimmed (:meth:`trimmed`) or emptied
  (:meth:`release_only`).

Unknown fields are kept (``extra="allow"``) because connectors add their own.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["PULL_FIELDS", "KVTransferParams"]

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
