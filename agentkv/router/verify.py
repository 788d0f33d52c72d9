"""Verified reuse: what D holds, compared block by block with the new prompt.

After a turn the router records, with D's handle, the chained hashes of the full blocks D holds
(the prompt + the generated ids, ``remote_num_tokens`` of them) and the few tokens after the
last full block. On the next turn it hashes the new prompt the same way; the handle is valid
for the longest run of equal blocks, and for all of it only when the tail tokens agree too.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from agentkv.router.store import StoredHandle

__all__ = ["Plan", "chain_hashes", "held_record", "plan_reuse", "verified_tokens"]

Decision = Literal["pull", "recompute", "miss", "stale", "expired", "local"]


def chain_hashes(ids: Sequence[int], block_size: int) -> list[str]:
    """Hex chained hashes of every full block of ``ids``."""
    out: list[str] = []
    parent = b""
    for start in range(0, len(ids) - block_size + 1, block_size):
        block = array("q", ids[start : start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=12).digest()
        out.append(parent.hex())
    return out


def held_record(
    held: Sequence[int], num_tokens: int, block_size: int
) -> tuple[list[str], list[int]]:
    """(block hashes, tail tokens) of the first ``num_tokens`` of ``held``."""
    held = held[:num_tokens]
    full = len(held) // block_size * block_size
    return chain_hashes(held[:full], block_size), list(held[full:])


def verified_tokens(handle: StoredHandle, prompt: Sequence[int]) -> int:
    """How many leading tokens of ``prompt`` the handle's blocks hold exactly."""
    bs = handle.block_size
    mine = chain_hashes(prompt[: len(handle.block_hashes) * bs], bs)
    k = 0
    for a, b in zip(mine, handle.block_hashes, strict=False):
        if a != b:
            break
        k += 1
    if k < len(handle.block_hashes):
        return k * bs
    tail = list(prompt[k * bs : k * bs + len(handle.tail_tokens)])
    if tail == handle.tail_tokens:
        return min(handle.num_tokens, k * bs + len(tail))
    return k * bs


@dataclass(frozen=True)
class Plan:
    """What to attach to P's request for one turn."""

    decision: Decision
    params: dict[str, Any] | None
    """The handle to send P (None: send no handle)."""
    reused_tokens: int
    """Tokens P may read from D (``remote_num_tokens`` attached)."""
    verified_tokens: int
    release: bool
    """True when ``params`` only releases D's blocks (``remote_num_tokens: 0``)."""


def plan_reuse(
    handle: StoredHandle | None,
    age_s: float,
    prompt: Sequence[int],
    *,
    epoch: int,
    router_ttl_s: float,
    threshold: int,
    can_pull: bool,
    verify: bool = True,
) -> Plan:
    """The reuse decision for one turn (DESIGN.md, "Verified reuse"); ``verify=False`` is vLLM's
    example proxy (attach whatever the conversation has)."""
    if handle is None:
        return Plan("miss", None, 0, 0, False)
    if age_s >= router_ttl_s:
        # Too close to D's TTL: an expired read hangs real vLLM 0.32; D reaps the blocks itself.
        return Plan("expired", None, 0, 0, False)
    if not can_pull:
        return Plan("local", None, 0, 0, False)
    release = dict(
        handle.params, do_remote_decode=True, do_remote_prefill=False, remote_num_tokens=0
    )
    if not verify:
        params = dict(handle.params, do_remote_decode=True, do_remote_prefill=False)
        return Plan("pull", params, handle.num_tokens, 0, False)
    if handle.epoch != epoch:
        return Plan("stale", release, 0, 0, True)
    verified = verified_tokens(handle, prompt)
    if verified < max(threshold, 1):
        return Plan(
            "stale" if verified < handle.num_tokens else "recompute", release, 0, verified, True
        )
    params = dict(handle.params, do_remote_decode=True, do_remote_prefill=False)
    if verified < handle.num_tokens:
        k = verified // handle.block_size
        params["remote_block_ids"] = [
            list(g)[:k] for g in handle.params.get("remote_block_ids") or []
        ]
        params["remote_num_tokens"] = k * handle.block_size
        verified = k * handle.block_size
    if verified < max(threshold, 1):
        return Plan("stale", release, 0, verified, True)
    return Plan("pull", params, int(params["remote_num_tokens"]), verified, False)
