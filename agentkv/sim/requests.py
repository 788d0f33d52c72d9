"""What the engine takes and yields for one request: :class:`GenRequest` in, then
:class:`Scheduled`, each token id and :class:`Finished` out (:meth:`agentkv.sim.engine.Engine.run`);
:class:`Running`: the blocks a request holds while it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentkv.sim.blocks import Block

__all__ = ["Finished", "GenRequest", "Running", "Scheduled"]


@dataclass
class GenRequest:
    """What the engine needs to run one request (the HTTP layer builds it)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    """The tokens this request will emit if nothing stops it earlier (decided by the caller)."""
    stop_ids: frozenset[int] = frozenset()
    """Token ids that end generation with ``stop`` (the end-of-turn token)."""
    max_tokens: int | None = None
    kv_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    streaming: bool = False


@dataclass
class Scheduled:
    """What the prefill step decided; known before the first token is sent."""

    num_prompt_tokens: int
    local_hit_tokens: int
    external_tokens: int
    computed_tokens: int
    wrong_kv_tokens: int
    model_ttft_s: float
    decision: str
    """``none`` | ``pull`` | ``notify`` | ``threshold`` | ``expired`` | ``failed``."""
    cpu_tokens: int = 0
    """Loaded from this instance's CPU tier (after the GPU hit)."""

    @property
    def cached_tokens(self) -> int:
        """vLLM's ``num_cached_tokens``: local hit + external (a connector's: NIXL or the CPU
        tier)."""
        return self.local_hit_tokens + self.external_tokens + self.cpu_tokens


@dataclass
class Finished:
    """The end of a request."""

    finish_reason: str
    output_ids: list[int]
    kv_transfer_params: dict[str, Any] | None


@dataclass
class Running:
    blocks: list[Block] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)
