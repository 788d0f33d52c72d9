"""How long the simulated engine takes: prefill, KV transfer and decode, in seconds.

A :class:`CostModel` holds a handful of constants; the engine asks it for the duration of each
step and applies its own time scale.

* ``prefill_s(new, ctx)``: compute ``new`` prompt tokens when ``ctx`` tokens are already in the
  KV cache. Token ``i`` of the new ones (0-based) attends over ``ctx + i + 1`` tokens, so the
  attention term is ``prefill_s_per_token_ctx * (new * ctx + new * (new + 1) / 2)``.
* ``transfer_s(tokens)``: move the KV of ``tokens`` tokens between instances: a fixed cost plus
  a cost per block of ``block_size`` tokens (whole blocks; another block size is converted by
  tokens). Nothing to move costs nothing.
* ``decode_s(n, ctx)``: generate ``n`` tokens after ``ctx`` tokens; step ``j`` (0-based)
  attends over ``ctx + j`` tokens.

Calibration: the ``qwen3-32b-p5en`` and ``glm-5-fp8-p5en`` presets reproduce the 1P1D
measurements on AWS P5en published in vLLM's bidirectional-KV blog post, read as P/D turns
(:meth:`CostModel.ttft_s`):

``ttft_s(prompt, reused)`` = ``overhead_s``
    + P's prefill of the ``prompt - reused`` new tokens over ``reused`` tokens of context
    + the D→P transfer of the ``reused`` tokens (only when ``reused > 0``)
    + the P→D transfer of the whole prompt
    + D's first decode step over the prompt.

* "recompute at N tokens": ``ttft_s(N, 0)``, the whole prompt prefilled on P.
* "reuse at N tokens": ``ttft_s(N, reused_tokens_for(N))``: the new turn adds the last
  :data:`REUSE_NEW_FRACTION` (10 %) of the prompt and the rest is pulled back from D.
* "KV transfer at N tokens": ``transfer_s(N)``.
* "2k", "20k", "24k" mean 2,048, 20,480 and 24,576 tokens.

:data:`PUBLISHED_POINTS` lists every published number; the constants come from a small
least-squares fit run once offline (then rounded), and each point is within 10 % of the table:

===============  ====================  =========  ===========  =======
preset           measurement           published  model        error
===============  ====================  =========  ===========  =======
qwen3-32b-p5en   TTFT recompute 2k     158 ms     148.3 ms     -6.1 %
qwen3-32b-p5en   TTFT recompute 24k    778 ms     850.5 ms     +9.3 %
qwen3-32b-p5en   TTFT reuse 2k         122 ms     132.7 ms     +8.8 %
qwen3-32b-p5en   TTFT reuse 24k        460 ms     419.9 ms     -8.7 %
qwen3-32b-p5en   KV transfer 2k        29 ms      26.5 ms      -8.6 %
qwen3-32b-p5en   KV transfer 24k       130 ms     142.0 ms     +9.2 %
glm-5-fp8-p5en   TTFT recompute 2k     500 ms     501.1 ms     +0.2 %
glm-5-fp8-p5en   TTFT recompute 20k    2,334 ms   2,343.0 ms   +0.4 %
glm-5-fp8-p5en   TTFT reuse 2k         358 ms     359.0 ms     +0.3 %
glm-5-fp8-p5en   TTFT reuse 20k        702 ms     698.9 ms     -0.4 %
===============  ====================  =========  ===========  =======

The blog gives one KV-transfer range (29–130 ms over 2k–24k); the GLM preset is fitted to it
too (28.9 ms at 2k, 130.3 ms at 24k). Decode speeds are not in the post: ``decode_s_per_token``
(15 ms for Qwen3-32B, 28 ms for GLM-5) is an assumption that only shifts ``overhead_s``, and
``decode_s_per_token_ctx`` (5e-8 s per token of context) is sized from the KV bytes a decode
step reads.

Two more terms are not in the post either (docs/paths.md):

* ``decode_slowdown_s_per_prefill_token``: a decode step that shares the GPU with a prefill chunk
  of ``k`` tokens (vLLM's chunked prefill, ``max_num_batched_tokens`` per step) is longer by about
  the chunk's compute; the presets set it to ``prefill_s_per_token``.
* ``cpu_load_s_per_token``: loading offloaded KV back from CPU memory, ``kv_bytes_per_token`` at
  50 GB/s (a PCIe Gen5 x16 host-to-device copy).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentkv._toml import tomllib

__all__ = [
    "PRESETS",
    "PUBLISHED_POINTS",
    "REUSE_NEW_FRACTION",
    "CostModel",
    "PublishedPoint",
    "load_cost_file",
    "published_value_s",
    "reused_tokens_for",
]

REUSE_NEW_FRACTION = 0.10
"""Share of the prompt that a new turn adds in the published "reuse" measurements."""


class CostModel(BaseModel):
    """Durations of the engine's steps, in seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    overhead_s: float = Field(default=0.0, ge=0.0)
    """Per request: HTTP, scheduling, proxy hops."""
    prefill_s_per_token: float = Field(default=0.0, ge=0.0)
    """Per new prompt token (the weights' share of prefill)."""
    prefill_s_per_token_ctx: float = Field(default=0.0, ge=0.0)
    """Per (new token, token it attends over) pair: attention's share of prefill."""
    transfer_s_base: float = Field(default=0.0, ge=0.0)
    """Fixed cost of one KV transfer (handshake, descriptor setup)."""
    transfer_s_per_block: float = Field(default=0.0, ge=0.0)
    """Per block of ``block_size`` tokens moved."""
    block_size: int = Field(default=16, ge=1)
    """The block size ``transfer_s_per_block`` is stated at."""
    decode_s_per_token: float = Field(default=0.0, ge=0.0)
    """Per generated token (one decode step)."""
    decode_s_per_token_ctx: float = Field(default=0.0, ge=0.0)
    """Per generated token, per token of context it attends over."""
    kv_bytes_per_token: int = Field(default=0, ge=0)
    """KV-cache bytes one token takes (all layers); only sizes what transfers report."""
    decode_slowdown_s_per_prefill_token: float = Field(default=0.0, ge=0.0)
    """Added to each decode step of the instance's running requests per prompt token being
    prefilled in the same step (a chunk of at most ``max_num_batched_tokens``): the interference
    of a prefill on the instance's streams."""
    cpu_load_s_per_token: float = Field(default=0.0, ge=0.0)
    """Per token loaded from the instance's CPU tier (host to device copy)."""

    def interference_s(self, prefill_tokens_in_flight: int) -> float:
        """What one decode step gains while ``prefill_tokens_in_flight`` prompt tokens share it."""
        _check_counts(prefill_tokens_in_flight=prefill_tokens_in_flight)
        return self.decode_slowdown_s_per_prefill_token * prefill_tokens_in_flight

    def cpu_load_s(self, tokens: int) -> float:
        """Time to load the KV of ``tokens`` tokens from the CPU tier."""
        _check_counts(tokens=tokens)
        return self.cpu_load_s_per_token * tokens

    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        """Time to compute ``new_tokens`` prompt tokens after ``context_tokens`` cached ones."""
        _check_counts(new_tokens=new_tokens, context_tokens=context_tokens)
        pairs = new_tokens * context_tokens + new_tokens * (new_tokens + 1) / 2
        return self.prefill_s_per_token * new_tokens + self.prefill_s_per_token_ctx * pairs

    def transfer_s(self, tokens: int, block_size: int | None = None) -> float:
        """Time to move the KV of ``tokens`` tokens in whole blocks of ``block_size`` tokens
        (default: the model's own); 0 for no tokens."""
        _check_counts(tokens=tokens)
        size = self.block_size if block_size is None else block_size
        if size < 1:
            raise ValueError(f"block_size must be at least 1, got {size}")
        if tokens == 0:
            return 0.0
        blocks = -(-tokens // size)
        return self.transfer_s_base + self.transfer_s_per_block * blocks * size / self.block_size

    def decode_s(self, num_tokens: int, context_tokens: int) -> float:
        """Time to generate ``num_tokens`` tokens when ``context_tokens`` precede the first."""
        _check_counts(num_tokens=num_tokens, context_tokens=context_tokens)
        pairs = num_tokens * context_tokens + num_tokens * (num_tokens - 1) / 2
        return self.decode_s_per_token * num_tokens + self.decode_s_per_token_ctx * pairs

    def ttft_s(self, prompt_tokens: int, reused_tokens: int) -> float:
        """Time to first token of one P/D turn (see the module docstring)."""
        _check_counts(prompt_tokens=prompt_tokens, reused_tokens=reused_tokens)
        if reused_tokens > prompt_tokens:
            raise ValueError(
                f"reused_tokens ({reused_tokens}) exceeds prompt_tokens ({prompt_tokens})"
            )
        return (
            self.overhead_s
            + self.prefill_s(prompt_tokens - reused_tokens, reused_tokens)
            + self.transfer_s(reused_tokens)
            + self.transfer_s(prompt_tokens)
            + self.decode_s(1, prompt_tokens)
        )


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if value < 0:
            raise ValueError(f"{name} must not be negative, got {value}")


def reused_tokens_for(prompt_tokens: int) -> int:
    """Tokens a published "reuse" measurement pulls from D: all but the new turn's 10 %."""
    _check_counts(prompt_tokens=prompt_tokens)
    return prompt_tokens - int(prompt_tokens * REUSE_NEW_FRACTION)


Measurement = Literal["ttft_recompute", "ttft_reuse", "kv_transfer"]


@dataclass(frozen=True)
class PublishedPoint:
    """One number from the blog post's 1P1D P5en measurements."""

    preset: str
    measurement: Measurement
    prompt_tokens: int
    seconds: float


def published_value_s(model: CostModel, point: PublishedPoint) -> float:
    """What ``model`` predicts for the scenario ``point`` measured."""
    n = point.prompt_tokens
    if point.measurement == "ttft_recompute":
        return model.ttft_s(n, 0)
    if point.measurement == "ttft_reuse":
        return model.ttft_s(n, reused_tokens_for(n))
    return model.transfer_s(n)


_K = 1024

PUBLISHED_POINTS: tuple[PublishedPoint, ...] = (
    PublishedPoint("qwen3-32b-p5en", "ttft_recompute", 2 * _K, 0.158),
    PublishedPoint("qwen3-32b-p5en", "ttft_recompute", 24 * _K, 0.778),
    PublishedPoint("qwen3-32b-p5en", "ttft_reuse", 2 * _K, 0.122),
    PublishedPoint("qwen3-32b-p5en", "ttft_reuse", 24 * _K, 0.460),
    PublishedPoint("qwen3-32b-p5en", "kv_transfer", 2 * _K, 0.029),
    PublishedPoint("qwen3-32b-p5en", "kv_transfer", 24 * _K, 0.130),
    PublishedPoint("glm-5-fp8-p5en", "ttft_recompute", 2 * _K, 0.500),
    PublishedPoint("glm-5-fp8-p5en", "ttft_recompute", 20 * _K, 2.334),
    PublishedPoint("glm-5-fp8-p5en", "ttft_reuse", 2 * _K, 0.358),
    PublishedPoint("glm-5-fp8-p5en", "ttft_reuse", 20 * _K, 0.702),
)

PRESETS: dict[str, CostModel] = {
    "zero": CostModel(),
    # Small but visible delays for demos on a laptop: 2k-token prefill ~0.1 s, 100 tokens/s.
    "laptop": CostModel(
        overhead_s=0.005,
        prefill_s_per_token=5e-5,
        prefill_s_per_token_ctx=1e-10,
        transfer_s_base=0.002,
        transfer_s_per_block=1e-4,
        decode_s_per_token=0.01,
        decode_s_per_token_ctx=1e-8,
        kv_bytes_per_token=114_688,  # a Qwen3-0.6B: 28 layers x 8 KV heads x 128 x K,V x bf16
        decode_slowdown_s_per_prefill_token=5e-5,
        cpu_load_s_per_token=2.3e-6,  # 114,688 B at 50 GB/s
    ),
    "qwen3-32b-p5en": CostModel(
        overhead_s=0.061,
        prefill_s_per_token=2.2e-5,
        prefill_s_per_token_ctx=3e-10,
        transfer_s_base=0.016,
        transfer_s_per_block=8.2e-5,
        decode_s_per_token=0.015,
        decode_s_per_token_ctx=5e-8,
        kv_bytes_per_token=262_144,  # 64 layers x 8 KV heads x 128 x K,V x bf16
        decode_slowdown_s_per_prefill_token=2.2e-5,
        cpu_load_s_per_token=5.2e-6,  # 262,144 B at 50 GB/s
    ),
    "glm-5-fp8-p5en": CostModel(
        overhead_s=0.255,
        prefill_s_per_token=9.2e-5,
        prefill_s_per_token_ctx=3e-10,
        transfer_s_base=0.0197,
        transfer_s_per_block=7.2e-5,
        decode_s_per_token=0.028,
        decode_s_per_token_ctx=5e-8,
        kv_bytes_per_token=89_856,  # MLA: 78 layers x (512 + 64) latent x bf16, no DSA indexer
        decode_slowdown_s_per_prefill_token=9.2e-5,
        cpu_load_s_per_token=1.8e-6,  # 89,856 B at 50 GB/s
    ),
}


def load_cost_file(path: str | Path) -> CostModel:
    """A :class:`CostModel` from a JSON or TOML file: its fields at the top level, or under
    ``cost_model`` (what ``agentkv calibrate`` writes, with its measurements beside it).

    Raises ``ValueError`` naming the file when it cannot be read or a field is wrong."""
    p = Path(path)
    try:
        text = p.read_text()
        data: Any = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read cost file {p}: {exc}") from exc
    if isinstance(data, dict) and isinstance(data.get("cost_model"), dict):
        data = data["cost_model"]
    try:
        return CostModel.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise ValueError(f"cost file {p}: {where}: {first['msg']}") from None
