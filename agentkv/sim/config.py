"""The simulator's configuration: one engine instance, as ``agentkv sim`` flags describe it."""

from __future__ import annotations

import random
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentkv.protocol.kv_events import KVEventsConfig

__all__ = ["Compat", "Role", "SimConfig"]

Role = Literal["prefill", "decode", "both"]
Compat = Literal["0.33", "0.32"]


class SimConfig(BaseModel):
    """Everything one simulated vLLM instance needs. Durations are seconds (``*_s``/``ttl``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    role: Role = "both"
    """``prefill`` = vLLM ``kv_producer``, ``decode`` = ``kv_consumer``, ``both`` = plain server.
    The connector acts on each request's ``kv_transfer_params`` as vLLM's does; the role only
    names the instance (metrics, ``/v1/models``)."""
    served_model_name: str = "agentkv-sim"
    host: str = "127.0.0.1"
    port: int = 8100
    """The engines' first port in the profiles; the router's default is 8000."""
    template: str | None = None
    """Path to a Jinja chat template; default: the tokenizer's own, else a Qwen3 template."""
    tokenizer: str | None = None
    """Path to a ``tokenizer.json`` (or its directory); default: the real Qwen3 vocabulary."""
    block_size: int = Field(16, ge=1)
    num_blocks: int = Field(16384, ge=2)
    max_model_len: int = Field(131072, ge=16)
    preset: str = "laptop"
    """Cost model preset (``agentkv.sim.costmodel.PRESETS``)."""
    costs: str | None = None
    """A cost file (JSON or TOML of :class:`~agentkv.sim.costmodel.CostModel` fields, e.g. from
    ``agentkv calibrate``); replaces ``preset``."""
    time_scale: float = Field(1.0, ge=0.0)
    """Multiplies every simulated delay; 0 means none."""
    decoder_kv_blocks_ttl: float = Field(480.0, gt=0)
    kv_lease_duration: float = Field(30.0, gt=0)
    kv_recompute_threshold: int = Field(64, ge=0)
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    bidirectional_kv_xfer: bool = True
    prefix_caching: bool = True
    prompt_tokens_details: bool = True
    compat: Compat = "0.33"
    """``0.32`` reproduces the rough edges measured on real vLLM 0.32 (see docs/simulator.md)."""
    engine_id: str = Field(default_factory=lambda: str(uuid.uuid4()))
    side_channel_host: str = "localhost"
    """What the handle's ``remote_host`` says (vLLM: ``VLLM_NIXL_SIDE_CHANNEL_HOST``)."""
    side_channel_port: int | None = None
    """What the handle's ``remote_port`` says; default: this instance's HTTP port (the simulator
    serves its transfer endpoints there)."""
    clock_offset_s: float = Field(default_factory=lambda: random.uniform(1_000.0, 100_000.0))
    """Origin of this instance's private ``perf_counter`` clock (handles' expiry times use it)."""
    seed: int = 0
    tool_format: Literal["auto", "hermes", "qwen3_coder", "none"] = "auto"
    reasoning_parser: bool = True
    prompt_scripts: bool = False
    """Read a script (``agentkv_sim``'s value) from the prompt when the body has none: the JSON
    after ``agentkv_sim:`` in the last user message that has it, one script or a list of them
    (the n-th for the n-th answer after that message). For clients that send no extra body
    field, such as Claude Code (:func:`agentkv.sim.answer_text.prompt_script`)."""
    max_output_tokens_default: int = Field(48, ge=1)
    """Upper bound of a generated answer's natural length when the request sets no limit."""
    max_num_batched_tokens: int = Field(8192, ge=1)
    """vLLM's per-step token budget: a prefill shares each step with the running decodes in
    chunks of at most this many tokens (8,192: vLLM 0.33's OpenAI-server default on an H100/H200),
    so that is the most prefill tokens that slow one decode step."""
    cpu_offload_blocks: int = Field(0, ge=0)
    """Blocks of this instance's CPU tier (vLLM's ``OffloadingConnector``, ``cpu_bytes_to_use`` /
    bytes per block); 0: no tier. Computed full blocks are saved there (best effort, LRU), and a
    request loads the blocks that follow its GPU prefix-cache hit from it."""
    cpu_save_failure_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Share of block saves to the CPU tier that fail (are skipped), as vLLM's best-effort
    ``prepare_store`` does when it cannot evict."""
    kv_events_config: KVEventsConfig | None = None
    """vLLM's ``--kv-events-config``: publish BlockStored / BlockRemoved / AllBlocksCleared over
    ZMQ as vLLM 0.33 does (:mod:`agentkv.sim.kv_events`); off when unset or not enabled."""

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        if self.max_model_len < self.block_size:
            raise ValueError("max_model_len must be at least one block")
        return self

    @property
    def advertised_port(self) -> int:
        return self.side_channel_port if self.side_channel_port is not None else self.port
