"""Verified reuse: what D holds, compared block by block with the new prompt.

After a turn the router records, with D's handle, the chained hashes of the full blocks D holds
(the prompt + the generated ids, ``remote_num_tokens`` of them) and the few tokens after the
last full block. The chain starts from a root that includes the model and the effective cache
salt, so a handle never verifies for a prompt under another salt. On a later turn the router
hashes the new prompt the same way; a handle is valid for the longest run of equal blocks, and
for all of it only when the tail tokens agree too.

The epoch is a hint, not a gate: every candidate is verified whatever its epoch, and the epoch
only says *why* a handle was cut (``rewrite``: the client announced a new history; ``drift``:
it did not).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from agentkv.protocol import KVTransferParams
from agentkv.router.store import StoredHandle, Taken

__all__ = [
    "PromptHashes",
    "ReusePlan",
    "chain_hashes",
    "hash_root",
    "held_record",
    "plan_reuse",
    "verified_tokens",
]

Decision = Literal["pull", "recompute", "miss", "stale", "expired", "local"]
Cause = Literal["rewrite", "drift"]


def hash_root(model: str | None, cache_salt: str | None) -> bytes:
    """The first parent of every hash chain: model and effective salt (tenant + request)."""
    seed = f"agentkv-v2\x00{model or ''}\x00{cache_salt or ''}".encode()
    return hashlib.blake2b(seed, digest_size=12).digest()


def chain_hashes(ids: Sequence[int], block_size: int, root: bytes = b"") -> list[str]:
    """Hex chained hashes of every full block of ``ids``, starting from ``root``."""
    data = array("q", ids).tobytes()
    step = block_size * 8
    out: list[str] = []
    parent = root
    for start in range(0, len(data) - step + 1, step):
        parent = hashlib.blake2b(parent + data[start : start + step], digest_size=12).digest()
        out.append(parent.hex())
    return out


class PromptHashes:
    """One prompt's block hashes, computed once per turn and only as far as they are needed."""

    def __init__(self, prompt: Sequence[int], block_size: int, root: bytes) -> None:
        self.prompt, self.block_size, self.root = prompt, block_size, root
        self._hashes: list[str] = []

    def upto(self, blocks: int) -> list[str]:
        """The first ``blocks`` hashes (fewer when the prompt is shorter)."""
        have = len(self._hashes)
        if blocks > have:
            bs = self.block_size
            parent = bytes.fromhex(self._hashes[-1]) if self._hashes else self.root
            more = self.prompt[have * bs : blocks * bs]
            self._hashes.extend(chain_hashes(more, bs, parent))
        return self._hashes[:blocks]


def held_record(
    output: Sequence[int], num_tokens: int, prompt: PromptHashes
) -> tuple[list[str], list[int]]:
    """(block hashes, tail tokens) of the first ``num_tokens`` of the prompt + ``output``, what D
    holds after a turn. The prompt's full blocks reuse the hashes verification computed."""
    bs = prompt.block_size
    held = [*prompt.prompt, *output][:num_tokens]
    full_blocks = len(held) // bs
    shared = min(full_blocks, len(prompt.prompt) // bs)
    known = prompt.upto(shared)
    parent = bytes.fromhex(known[-1]) if known else prompt.root
    rest = chain_hashes(held[shared * bs : full_blocks * bs], bs, parent)
    return [*known, *rest], list(held[full_blocks * bs :])


def verified_tokens(
    handle: StoredHandle, prompt: Sequence[int] | PromptHashes, root: bytes = b""
) -> int:
    """How many leading tokens of ``prompt`` the handle's blocks hold exactly (0 under another
    root: another model or salt)."""
    bs = handle.block_size
    hashes = prompt if isinstance(prompt, PromptHashes) else PromptHashes(prompt, bs, root)
    if hashes.block_size != bs or handle.root != hashes.root.hex():
        return 0
    mine = hashes.upto(len(handle.block_hashes))
    k = 0
    for a, b in zip(mine, handle.block_hashes, strict=False):
        if a != b:
            break
        k += 1
    if k < len(handle.block_hashes):
        return k * bs
    tokens = hashes.prompt
    tail = list(tokens[k * bs : k * bs + len(handle.tail_tokens)])
    if tail == handle.tail_tokens:
        return min(handle.num_tokens, k * bs + len(tail))
    return k * bs


@dataclass(frozen=True)
class ReusePlan:
    """What to attach to P's request for one turn."""

    decision: Decision
    params: KVTransferParams | None
    """The handle to send P (None: send no handle)."""
    attached_tokens: int
    """``remote_num_tokens`` attached: what D offers for this prompt (C, block-trimmed)."""
    verified_tokens: int
    """C: what the chosen handle holds of this prompt."""
    release: bool
    """True when ``params`` only releases D's blocks (``remote_num_tokens: 0``)."""
    taken: Taken | None = None
    """The stored handle this plan spends (None: nothing is taken from the store)."""
    cause: Cause | None = None
    """Why less than the whole handle is used: the client's rewrite or unannounced drift."""
    expired: tuple[Taken, ...] = ()
    """Candidates too close to D's TTL: removed from the store without a release."""

    def without_handle(self, decision: Decision = "recompute") -> ReusePlan:
        """The same turn with nothing attached (a retry without the handle)."""
        return ReusePlan(decision, None, 0, self.verified_tokens, False, None, self.cause)


def plan_reuse(
    candidates: Sequence[Taken],
    prompt: PromptHashes,
    *,
    epoch: int,
    router_ttl_s: float,
    threshold: int,
    can_pull: bool,
    verify: bool = True,
) -> ReusePlan:
    """The reuse decision for one turn (DESIGN.md, "Verified reuse"): the candidate with the
    longest verified prefix, trimmed to it; ``verify=False`` is vLLM's example proxy (attach the
    newest handle without checking it)."""
    live = [c for c in candidates if c.age_s < router_ttl_s]
    expired = tuple(c for c in candidates if c.age_s >= router_ttl_s)
    if not candidates:
        return ReusePlan("miss", None, 0, 0, False)
    if not live:
        # Too close to D's TTL: an expired read hangs real vLLM; D reaps the blocks itself.
        return ReusePlan("expired", None, 0, 0, False, expired=expired)
    if not can_pull:
        return ReusePlan("local", None, 0, 0, False, expired=expired)
    if not verify:
        newest = live[0]
        params = _as_params(newest.handle.params).for_reading()
        n = newest.handle.num_tokens
        return ReusePlan("pull", params, n, 0, False, newest, expired=expired)
    scored = [(verified_tokens(c.handle, prompt), i, c) for i, c in enumerate(live)]
    verified, _, best = max(scored, key=lambda s: (s[0], -s[1]))
    handle = best.handle
    cause: Cause | None = None
    if verified < handle.num_tokens:
        cause = "rewrite" if handle.epoch != epoch else "drift"
    k = verified // handle.block_size
    attached = k * handle.block_size if verified < handle.num_tokens else verified
    if attached >= max(threshold, 1):
        params = _as_params(handle.params).for_reading()
        if verified < handle.num_tokens:
            params = params.trimmed(k, handle.block_size)
        return ReusePlan("pull", params, attached, verified, False, best, cause, expired)
    release = _as_params(handle.params).for_reading().release_only()
    if verified >= handle.num_tokens:
        # All of it is a prefix of this prompt, but too little to read: this turn's own handle
        # will hold all of it again, so free D's blocks now
        return ReusePlan("recompute", release, 0, verified, True, best, None, expired)
    if handle.epoch < epoch:
        # The client rewrote history past this handle and too little of it survives: free D's
        # blocks now (a branch that is not this client's would verify more than this)
        return ReusePlan("stale", release, 0, verified, True, best, "rewrite", expired)
    # Nothing here verifies enough: a new branch, or drift. The handles stay for their branches
    # and are released when they are displaced.
    return ReusePlan("stale", None, 0, verified, False, None, cause, expired)


def _as_params(raw: dict[str, object]) -> KVTransferParams:
    return KVTransferParams.model_validate(raw)
