"""A profile's tables besides ``[router]`` (that one is :mod:`agentkv.serve.profile_router`):
``[sim]``, ``[nixl]``, ``[prefill]`` / ``[decode]`` (with ``[decode.offload]``), ``[hardware]``
and ``[k8s]``. Each validates its own keys; what must agree across tables is
:class:`~agentkv.serve.profile_model.Profile`'s to check."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "DecodeGroup",
    "Group",
    "Hardware",
    "K8sSettings",
    "NixlSettings",
    "OffloadSettings",
    "PrefillGroup",
    "SimSettings",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SimSettings(_Model):
    """``[sim]``: settings of ``agentkv sim`` engines (``engine = "sim"`` only)."""

    preset: str = "laptop"
    """Cost model preset (``agentkv.sim.costmodel.PRESETS``): ``zero``, ``laptop``,
    ``qwen3-32b-p5en``, ``glm-5-fp8-p5en``."""
    time_scale: float = Field(1.0, ge=0.0)
    """Multiplies every simulated delay; 0 means none."""
    num_blocks: int | None = Field(None, ge=2)
    """KV blocks per engine (the simulator's default when unset)."""
    tokenizer: str | None = None
    """A ``tokenizer.json`` (or its folder) for the simulator; default: the Qwen3 vocabulary."""
    template: str | None = None
    """A Jinja chat template file for the simulator; default: the tokenizer's own, else Qwen3."""

    @model_validator(mode="after")
    def _check_preset(self) -> SimSettings:
        from agentkv.sim.costmodel import PRESETS

        if self.preset not in PRESETS:
            raise ValueError(
                f"sim.preset {self.preset!r} is not a cost model preset "
                f"(choose from {', '.join(sorted(PRESETS))})"
            )
        return self


class NixlSettings(_Model):
    """``[nixl]``: the NIXL connector (``engine = "vllm"`` only)."""

    backends: list[str] = Field(default_factory=lambda: ["UCX"], min_length=1)
    """NIXL transport plugins (``kv_connector_extra_config.backends``), e.g. ``["LIBFABRIC"]``
    for AWS EFA (then also set ``FI_PROVIDER = "efa"`` in ``env``)."""
    kv_lease_duration_s: int | None = Field(None, ge=1)
    """Seconds P keeps a finished prefill's blocks for D's read (``kv_lease_duration``; vLLM's
    default, 30, when unset)."""


class OffloadSettings(_Model):
    """``[decode.offload]``: also keep D's KV in CPU memory (vLLM's ``OffloadingConnector``,
    combined with NIXL through ``MultiConnector``). CUDA engines only."""

    cpu_gib: float = Field(gt=0)
    """CPU memory for offloaded KV, GiB, all workers of one instance together
    (``cpu_bytes_to_use``)."""
    offload_prompt_only: bool = False
    """vLLM's default is true (only prompt blocks). False also offloads the generated tokens'
    KV, which is what the next turn of a conversation reuses."""
    block_size: int | None = Field(None, ge=1)
    """Tokens per offloaded block (a multiple of ``block_size``); vLLM's default when unset."""
    eviction_policy: Literal["lru", "arc"] | None = None
    """vLLM's default (``lru``) when unset."""


class Group(_Model):
    """``[prefill]`` / ``[decode]``: the instances of one role, all alike."""

    count: int = Field(1, ge=1)
    """Number of instances."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs per instance (``--tensor-parallel-size``); each instance gets its own
    ``CUDA_VISIBLE_DEVICES`` set, disjoint from the others on its node."""
    base_port: int = Field(ge=1, le=65535)
    """HTTP port of instance 0; instance i listens on ``base_port + i``."""
    side_channel_base_port: int = Field(ge=1, le=65535)
    """NIXL handshake port of instance 0 (``VLLM_NIXL_SIDE_CHANNEL_PORT``); instance i uses
    ``side_channel_base_port + i``. Not used by simulator engines."""
    prefix_caching: bool = True
    """Local prefix caching (``--enable-prefix-caching`` / ``--no-enable-prefix-caching``)."""
    kv_load_failure_policy: Literal["fail", "recompute"] = "recompute"
    """A failed or declined KV read: ``recompute`` locally, or ``fail`` the request (HTTP 500)."""
    extra_args: list[str] = Field(default_factory=list)
    """More engine flags for this role, after the profile's ``extra_args``."""
    env: dict[str, str] = Field(default_factory=dict)
    """More environment for this role, over the profile's ``env``."""


class PrefillGroup(Group):
    """``[prefill]``: the prefill (``kv_producer``) instances."""

    base_port: int = Field(8100, ge=1, le=65535)
    side_channel_base_port: int = Field(5600, ge=1, le=65535)
    kv_events_base_port: int | None = Field(None, ge=1, le=65535)
    """ZMQ port of instance 0's KV cache events (instance i: ``+ i``): each P gets vLLM's
    ``--kv-events-config`` with endpoint ``tcp://HOST:PORT`` and topic ``kv`` (a non-wildcard
    endpoint: the engine connects, the router binds it), so the router knows what P holds in
    its own prefix cache. Unset: no events."""


class DecodeGroup(Group):
    """``[decode]``: the decode (``kv_consumer``) instances."""

    base_port: int = Field(8200, ge=1, le=65535)
    side_channel_base_port: int = Field(5700, ge=1, le=65535)
    offload: OffloadSettings | None = None
    """CPU offload of D's KV (``[decode.offload]``); off when absent."""
    kv_events_base_port: int | None = Field(None, ge=1, le=65535)
    """ZMQ port of instance 0's KV cache events (instance i: ``+ i``), as
    ``prefill.kv_events_base_port``. With ``[decode.offload]`` the OffloadingConnector publishes
    its CPU tier's stores and evictions there (``self_describing_kv_events``), so the router
    knows what each D's CPU tier holds and can send a turn whose handle is gone to that D (path
    ``cpu``, docs/paths.md). Unset: no events."""


class Hardware(_Model):
    """``[hardware]``: what the GPU machines look like."""

    gpus_per_node: int = Field(8, ge=1)
    """GPUs per machine. Instances are packed onto nodes in start order; an instance never spans
    two nodes. A profile that needs more than one node cannot run under ``agentkv serve`` (one
    machine) and is meant for ``agentkv profiles render --format k8s``."""


class K8sSettings(_Model):
    """``[k8s]``: Kubernetes rendering only."""

    vllm_image: str = "vllm/vllm-openai:v0.33.0"
    """Image of vLLM engines (the command is set explicitly, whatever its entrypoint)."""
    agentkv_image: str = "agentkv:0.1.0"
    """Image with ``vllm-agentkv[serve,redis]`` installed (router, simulator engines); build it from
    this repository."""
    redis_image: str = "redis:7.4-alpine"
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels engine pods must run on, e.g. an instance type."""
    resources: dict[str, int | str] = Field(default_factory=dict)
    """More resource limits per engine pod, e.g. ``{"vpc.amazonaws.com/efa" = 16}``."""
    shm_size: str = "16Gi"
    """Size of the in-memory ``/dev/shm`` of engine pods (tensor parallelism needs it)."""
    hf_token_secret: str | None = None
    """A Secret with a ``token`` key, passed to engines as ``HF_TOKEN`` (gated models)."""
