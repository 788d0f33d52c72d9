"""A profile, expanded into the exact command line and environment of every process.

:func:`expand` is pure: the same profile and host always give the same :class:`Deployment`, and
nothing on the machine is read. The router's configuration is produced here too, from the same
values the engines get, and validated as :class:`agentkv.router.config.RouterConfig`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from agentkv.serve.profile_model import Profile
from agentkv.serve.profiles import ProfileError

__all__ = [
    "CONFIG_DIR",
    "ROUTER_CONFIG_FILE",
    "Deployment",
    "Instance",
    "ProcessSpec",
    "engine_argv",
    "engine_env",
    "expand",
    "instances",
    "kv_transfer_config",
    "nodes_needed",
    "router_config",
    "router_env",
]

CONFIG_DIR = "{config_dir}"
"""Placeholder in argv for the folder where the supervisor writes ``config_file``s."""
ROUTER_CONFIG_FILE = "router.json"

EngineRole = Literal["prefill", "decode"]


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start: its exact argv and the environment the profile sets."""

    name: str
    """``prefill-0``, ``decode-1``, ``router``."""
    role: Literal["prefill", "decode", "router"]
    argv: list[str]
    env: dict[str, str]
    """Only the variables the profile sets (the supervisor merges them over ``os.environ``)."""
    port: int
    health_url: str
    config_file: tuple[str, str] | None = None
    """``(file name, contents)`` to write before start; argv names it as
    ``{config_dir}/<file name>``."""


@dataclass(frozen=True)
class Deployment:
    """A profile expanded for one host."""

    profile: Profile
    processes: list[ProcessSpec]
    """Start order: prefill instances, decode instances, the router last."""
    router_config: dict[str, Any]
    """Validates as ``agentkv.router.RouterConfig``."""

    @property
    def base_url(self) -> str:
        """The router's OpenAI base URL, e.g. ``http://127.0.0.1:8000/v1``."""
        router = next(p for p in self.processes if p.role == "router")
        return router.health_url.removesuffix("/health") + "/v1"


@dataclass(frozen=True)
class Instance:
    """Where one engine instance runs."""

    role: EngineRole
    index: int
    port: int
    side_channel_port: int
    node: int
    """Index of the node it is packed on (``hardware.gpus_per_node`` GPUs each)."""
    gpus: tuple[int, ...]
    """GPU indices on its node (empty without GPUs)."""

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


def instances(profile: Profile) -> list[Instance]:
    """Every engine instance in start order, packed onto nodes: an instance takes the next
    ``tensor_parallel_size`` GPUs of the current node, or starts a new node when they do not fit."""
    out: list[Instance] = []
    node, used = 0, 0
    for role in ("prefill", "decode"):
        group = profile.group(role)
        for i in range(group.count):
            gpus: tuple[int, ...] = ()
            if profile.uses_gpus:
                tp = group.tensor_parallel_size
                if used + tp > profile.hardware.gpus_per_node:
                    node, used = node + 1, 0
                gpus = tuple(range(used, used + tp))
                used += tp
            out.append(
                Instance(
                    role=role,
                    index=i,
                    port=group.base_port + i,
                    side_channel_port=group.side_channel_base_port + i,
                    node=node,
                    gpus=gpus,
                )
            )
    return out


def nodes_needed(profile: Profile) -> int:
    """Machines the profile's GPU instances are packed onto (1 without GPUs)."""
    return max(i.node for i in instances(profile)) + 1


def _connect_host(host: str) -> str:
    """The address to reach a process listening on ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _url(host: str, port: int) -> str:
    host = _connect_host(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def kv_transfer_config(profile: Profile, role: EngineRole) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for one role (``KVTransferConfig``, vLLM 0.33)."""
    group = profile.group(role)
    extra: dict[str, Any] = {}
    if profile.nixl.backends != ["UCX"]:
        extra["backends"] = list(profile.nixl.backends)
    extra["bidirectional_kv_xfer"] = profile.bidirectional
    if role == "prefill":
        extra["kv_recompute_threshold"] = profile.kv_recompute_threshold
    extra["decoder_kv_blocks_ttl"] = profile.decoder_kv_blocks_ttl_s
    if profile.nixl.kv_lease_duration_s is not None:
        extra["kv_lease_duration"] = profile.nixl.kv_lease_duration_s
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    nixl: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": kv_role,
        "kv_buffer_device": profile.device,
    }
    offload = profile.decode.offload if role == "decode" else None
    if offload is None:
        nixl["kv_load_failure_policy"] = group.kv_load_failure_policy
        nixl["kv_connector_extra_config"] = extra
        return nixl
    nixl["kv_connector_extra_config"] = extra
    offload_extra: dict[str, Any] = {
        "cpu_bytes_to_use": int(offload.cpu_gib * 2**30),
        "offload_prompt_only": offload.offload_prompt_only,
    }
    if offload.block_size is not None:
        offload_extra["block_size"] = offload.block_size
    if offload.eviction_policy is not None:
        offload_extra["eviction_policy"] = offload.eviction_policy
    if profile.decode.kv_events_base_port is not None:
        # the CPU tier's events with their tokens, so the router can match them to prompts
        # (vLLM 0.33: v1/kv_offload/base.py lines 719-722; off, a placeholder without tokens)
        offload_extra["self_describing_kv_events"] = True
    return {
        "kv_connector": "MultiConnector",
        "kv_role": kv_role,
        "kv_buffer_device": profile.device,
        # The scheduler reads the policy from the top-level config, not from the children.
        "kv_load_failure_policy": group.kv_load_failure_policy,
        "kv_connector_extra_config": {
            "connectors": [
                nixl,
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": offload_extra,
                },
            ]
        },
    }


def kv_events_config(profile: Profile, inst: Instance, host: str) -> dict[str, Any] | None:
    """vLLM's ``--kv-events-config`` for one instance (``KVEventsConfig``, vLLM 0.33), or None:
    when its role's ``kv_events_base_port`` is set (a P's prefix cache; a D's CPU tier).

    Engines on one host (``127.0.0.1``): ``tcp://HOST:PORT``, not a wildcard, so the engine
    connects and the router binds it (vLLM cannot bind a single interface: it binds only
    wildcard endpoints). Engines on every interface (``0.0.0.0``, as in Kubernetes):
    ``tcp://*:PORT``, so the engine binds and the router connects to the engine's host."""
    group = profile.prefill if inst.role == "prefill" else profile.decode
    base = group.kv_events_base_port
    if base is None:
        return None
    port = base + inst.index
    if host in ("0.0.0.0", "", "::"):
        endpoint = f"tcp://*:{port}"
    else:
        endpoint = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}


def _kv_events_argv(profile: Profile, inst: Instance, host: str) -> list[str]:
    config = kv_events_config(profile, inst, host)
    if config is None:
        return []
    return ["--kv-events-config", json.dumps(config, separators=(",", ":"))]


def _vllm_argv(profile: Profile, inst: Instance, host: str) -> list[str]:
    group = profile.group(inst.role)
    argv = [
        *profile.vllm_command,
        profile.model,
        "--served-model-name",
        profile.served_model_name,
        "--host",
        host,
        "--port",
        str(inst.port),
        "--tensor-parallel-size",
        str(group.tensor_parallel_size),
        "--block-size",
        str(profile.block_size),
        "--enable-prefix-caching" if group.prefix_caching else "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]
    if profile.dtype is not None:
        argv += ["--dtype", profile.dtype]
    if profile.max_model_len is not None:
        argv += ["--max-model-len", str(profile.max_model_len)]
    config = kv_transfer_config(profile, inst.role)
    argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    argv += _kv_events_argv(profile, inst, host)
    if profile.otlp_traces_endpoint is not None:
        argv += ["--otlp-traces-endpoint", profile.otlp_traces_endpoint]
    return argv + profile.extra_args + group.extra_args


def _sim_argv(profile: Profile, inst: Instance, host: str, launcher: list[str]) -> list[str]:
    group = profile.group(inst.role)
    sim = profile.sim_settings
    argv = [
        *launcher,
        "sim",
        "--role",
        inst.role,
        "--host",
        host,
        "--port",
        str(inst.port),
        "--served-model-name",
        profile.served_model_name,
        "--block-size",
        str(profile.block_size),
        "--decoder-kv-blocks-ttl",
        str(profile.decoder_kv_blocks_ttl_s),
        "--kv-recompute-threshold",
        str(profile.kv_recompute_threshold),
        "--kv-load-failure-policy",
        group.kv_load_failure_policy,
        "--preset",
        sim.preset,
        "--time-scale",
        f"{sim.time_scale:g}",
    ]
    if profile.nixl.kv_lease_duration_s is not None:
        argv += ["--kv-lease-duration", str(profile.nixl.kv_lease_duration_s)]
    if profile.max_model_len is not None:
        argv += ["--max-model-len", str(profile.max_model_len)]
    if sim.num_blocks is not None:
        argv += ["--num-blocks", str(sim.num_blocks)]
    if sim.tokenizer is not None:
        argv += ["--tokenizer", sim.tokenizer]
    if sim.template is not None:
        argv += ["--template", sim.template]
    if not group.prefix_caching:
        argv.append("--no-prefix-caching")
    if not profile.bidirectional:
        argv.append("--no-bidirectional")
    if profile.compat != "0.33":
        argv += ["--compat", profile.compat]
    argv += _kv_events_argv(profile, inst, host)
    return argv + profile.extra_args + group.extra_args


def engine_argv(
    profile: Profile, inst: Instance, host: str, *, launcher: list[str] | None = None
) -> list[str]:
    """One engine's argv. ``launcher`` replaces ``python -m agentkv`` for simulator engines."""
    if profile.engine == "vllm":
        return _vllm_argv(profile, inst, host)
    return _sim_argv(profile, inst, host, launcher or [sys.executable, "-m", "agentkv"])


def engine_env(profile: Profile, inst: Instance, host: str | None) -> dict[str, str]:
    """One engine's environment. ``host=None`` leaves out ``VLLM_NIXL_SIDE_CHANNEL_HOST`` (set
    otherwise, e.g. from the pod IP on Kubernetes); GPUs are only assigned when ``host`` is set
    (on Kubernetes the device plugin does it)."""
    env = {**profile.env, **profile.group(inst.role).env}
    if profile.engine != "vllm":
        return env
    env["PYTHONHASHSEED"] = "0"
    if profile.otlp_traces_endpoint is not None:
        env.setdefault("OTEL_SERVICE_NAME", f"vllm-{inst.name}")
    if host is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = _connect_host(host)
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(inst.side_channel_port)
    if profile.uses_gpus and host is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in inst.gpus)
    return env


def router_env(profile: Profile) -> dict[str, str]:
    """The router's environment: the profile's ``router.env``, over the OpenTelemetry
    variables of ``otlp_traces_endpoint`` when it is set."""
    env: dict[str, str] = {}
    if profile.otlp_traces_endpoint is not None:
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = profile.otlp_traces_endpoint
        env["OTEL_SERVICE_NAME"] = "agentkv-router"
    return {**env, **profile.router.env}


def router_config(
    profile: Profile,
    *,
    host: str,
    prefill_urls: list[str],
    decode_urls: list[str],
    store: str | None = None,
    prefill_kv_events: Sequence[dict[str, Any] | None] = (),
    decode_kv_events: Sequence[dict[str, Any] | None] = (),
) -> dict[str, Any]:
    """The router's configuration, from the values the engines get; validated.
    ``prefill_kv_events[i]``: prefill instance i's ``--kv-events-config``, if it has one;
    ``decode_kv_events[i]`` the same for decode instance i."""
    prefill: list[dict[str, Any]] = []
    for i, url in enumerate(prefill_urls):
        backend: dict[str, Any] = {"url": url, "bidirectional": profile.bidirectional}
        events = prefill_kv_events[i] if i < len(prefill_kv_events) else None
        if events is not None:
            backend["kv_events"] = events
        prefill.append(backend)
    decode: list[dict[str, Any]] = []
    for i, url in enumerate(decode_urls):
        backend = {
            "url": url,
            "bidirectional": profile.bidirectional,
            "handle_on_stream": profile.compat != "0.32",
        }
        events = decode_kv_events[i] if i < len(decode_kv_events) else None
        if events is not None:
            backend["kv_events"] = events
        decode.append(backend)
    from agentkv.router.config import RouterConfig

    router = profile.router
    given = router.model_dump(exclude_unset=True, exclude={"replicas", "env"})
    owned: dict[
        str, dict[str, Any]
    ] = {  # what the engines get too (ROUTER_OWNED), and the keys every deployment shows
        "upstream": {
            "prefill": prefill,
            "decode": decode,
            "block_size": profile.block_size,
            "kv_recompute_threshold": profile.kv_recompute_threshold,
        },
        "retention": {
            "decoder_kv_blocks_ttl_s": profile.decoder_kv_blocks_ttl_s,
            "ttl_margin_s": router.retention.ttl_margin_s,
        },
        "http": {"host": host, "port": router.http.port},
        "store": {"backend": store if store is not None else router.store.backend},
    }
    config: dict[str, Any] = {}
    for group in RouterConfig.model_fields:  # the model's order; the profile's values first
        values = owned.get(group, {})
        values = {**values, **{k: v for k, v in given.get(group, {}).items() if k not in values}}
        if values:
            config[group] = values
    from agentkv.serve.profiles import format_validation_error

    try:
        RouterConfig.model_validate(config)
    except ValidationError as exc:
        raise ProfileError(format_validation_error(exc, profile.name)) from None
    return config


def expand(profile: Profile, *, host: str = "127.0.0.1") -> Deployment:
    """Every process of ``profile`` on ``host``: prefill, decode, then the router. Pure."""
    specs: list[ProcessSpec] = []
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    events: dict[str, list[dict[str, Any] | None]] = {"prefill": [], "decode": []}
    for inst in instances(profile):
        url = _url(host, inst.port)
        urls[inst.role].append(url)
        events[inst.role].append(kv_events_config(profile, inst, host))
        specs.append(
            ProcessSpec(
                name=inst.name,
                role=inst.role,
                argv=engine_argv(profile, inst, host),
                env=engine_env(profile, inst, host),
                port=inst.port,
                health_url=f"{url}/health",
            )
        )
    config = router_config(
        profile,
        host=host,
        prefill_urls=urls["prefill"],
        decode_urls=urls["decode"],
        prefill_kv_events=events["prefill"],
        decode_kv_events=events["decode"],
    )
    specs.append(
        ProcessSpec(
            name="router",
            role="router",
            argv=[
                sys.executable,
                "-m",
                "agentkv",
                "router",
                "--config",
                f"{CONFIG_DIR}/{ROUTER_CONFIG_FILE}",
                # Also as flags: `agentkv router` lets its --host/--port defaults override the file.
                "--host",
                host,
                "--port",
                str(profile.router.http.port),
            ],
            env=router_env(profile),
            port=profile.router.http.port,
            health_url=f"{_url(host, profile.router.http.port)}/health",
            config_file=(ROUTER_CONFIG_FILE, json.dumps(config, indent=2) + "\n"),
        )
    )
    return Deployment(profile=profile, processes=specs, router_config=config)
