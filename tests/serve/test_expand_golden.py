"""Every built-in profile expands to exactly the argv and environment in tests/serve/golden/, and
every vLLM flag, config key and environment variable it emits is a real vLLM 0.33.0 name.

Regenerate the golden files after an intended change with
``AGENTKV_UPDATE_GOLDEN=1 pytest tests/serve/test_expand_golden.py`` and review the diff.

The vLLM names and where each comes from are in tests/_support/vllm_names.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from agentkv.cli import app
from agentkv.router.config import RouterConfig
from agentkv.serve import Deployment, builtin_profiles, expand, load_profile
from tests._support.vllm_names import (
    EXTRA_CONFIG_KEYS,
    KV_EVENTS_KEYS,
    KV_TRANSFER_FIELDS,
    KV_VALUES,
    OTHER_ENV,
    VLLM_ENV,
    VLLM_FLAGS,
    VLLM_PARSERS,
)

GOLDEN = Path(__file__).parent / "golden"
PY = "{python}"

# `agentkv sim` and `agentkv router` flags are checked against the real CLI below.


# --- golden files ---------------------------------------------------------------------------


def _load(name: str) -> Deployment:
    # environ={}: placeholders stay as written (cpu-tiny's model directory).
    return expand(load_profile(name, environ={}))


def _normalize(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace(sys.executable, PY)
    if isinstance(value, list):
        return [_normalize(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalize(v) for k, v in value.items()}
    return value


def _snapshot(deployment: Deployment) -> dict[str, Any]:
    return _normalize(
        {
            "base_url": deployment.base_url,
            "processes": [
                {
                    "name": p.name,
                    "role": p.role,
                    "argv": p.argv,
                    "env": p.env,
                    "port": p.port,
                    "health_url": p.health_url,
                    "config_file": list(p.config_file) if p.config_file else None,
                }
                for p in deployment.processes
            ],
            "router_config": deployment.router_config,
        }
    )


@pytest.mark.parametrize("name", sorted(builtin_profiles()))
def test_golden(name):
    snapshot = _snapshot(_load(name))
    path = GOLDEN / f"{name}.json"
    if os.environ.get("AGENTKV_UPDATE_GOLDEN"):
        path.write_text(json.dumps(snapshot, indent=2) + "\n")
    assert path.exists(), f"no golden file for {name}: run with AGENTKV_UPDATE_GOLDEN=1"
    assert snapshot == json.loads(path.read_text())


def test_every_builtin_has_a_golden_file():
    assert {p.stem for p in GOLDEN.glob("*.json")} == set(builtin_profiles())


# --- names ----------------------------------------------------------------------------------


def _flags(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("-")]


def _check_kv_config(config: dict[str, Any], where: str) -> None:
    for key, value in config.items():
        assert key in KV_TRANSFER_FIELDS, (where, key)
        if key in KV_VALUES:
            assert value in KV_VALUES[key], (where, key, value)
    connector = config["kv_connector"]
    extra = config.get("kv_connector_extra_config", {})
    for key in extra:
        assert key in EXTRA_CONFIG_KEYS[connector], (where, connector, key)
    for child in extra.get("connectors", []):
        _check_kv_config(child, f"{where} > {child['kv_connector']}")


def _vllm_processes():
    for name in sorted(builtin_profiles()):
        deployment = _load(name)
        if deployment.profile.engine != "vllm":
            continue
        for spec in deployment.processes:
            if spec.role != "router":
                yield name, spec


def test_vllm_flags_keys_and_env_are_real_vllm_names():
    seen = 0
    for name, spec in _vllm_processes():
        seen += 1
        assert spec.argv[1] == "serve" and spec.argv[0] in ("vllm", "${AGENTKV_VLLM_BIN}")
        assert not spec.argv[2].startswith("-")  # the model, positional
        for flag in _flags(spec.argv):
            assert flag in VLLM_FLAGS, (name, spec.name, flag)
        for i, arg in enumerate(spec.argv[:-1]):
            if arg in (
                "--reasoning-parser",
                "--tool-call-parser",
                "--distributed-executor-backend",
            ):
                assert (arg, spec.argv[i + 1]) in VLLM_PARSERS, (name, arg, spec.argv[i + 1])
        config = json.loads(spec.argv[spec.argv.index("--kv-transfer-config") + 1])
        _check_kv_config(config, f"{name}/{spec.name}")
        if "--kv-events-config" in spec.argv:
            events = json.loads(spec.argv[spec.argv.index("--kv-events-config") + 1])
            assert set(events) <= KV_EVENTS_KEYS, (name, spec.name, events)
            # P's prefix cache, or a D's CPU tier (its OffloadingConnector's events)
            offloads = "OffloadingConnector" in json.dumps(config)
            assert spec.role == "prefill" or offloads, (name, spec.name)
        for key in spec.env:
            assert key in VLLM_ENV or key in OTHER_ENV, (name, spec.name, key)
    assert seen >= 10


def _cli_flags(*command: str) -> set[str]:
    text = CliRunner().invoke(app, [*command, "--help"], terminal_width=300).output
    return {w.strip(",.)") for w in text.split() if w.startswith("--")}


def test_sim_and_router_flags_are_real_agentkv_flags():
    sim_flags = _cli_flags("sim")
    router_flags = _cli_flags("router")
    for name in sorted(builtin_profiles()):
        for spec in _load(name).processes:
            if spec.role == "router":
                assert spec.argv[:4] == [sys.executable, "-m", "agentkv", "router"]
                assert set(_flags(spec.argv[4:])) <= router_flags, name
            elif spec.argv[:4] == [sys.executable, "-m", "agentkv", "sim"]:
                assert set(_flags(spec.argv[4:])) <= sim_flags, name


# --- what the expansion must guarantee -------------------------------------------------------


@pytest.mark.parametrize("name", sorted(builtin_profiles()))
def test_invariants(name):
    deployment = _load(name)
    profile = deployment.profile
    procs = deployment.processes
    assert [p.role for p in procs][-1] == "router"
    roles = [p.role for p in procs[:-1]]
    assert roles == sorted(roles, key=lambda r: r != "prefill")  # prefill first, then decode
    assert len({p.port for p in procs}) == len(procs)
    assert len({p.name for p in procs}) == len(procs)
    # The router's configuration is valid and agrees with the engines.
    cfg = RouterConfig.model_validate(deployment.router_config)
    assert cfg.upstream.block_size == profile.block_size
    assert cfg.retention.decoder_kv_blocks_ttl_s == profile.decoder_kv_blocks_ttl_s
    assert cfg.router_ttl_s < profile.decoder_kv_blocks_ttl_s - 5
    assert cfg.upstream.kv_recompute_threshold == profile.kv_recompute_threshold
    assert [b.url for b in cfg.upstream.prefill] == [
        p.health_url.removesuffix("/health") for p in procs if p.role == "prefill"
    ]
    assert [b.url for b in cfg.upstream.decode] == [
        p.health_url.removesuffix("/health") for p in procs if p.role == "decode"
    ]
    router = procs[-1]
    assert router.config_file is not None
    assert json.loads(router.config_file[1]) == deployment.router_config
    assert f"{{config_dir}}/{router.config_file[0]}" in router.argv
    assert deployment.base_url == f"http://127.0.0.1:{profile.router.http.port}/v1"
    engines = procs[:-1]
    if profile.engine == "vllm":
        side = [int(p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) for p in engines]
        assert len(set(side)) == len(side)
        assert not set(side) & {p.port for p in procs}
        for p in engines:
            assert p.env["PYTHONHASHSEED"] == "0"
            assert p.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
            assert p.argv[p.argv.index("--block-size") + 1] == str(profile.block_size)
            assert "--enable-prompt-tokens-details" in p.argv
            kv = json.loads(p.argv[p.argv.index("--kv-transfer-config") + 1])
            nixl = (
                kv
                if kv["kv_connector"] == "NixlConnector"
                else kv["kv_connector_extra_config"]["connectors"][0]
            )
            extra = nixl["kv_connector_extra_config"]
            assert extra["bidirectional_kv_xfer"] is True
            assert extra["decoder_kv_blocks_ttl"] == profile.decoder_kv_blocks_ttl_s
            if p.role == "prefill":
                assert kv["kv_role"] == "kv_producer"
                assert kv["kv_load_failure_policy"] == "recompute"
                assert extra["kv_recompute_threshold"] == profile.kv_recompute_threshold
            else:
                assert kv["kv_role"] == "kv_consumer"
    if profile.uses_gpus:
        from agentkv.serve.expand import instances

        by_node: dict[int, list[int]] = {}
        for inst, p in zip(instances(profile), engines, strict=True):
            gpus = [int(g) for g in p.env["CUDA_VISIBLE_DEVICES"].split(",")]
            assert len(gpus) == profile.group(inst.role).tensor_parallel_size
            assert p.argv[p.argv.index("--tensor-parallel-size") + 1] == str(len(gpus))
            assert max(gpus) < profile.hardware.gpus_per_node
            taken = by_node.setdefault(inst.node, [])
            assert not set(taken) & set(gpus), (name, inst.name)  # disjoint on a node
            taken += gpus
    else:
        assert all("CUDA_VISIBLE_DEVICES" not in p.env for p in engines)


def test_expand_is_pure(monkeypatch):
    profile = load_profile("qwen3-32b-1p1d")
    first = _snapshot(expand(profile))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "9999")
    assert _snapshot(expand(profile)) == first
    assert expand(profile, host="10.0.0.5").processes[0].health_url == "http://10.0.0.5:8100/health"


def test_local_expands_to_sim_engines_on_loopback():
    deployment = expand(load_profile("local"))
    prefill, decode, router = deployment.processes
    common = [
        "--host",
        "127.0.0.1",
        "--served-model-name",
        "agentkv-sim",
        "--block-size",
        "16",
        "--decoder-kv-blocks-ttl",
        "480",
        "--kv-recompute-threshold",
        "64",
        "--kv-load-failure-policy",
        "recompute",
        "--preset",
        "laptop",
        "--time-scale",
        "1",
    ]
    assert prefill.argv == [
        sys.executable, "-m", "agentkv", "sim", "--role", "prefill", *common[:2],
        "--port", "8100", *common[2:], "--no-prefix-caching", "--kv-events-config",
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:5800",'
        '"topic":"kv"}',
    ]  # fmt: skip
    assert decode.argv == [
        sys.executable, "-m", "agentkv", "sim", "--role", "decode", *common[:2],
        "--port", "8200", *common[2:],
    ]  # fmt: skip
    assert router.argv[:6] == [
        sys.executable, "-m", "agentkv", "router", "--config", "{config_dir}/router.json",
    ]  # fmt: skip
    assert prefill.env == decode.env == router.env == {}
    assert [p.health_url for p in deployment.processes] == [
        "http://127.0.0.1:8100/health",
        "http://127.0.0.1:8200/health",
        "http://127.0.0.1:8000/health",
    ]
    assert deployment.base_url == "http://127.0.0.1:8000/v1"
    assert deployment.router_config["http"]["host"] == "127.0.0.1"
    assert deployment.router_config["store"]["backend"] == "memory"


def test_offload_variant_uses_multiconnector_on_decode_only():
    deployment = _load("qwen3-32b-1p1d-offload")
    prefill, decode = deployment.processes[:2]

    def kv(spec):
        return json.loads(spec.argv[spec.argv.index("--kv-transfer-config") + 1])

    assert kv(prefill)["kv_connector"] == "NixlConnector"
    outer = kv(decode)
    assert outer["kv_connector"] == "MultiConnector"
    nixl, offload = outer["kv_connector_extra_config"]["connectors"]
    assert nixl["kv_connector"] == "NixlConnector"
    assert nixl["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
    assert offload["kv_connector"] == "OffloadingConnector"
    assert offload["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": 256 * 2**30,
        "offload_prompt_only": False,
        # D's CPU tier in its KV events, with tokens, for the router's cpu path
        "self_describing_kv_events": True,
    }
    events = json.loads(decode.argv[decode.argv.index("--kv-events-config") + 1])
    assert events["enable_kv_cache_events"] and events["endpoint"] == "tcp://127.0.0.1:5900"


def test_bench_variant_turns_prefix_caching_off_on_prefill_only():
    prefill, decode = _load("qwen3-32b-1p1d-bench").processes[:2]
    assert "--no-enable-prefix-caching" in prefill.argv
    assert "--enable-prefix-caching" in decode.argv


def test_efa_profiles_use_libfabric():
    for name in ("glm-5-fp8-1p1d", "qwen3-32b-1p1d-bench"):
        for spec in _load(name).processes[:2]:
            kv = json.loads(spec.argv[spec.argv.index("--kv-transfer-config") + 1])
            assert kv["kv_connector_extra_config"]["backends"] == ["LIBFABRIC"]
            assert spec.env["FI_PROVIDER"] == "efa"


def test_cpu_tiny_is_the_measured_cpu_setup(monkeypatch):
    monkeypatch.setenv("AGENTKV_CPU_TINY_MODEL", "/models/tiny-qwen3")
    monkeypatch.setenv("AGENTKV_VLLM_BIN", "/venv/bin/vllm")
    deployment = expand(load_profile("cpu-tiny"))
    prefill, decode, _router = deployment.processes
    for spec in (prefill, decode):
        argv = spec.argv
        assert argv[:3] == ["/venv/bin/vllm", "serve", "/models/tiny-qwen3"]
        assert argv[argv.index("--served-model-name") + 1] == "tiny"
        assert argv[argv.index("--dtype") + 1] == "float32"
        assert argv[argv.index("--block-size") + 1] == "32"
        assert argv[argv.index("--max-model-len") + 1] == "4096"
        assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
        assert "--enforce-eager" in argv
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert kv["kv_buffer_device"] == "cpu"
        assert kv["kv_connector_extra_config"]["decoder_kv_blocks_ttl"] == 30
        assert spec.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert spec.env["VLLM_HOST_IP"] == "127.0.0.1"
        assert spec.env["UCX_NET_DEVICES"] == "lo"
        assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
        assert "CUDA_VISIBLE_DEVICES" not in spec.env
    assert prefill.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert decode.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"
    # vLLM 0.33: D's handle is on the streamed finish chunk, so the router relays streams.
    assert all(d["handle_on_stream"] for d in deployment.router_config["upstream"]["decode"])
    # P caches its prompts and sends them as KV events to the router, on loopback
    assert "--enable-prefix-caching" in prefill.argv
    events = json.loads(prefill.argv[prefill.argv.index("--kv-events-config") + 1])
    assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
    assert events["endpoint"] == "tcp://127.0.0.1:5610"
    assert "--trust-request-chat-template" in prefill.argv
    assert "--kv-events-config" not in decode.argv
    assert RouterConfig.model_validate(deployment.router_config).router_ttl_s == 20
