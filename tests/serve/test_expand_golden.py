"""Every built-in profile expands to exactly the argv and environment in tests/serve/golden/, and
every vLLM flag, config key and environment variable it emits is a real vLLM 0.33.0 name.

Regenerate the golden files after an intended change with
``AGENTKV_UPDATE_GOLDEN=1 pytest tests/serve/test_expand_golden.py`` and review the diff.

The name lists below were checked by hand against the vLLM 0.33.0 sdist (``vllm-0.33.0.tar.gz``
from PyPI, upstream commit 4ba787ec9); paths are relative to that tree. CI cannot read vLLM's
source, so the lists live here with where each name comes from.
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

GOLDEN = Path(__file__).parent / "golden"
PY = "{python}"

# --- vLLM 0.33.0 names ----------------------------------------------------------------------

# vllm/config/kv_events.py: KVEventsConfig (a pydantic dataclass, extra keys forbidden).
KV_EVENTS_KEYS = {
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
}

# `vllm serve MODEL`: vllm/entrypoints/cli/serve.py (usage "vllm serve [model_tag] [options]";
# the console script `vllm` is vllm.entrypoints.cli.main:main in pyproject.toml).
VLLM_FLAGS = {
    "--served-model-name": "vllm/engine/arg_utils.py: model_group.add_argument("
    '"--served-model-name", **model_kwargs["served_model_name"])',
    "--host": "vllm/entrypoints/common/cli_args.py: FrontendArgs.host (flags are "
    "f\"--{key.replace('_', '-')}\" in BaseFrontendArgs.add_cli_args)",
    "--port": "vllm/entrypoints/common/cli_args.py: FrontendArgs.port",
    "--tensor-parallel-size": 'vllm/engine/arg_utils.py: parallel_group.add_argument("'
    '--tensor-parallel-size", "-tp", ...)',
    "--block-size": 'vllm/engine/arg_utils.py: cache_group.add_argument("--block-size", ...)',
    "--enable-prefix-caching": 'vllm/engine/arg_utils.py: cache_group.add_argument("'
    '--enable-prefix-caching", ...); CacheConfig.enable_prefix_caching: bool',
    "--no-enable-prefix-caching": "vllm/engine/arg_utils.py get_kwargs: bool fields get "
    'argparse.BooleanOptionalAction ("Creates --no-<name> and --<name> flags")',
    "--enable-prompt-tokens-details": "vllm/entrypoints/common/cli_args.py: "
    "BaseFrontendArgs.enable_prompt_tokens_details: bool = False",
    "--dtype": 'vllm/engine/arg_utils.py: model_group.add_argument("--dtype", ...)',
    "--max-model-len": 'vllm/engine/arg_utils.py: model_group.add_argument("--max-model-len", ...)',
    "--kv-transfer-config": 'vllm/engine/arg_utils.py: add_argument("--kv-transfer-config", '
    '**vllm_kwargs["kv_transfer_config"])',
    "--kv-events-config": 'vllm/engine/arg_utils.py: vllm_group.add_argument("--kv-events-config", '
    '**vllm_kwargs["kv_events_config"]); EngineArgs.kv_events_config: KVEventsConfig | None',
    "--enforce-eager": 'vllm/engine/arg_utils.py: model_group.add_argument("--enforce-eager", ...)',
    "--distributed-executor-backend": "vllm/engine/arg_utils.py: parallel_group.add_argument("
    '"--distributed-executor-backend", ...); vllm/config/parallel.py: '
    'DistributedExecutorBackend = Literal["ray", "mp", "uni", "external_launcher"]',
    "--max-num-seqs": 'vllm/engine/arg_utils.py: add_argument("--max-num-seqs", ...)',
    "--otlp-traces-endpoint": "vllm/engine/arg_utils.py: observability_group.add_argument("
    '"--otlp-traces-endpoint", **observability_kwargs["otlp_traces_endpoint"]); '
    "vllm/config/observability.py: ObservabilityConfig.otlp_traces_endpoint: str | None "
    "(its validator needs the OpenTelemetry packages installed)",
    "--reasoning-parser": "vllm/engine/arg_utils.py: structured_outputs_group.add_argument("
    '"--reasoning-parser", ...); names registered in vllm/reasoning/__init__.py',
    "--trust-request-chat-template": "vllm/entrypoints/common/cli_args.py: "
    "BaseFrontendArgs.trust_request_chat_template: bool = False",
    "--enable-auto-tool-choice": "vllm/entrypoints/common/cli_args.py: "
    "BaseFrontendArgs.enable_auto_tool_choice: bool = False",
    "--tool-call-parser": "vllm/entrypoints/common/cli_args.py: BaseFrontendArgs."
    "tool_call_parser; names registered in vllm/tool_parsers/__init__.py",
}
# Values of the parser flags above, as registered in vLLM 0.33.0.
VLLM_PARSERS = {
    ("--reasoning-parser", "qwen3"): "vllm/reasoning/__init__.py",
    ("--reasoning-parser", "glm47"): "vllm/reasoning/__init__.py",
    ("--tool-call-parser", "hermes"): "vllm/tool_parsers/__init__.py",
    ("--tool-call-parser", "glm47"): "vllm/tool_parsers/__init__.py",
    ("--tool-call-parser", "llama3_json"): "vllm/tool_parsers/__init__.py",
    ("--tool-call-parser", "openai"): "vllm/tool_parsers/__init__.py",
    ("--distributed-executor-backend", "uni"): "vllm/config/parallel.py",
}

# KVTransferConfig (vllm/config/kv_transfer.py), the fields used and the values allowed.
KV_TRANSFER_FIELDS = {
    "kv_connector": "vllm/config/kv_transfer.py: KVTransferConfig.kv_connector",
    "kv_role": "vllm/config/kv_transfer.py: KVTransferConfig.kv_role (KVRole = kv_producer | "
    "kv_consumer | kv_both)",
    "kv_buffer_device": "vllm/config/kv_transfer.py: KVTransferConfig.kv_buffer_device "
    "('cuda', 'cpu', 'xpu')",
    "kv_load_failure_policy": 'vllm/config/kv_transfer.py: kv_load_failure_policy: Literal["'
    'recompute", "fail"]; read by vllm/v1/core/sched/scheduler.py from the top-level config',
    "kv_connector_extra_config": "vllm/config/kv_transfer.py: "
    "KVTransferConfig.kv_connector_extra_config",
}
KV_VALUES = {
    "kv_role": {"kv_producer", "kv_consumer", "kv_both"},
    "kv_buffer_device": {"cuda", "cpu"},
    "kv_load_failure_policy": {"recompute", "fail"},
    # vllm/distributed/kv_transfer/kv_connector/factory.py: KVConnectorFactory.register_connector
    "kv_connector": {"NixlConnector", "MultiConnector", "OffloadingConnector"},
}
# kv_connector_extra_config keys per connector (each read with get_from_extra_config / .get).
_NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
EXTRA_CONFIG_KEYS = {
    "NixlConnector": {
        "bidirectional_kv_xfer": f"{_NIXL}/base_scheduler.py, base_worker.py "
        '(get_from_extra_config("bidirectional_kv_xfer", False))',
        "kv_recompute_threshold": f"{_NIXL}/base_scheduler.py "
        '(get_from_extra_config("kv_recompute_threshold", 64))',
        "decoder_kv_blocks_ttl": f"{_NIXL}/base_scheduler.py "
        '(get_from_extra_config("decoder_kv_blocks_ttl", 480))',
        "kv_lease_duration": f"{_NIXL}/base_scheduler.py, base_worker.py "
        '(get_from_extra_config("kv_lease_duration", 30))',
        "backends": f'{_NIXL}/base_worker.py (get_from_extra_config("backends", ["UCX"]))',
    },
    "MultiConnector": {
        "connectors": "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py "
        '(kv_connector_extra_config.get("connectors"))',
    },
    "OffloadingConnector": {
        "cpu_bytes_to_use": 'vllm/v1/kv_offload/cpu/spec.py (extra_config.get("cpu_bytes_to_use"))',
        "offload_prompt_only": "vllm/v1/kv_offload/base.py "
        '(extra_config.get("offload_prompt_only", True))',
        "block_size": "vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py "
        '(extra_config.get("block_size"); a multiple of the GPU block size)',
        "eviction_policy": 'vllm/v1/kv_offload/cpu/spec.py (extra_config.get("eviction_policy", '
        '"lru"))',
    },
}

# Environment variables read by vLLM 0.33.0 itself.
VLLM_ENV = {
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "vllm/envs.py (default 'localhost'); read in "
    f"{_NIXL}/base_scheduler.py",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "vllm/envs.py (default 5600); "
    f"{_NIXL}/base_scheduler.py adds data_parallel_index",
    "VLLM_HOST_IP": "vllm/envs.py",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "vllm/envs.py (default 1)",
    "VLLM_CPU_KVCACHE_SPACE": "vllm/envs.py (GiB, int)",
    "VLLM_NO_USAGE_STATS": "vllm/envs.py",
    "DO_NOT_TRACK": 'vllm/envs.py: VLLM_DO_NOT_TRACK falls back to os.environ.get("DO_NOT_TRACK")',
    "CUDA_VISIBLE_DEVICES": "vllm/envs.py",
    "PYTHONHASHSEED": "vllm/v1/core/kv_cache_utils.py: resolve_none_hash_seed "
    '(os.getenv("PYTHONHASHSEED") seeds the prefix-cache block hashes)',
    "HF_HUB_OFFLINE": "huggingface_hub; vLLM reads huggingface_hub.constants.HF_HUB_OFFLINE "
    "(vllm/transformers_utils/config.py)",
}
# Environment read by the libraries under vLLM, not by vLLM's own code.
OTHER_ENV = {
    "TRANSFORMERS_OFFLINE": "transformers (offline model loading; reference/vllm-cpu.md §3)",
    "UCX_NET_DEVICES": "UCX, NIXL's default transport (docs/features/nixl_connector_usage.md, "
    "'Transport Configuration'; reference/vllm-cpu.md §4: lo for loopback)",
    "FI_PROVIDER": "libfabric, NIXL's LIBFABRIC backend (vllm-protocol.md §1.2: the blog's EFA "
    "run used FI_PROVIDER=efa)",
    "OTEL_SERVICE_NAME": "the OpenTelemetry SDK: vllm/tracing/otel.py init_otel_tracer builds "
    "its Resource with Resource.create(), which reads OTEL_SERVICE_NAME",
}

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
            assert spec.role == "prefill", (name, spec.name)
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
    assert cfg.block_size == profile.block_size
    assert cfg.decoder_kv_blocks_ttl_s == profile.decoder_kv_blocks_ttl_s
    assert cfg.router_ttl_s < profile.decoder_kv_blocks_ttl_s - 5
    assert cfg.kv_recompute_threshold == profile.kv_recompute_threshold
    assert [b.url for b in cfg.prefill] == [
        p.health_url.removesuffix("/health") for p in procs if p.role == "prefill"
    ]
    assert [b.url for b in cfg.decode] == [
        p.health_url.removesuffix("/health") for p in procs if p.role == "decode"
    ]
    router = procs[-1]
    assert router.config_file is not None
    assert json.loads(router.config_file[1]) == deployment.router_config
    assert f"{{config_dir}}/{router.config_file[0]}" in router.argv
    assert deployment.base_url == f"http://127.0.0.1:{profile.router.port}/v1"
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
    assert deployment.router_config["host"] == "127.0.0.1"
    assert deployment.router_config["store"] == "memory"


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
    }


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
    assert all(d["handle_on_stream"] for d in deployment.router_config["decode"])
    # P caches its prompts and sends them as KV events to the router, on loopback
    assert "--enable-prefix-caching" in prefill.argv
    events = json.loads(prefill.argv[prefill.argv.index("--kv-events-config") + 1])
    assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
    assert events["endpoint"] == "tcp://127.0.0.1:5610"
    assert "--trust-request-chat-template" in prefill.argv
    assert "--kv-events-config" not in decode.argv
    assert RouterConfig.model_validate(deployment.router_config).router_ttl_s == 20
