"""The vLLM 0.33.0 names agentkv's profiles may emit (flags, config keys, environment variables),
each with where it comes from in vLLM's source.

The lists were checked by hand against the vLLM 0.33.0 sdist (``vllm-0.33.0.tar.gz`` from PyPI,
upstream commit 4ba787ec9); paths are relative to that tree. CI cannot read vLLM's source, so the
lists live here (used by tests/serve/test_expand_golden.py and test_tracing_profile.py).
"""

from __future__ import annotations

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
        "self_describing_kv_events": "vllm/v1/kv_offload/base.py "
        '(extra_config.get("self_describing_kv_events", False))',
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
