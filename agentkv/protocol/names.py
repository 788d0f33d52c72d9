"""Every wire name agentkv speaks, defined once.

Headers and body fields of the client <-> router contract (``DESIGN.md``), the fields of vLLM's
OpenAI server that agentkv reads or sets, and the Prometheus metric names of vLLM 0.33 that the
simulator exports and the router and benchmarks read. Nothing here performs I/O.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "BODY_CONVERSATION_ID",
    "BODY_KV_TRANSFER_PARAMS",
    "BODY_PROMPT_CACHE_KEY",
    "BODY_PROMPT_TOKEN_IDS",
    "BODY_RETURN_TOKEN_IDS",
    "BODY_SESSION_ID",
    "BODY_SIM_SCRIPT",
    "BODY_TOKEN_IDS",
    "DECISIONS",
    "HEADER_CLAUDE_CODE_AGENT_ID",
    "HEADER_CLAUDE_CODE_SESSION_ID",
    "HEADER_CODEX_SESSION_IDS",
    "HEADER_CONVERSATION_ID",
    "HEADER_DECISION",
    "HEADER_DECODE_CACHED_TOKENS",
    "HEADER_DYNAMO_SESSION_ID",
    "HEADER_ECHO_PROMPT_TOKEN_IDS",
    "HEADER_EPOCH",
    "HEADER_ESTIMATED",
    "HEADER_IDENTITY",
    "HEADER_LEASE",
    "HEADER_LOCAL_PREFIX_TOKENS",
    "HEADER_OPENCODE_SESSION_IDS",
    "HEADER_PATH_ESTIMATE_MS",
    "HEADER_REQUEST_ID",
    "HEADER_REUSED_TOKENS",
    "HEADER_RUNNER_UP",
    "HEADER_RUNNER_UP_ESTIMATE_MS",
    "HEADER_SESSION_ID",
    "HEADER_SIM_CACHED_TOKENS",
    "HEADER_SIM_COMPUTED_TOKENS",
    "HEADER_SIM_CPU_TOKENS",
    "HEADER_SIM_ENGINE_ID",
    "HEADER_SIM_MODEL_TTFT_MS",
    "HEADER_SIM_WRONG_KV_TOKENS",
    "HEADER_TRIM_CAUSE",
    "HEADER_VERIFIED_PREFIX_TOKENS",
    "Metric",
    "RouterMetric",
]

# -- headers: client <-> router ------------------------------------------------------------------
HEADER_CONVERSATION_ID: Final = "X-Conversation-Id"
"""Canonical conversation id header (the SDK always sends it)."""
HEADER_SESSION_ID: Final = "X-Session-ID"
"""Sent by vLLM's multi-turn benchmark with ``--send-conversation-id``."""
HEADER_CLAUDE_CODE_SESSION_ID: Final = "X-Claude-Code-Session-Id"
"""Claude Code's session (its body's ``metadata.user_id`` holds the same ``session_id``)."""
HEADER_CLAUDE_CODE_AGENT_ID: Final = "X-Claude-Code-Agent-Id"
"""Claude Code's sub-agent: a history of its own within the session."""
HEADER_CODEX_SESSION_IDS: Final = ("session-id", "session_id", "thread-id")
"""Codex CLI's session headers (``session_id`` in older builds; ``thread-id`` is the same uuid)."""
HEADER_OPENCODE_SESSION_IDS: Final = ("x-session-affinity", "x-opencode-session")
"""opencode's session headers (it also sends ``X-Session-Id``)."""
HEADER_DYNAMO_SESSION_ID: Final = "X-Dynamo-Session-ID"
"""NVIDIA Dynamo's session header."""
HEADER_EPOCH: Final = "X-AgentKV-Epoch"
"""Integer history epoch; the client bumps it when it rewrites history."""
HEADER_REQUEST_ID: Final = "X-Request-Id"
"""vLLM uses it as the base of its internal request id (it appends ``-<8 hex>``)."""
HEADER_ECHO_PROMPT_TOKEN_IDS: Final = "X-AgentKV-Echo-Prompt-Token-Ids"
"""``1``: keep the engine's echo of ``prompt_token_ids`` in the response even when the client
sent them (``kv_transfer_params.prompt_token_ids``); by default the router strips it, since the
client has them (128k ids are ~700 kB of JSON to decode)."""
HEADER_DECISION: Final = "X-AgentKV-Decision"
HEADER_REUSED_TOKENS: Final = "X-AgentKV-Reused-Tokens"
"""M = max(0, min(C, N) − L): the prompt tokens P reads from D's blocks this turn."""
HEADER_VERIFIED_PREFIX_TOKENS: Final = "X-AgentKV-Verified-Prefix-Tokens"
"""C: the prompt tokens D's handle holds, verified by token ids (0 across salts or models)."""
HEADER_LOCAL_PREFIX_TOKENS: Final = "X-AgentKV-Local-Prefix-Tokens"
"""L: the prompt tokens P already holds in its own prefix cache (from P's KV events)."""
HEADER_ESTIMATED: Final = "X-AgentKV-Estimated"
"""``1`` when L is unknown (P's KV events are off): the reused figure is what was offered, and P
may have read less because its own prefix cache covered part of it."""
HEADER_TRIM_CAUSE: Final = "X-AgentKV-Trim-Cause"
"""Why less than the whole handle was usable: ``rewrite`` (the client announced a new epoch) or
``drift`` (the prompt diverged without one)."""
HEADER_IDENTITY: Final = "X-AgentKV-Identity"
"""Token identity for a client that sent messages: ``kept`` (the prompt is the previous prompt +
the generated ids + the new messages' ids, as in the SDK's exact mode), ``kept-prefix`` (the
history changed: the recorded ids up to the last unchanged answer + the ids of the messages after
it) or ``rendered:<reason>``
(the client's messages rendered as sent; reasons in ``agentkv.router.identity.REASONS``)."""
HEADER_PATH_ESTIMATE_MS: Final = "X-AgentKV-Path-Estimate-Ms"
"""The cost model's estimated time to first token of the path the turn took (set only when the
cost model chose it: config ``paths.mode``, a verified handle)."""
HEADER_RUNNER_UP: Final = "X-AgentKV-Runner-Up"
"""The path the cost model ranked next (``pull``, ``decode``, ``local``, ``recompute``,
``cpu``)."""
HEADER_RUNNER_UP_ESTIMATE_MS: Final = "X-AgentKV-Runner-Up-Estimate-Ms"
"""Its estimated time to first token."""
HEADER_DECODE_CACHED_TOKENS: Final = "X-AgentKV-Decode-Cached-Tokens"
"""Straight to D (``decode``, ``cpu``): the prompt tokens D found in its own prefix cache and
CPU tier, as D reported them (the simulator's headers, or a whole answer's
``usage.prompt_tokens_details.cached_tokens``); absent when D has not said yet (a relayed
vLLM stream: its usage comes at the end)."""
HEADER_LEASE: Final = "X-AgentKV-Lease"
"""Seconds the router keeps a conversation's handles while its agent lives (renewed by each turn
or ``POST /v1/conversations/{id}/lease``); when it lapses, D's blocks are released at once."""

DECISIONS: Final = ("pull", "decode", "cpu", "local", "recompute", "miss", "stale", "expired")
"""Values of ``X-AgentKV-Decision``."""

# -- headers: simulator receipts (agentkv's own engine simulator only) --------------------------
HEADER_SIM_WRONG_KV_TOKENS: Final = "X-AgentKV-Sim-Wrong-KV-Tokens"
"""Set by the simulator when a request ran on KV computed for other tokens (silent corruption)."""
HEADER_SIM_MODEL_TTFT_MS: Final = "X-AgentKV-Sim-Model-TTFT-Ms"
"""The cost model's time to first token for this request, before ``--time-scale``."""
HEADER_SIM_ENGINE_ID: Final = "X-AgentKV-Sim-Engine-Id"
"""The simulator's engine id (vLLM's ``kv_transfer_config.engine_id``) on every answer, ``/health``
included: a router learns which engine instance is behind a URL without waiting for a handle."""

HEADER_SIM_CACHED_TOKENS: Final = "X-AgentKV-Sim-Cached-Tokens"
"""Prompt tokens this instance found in its own GPU prefix cache (vLLM's local hit; on a request
that reaches D directly, what ``usage.prompt_tokens_details.cached_tokens`` reports)."""
HEADER_SIM_CPU_TOKENS: Final = "X-AgentKV-Sim-CPU-Tokens"
"""Prompt tokens this instance loaded from its CPU tier (``--cpu-offload-blocks``)."""
HEADER_SIM_COMPUTED_TOKENS: Final = "X-AgentKV-Sim-Computed-Tokens"
"""Prompt tokens this instance prefilled itself."""

# -- body fields ---------------------------------------------------------------------------------
BODY_KV_TRANSFER_PARAMS: Final = "kv_transfer_params"
BODY_PROMPT_TOKEN_IDS: Final = "prompt_token_ids"
"""In responses with ``return_token_ids``; inside ``kv_transfer_params`` in requests (vLLM 0.33)."""
BODY_TOKEN_IDS: Final = "token_ids"
BODY_RETURN_TOKEN_IDS: Final = "return_token_ids"
BODY_CONVERSATION_ID: Final = "conversation_id"
"""vLLM's example multi-turn proxy keys its store by this body field."""
BODY_SESSION_ID: Final = "session_id"
"""vLLM's own per-conversation field, copied into KV events."""
BODY_PROMPT_CACHE_KEY: Final = "prompt_cache_key"
"""OpenAI's cache-routing hint."""
BODY_SIM_SCRIPT: Final = "agentkv_sim"
"""Simulator test hook: a scripted model output for this request (see ``docs/simulator.md``)."""


class Metric:
    """Prometheus metric names as vLLM 0.33 exposes them (counters carry a ``_total`` suffix).

    The names below are the base names given to ``prometheus_client``; a counter ``NAME`` is
    scraped as ``NAME_total``.
    """

    PREFIX_CACHE_QUERIES: Final = "vllm:prefix_cache_queries"
    PREFIX_CACHE_HITS: Final = "vllm:prefix_cache_hits"
    EXTERNAL_PREFIX_CACHE_QUERIES: Final = "vllm:external_prefix_cache_queries"
    EXTERNAL_PREFIX_CACHE_HITS: Final = "vllm:external_prefix_cache_hits"
    PROMPT_TOKENS: Final = "vllm:prompt_tokens"
    GENERATION_TOKENS: Final = "vllm:generation_tokens"
    PROMPT_TOKENS_CACHED: Final = "vllm:prompt_tokens_cached"
    PROMPT_TOKENS_BY_SOURCE: Final = "vllm:prompt_tokens_by_source"
    """Label ``source``: ``local_compute`` | ``local_cache_hit`` | ``external_kv_transfer``."""
    PROMPT_TOKENS_CACHED_BY_SOURCE: Final = "vllm:prompt_tokens_cached_by_source"
    """Label ``source``: NIXL reports ``p2p``."""
    REQUEST_PREFILL_KV_COMPUTED_TOKENS: Final = "vllm:request_prefill_kv_computed_tokens"
    KV_CACHE_USAGE_PERC: Final = "vllm:kv_cache_usage_perc"
    NUM_REQUESTS_RUNNING: Final = "vllm:num_requests_running"
    NUM_REQUESTS_WAITING: Final = "vllm:num_requests_waiting"
    REQUEST_SUCCESS: Final = "vllm:request_success"
    TIME_TO_FIRST_TOKEN_SECONDS: Final = "vllm:time_to_first_token_seconds"
    NIXL_XFER_TIME_SECONDS: Final = "vllm:nixl_xfer_time_seconds"
    NIXL_POST_TIME_SECONDS: Final = "vllm:nixl_post_time_seconds"
    NIXL_BYTES_TRANSFERRED: Final = "vllm:nixl_bytes_transferred"
    NIXL_NUM_DESCRIPTORS: Final = "vllm:nixl_num_descriptors"
    NIXL_NUM_FAILED_TRANSFERS: Final = "vllm:nixl_num_failed_transfers"
    NIXL_NUM_FAILED_NOTIFICATIONS: Final = "vllm:nixl_num_failed_notifications"
    NIXL_NUM_KV_EXPIRED_REQS: Final = "vllm:nixl_num_kv_expired_reqs"
    NIXL_NUM_NOTIFICATIONS_AFTER_EXPIRY: Final = "vllm:nixl_num_notifications_after_expiry"
    # agentkv's simulator only
    SIM_WRONG_KV_TOKENS: Final = "agentkv_sim_wrong_kv_tokens"
    SIM_WRONG_KV_REQUESTS: Final = "agentkv_sim_wrong_kv_requests"
    SIM_RETAINED_BLOCKS: Final = "agentkv_sim_retained_blocks"
    SIM_RETAINED_REQUESTS: Final = "agentkv_sim_retained_requests"
    SIM_RETAINED_BLOCK_SECONDS: Final = "agentkv_sim_retained_block_seconds"
    SIM_KV_BLOCKS_USED: Final = "agentkv_sim_kv_blocks_used"
    SIM_KV_BLOCKS_TOTAL: Final = "agentkv_sim_kv_blocks_total"
    SIM_PREFILL_TOKENS_IN_FLIGHT: Final = "agentkv_sim_prefill_tokens_in_flight"
    SIM_DECODE_SLOWDOWN_SECONDS: Final = "agentkv_sim_decode_slowdown_seconds"
    SIM_SLOWED_DECODE_STEPS: Final = "agentkv_sim_slowed_decode_steps"
    SIM_MODEL_INTER_TOKEN_SECONDS: Final = "agentkv_sim_model_inter_token_seconds"
    SIM_PREFILL_QUEUE_SECONDS: Final = "agentkv_sim_prefill_queue_seconds"
    SIM_CPU_BLOCKS: Final = "agentkv_sim_cpu_blocks"
    SIM_CPU_SAVES: Final = "agentkv_sim_cpu_saves"
    SIM_CPU_SAVE_FAILURES: Final = "agentkv_sim_cpu_save_failures"
    SIM_CPU_EVICTIONS: Final = "agentkv_sim_cpu_evictions"
    SIM_CPU_LOADED_TOKENS: Final = "agentkv_sim_cpu_loaded_tokens"


class RouterMetric:
    """The router's Prometheus metric names (``/metrics`` of ``agentkv router``; docs/router.md
    lists them, ``deploy/`` queries them). Counters are scraped with a ``_total`` suffix."""

    REQUESTS: Final = "agentkv_router_requests"
    FAILED_REQUESTS: Final = "agentkv_router_failed_requests"
    REUSED_TOKENS: Final = "agentkv_router_reused_tokens"
    PROMPT_TOKENS: Final = "agentkv_router_prompt_tokens"
    LOCAL_PREFIX_TOKENS: Final = "agentkv_router_local_prefix_tokens"
    ESTIMATED_TURNS: Final = "agentkv_router_estimated_turns"
    TRIMMED_TURNS: Final = "agentkv_router_trimmed_turns"
    ABANDONED_STREAMS: Final = "agentkv_router_abandoned_streams"
    STORE_ERRORS: Final = "agentkv_router_store_errors"
    VERIFIED_TOKENS: Final = "agentkv_router_verified_tokens"
    CLIENT_ABORTS: Final = "agentkv_router_client_aborts"
    HANDLES_RELEASED: Final = "agentkv_router_handles_released"
    HANDLE_AGE_SECONDS: Final = "agentkv_router_handle_age_seconds"
    UPSTREAM_ERRORS: Final = "agentkv_router_upstream_errors"
    RETRIES: Final = "agentkv_router_retries"
    PREFILL_SECONDS: Final = "agentkv_router_prefill_seconds"
    DECODE_FIRST_BYTE_SECONDS: Final = "agentkv_router_decode_first_byte_seconds"
    TURN_SECONDS: Final = "agentkv_router_turn_seconds"
    FIRST_BYTE_SECONDS: Final = "agentkv_router_first_byte_seconds"
    STORE_HANDLES: Final = "agentkv_router_store_handles"
    LEASES: Final = "agentkv_router_leases"
    STORE_EVICTIONS: Final = "agentkv_router_store_evictions"
    ENGINE_HEALTHY: Final = "agentkv_router_engine_healthy"
    ENGINE_RESTARTS: Final = "agentkv_router_engine_restarts"
    HANDLES_DROPPED: Final = "agentkv_router_handles_dropped"
    CONVERSATION_SOURCES: Final = "agentkv_router_conversation_sources"
    KV_INDEX_IN_SYNC: Final = "agentkv_router_kv_index_in_sync"
    IDENTITY_TURNS: Final = "agentkv_router_identity_turns"
