"""docs/conformance.md, written from a run of the tier (``AGENTKV_WRITE_CONFORMANCE=1``)."""

from __future__ import annotations

from pathlib import Path

from tests._support.vllm_scenarios import (
    API_PROMPTS,
    API_TURNS,
    OUT,
    RESULTS,
    ROWS,
    SHAPES,
    TEMPLATE_PULLED,
    TEMPLATE_RUNS,
    TIMINGS,
    VLLM_VERSION,
)

TIERS = (Path(__file__).resolve().parents[1] / "vllm_cpu" / "tiers.md").read_text()
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
        "finish chunk) and the simulator in the same shape, each behind agentkv's router (with",
        '`paths.mode = "pull"`: every later turn through P, which reads D\'s KV back), driven',
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
    lines += _apis()
    path.write_text("\n".join(lines) + "\n")


def _diff(value: float | None) -> str:
    return "" if value is None else f"{value:.1e}"


def _apis() -> list[str]:
    """test_apis.py's section."""
    if not API_TURNS and not API_PROMPTS:
        return []
    lines = [
        "",
        "## Messages and Responses through the router",
        "",
        "`test_apis.py`: a Messages conversation (anthropic SDK, Claude Code's session header)",
        "and a stateless Responses one (openai SDK, the whole input each turn, `store: false`,",
        "`prompt_cache_key`), through a router with cpu-tiny's settings whose P is a recording",
        "proxy in front of the real P, so the ids it sent P are read on the wire. That router",
        "gets no KV events (the main router has them): its receipts are estimates, and a turn",
        "whose verified prefix P holds itself reads as `pull` where the main router says",
        "`local`; *pulled*, P's counter, is what P read. *Δ logprob* is against a clean",
        "recompute of those ids: for Responses the turn's own first-token top-5",
        "(`message.output_text.logprobs`); the Messages API has no logprobs, so the ids are sent",
        "to P again and read the KV the turn left in P's cache (every full block, its own and",
        "what it read from D). The rewrite replaces the first exchange with a summary; through",
        'a router with `reuse_policy = "unverified"` that read leaves wrong KV, which the probe',
        "sees. The pulls need the router to keep token identity (issue 22 item 4).",
        "",
        "| conversation | turn | decision | pulled | receipt (estimated) | prompt tokens "
        "| Δ logprob |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for name, turns in API_TURNS.items():
        for t in turns:
            lines.append(
                f"| {name} | {t.turn} | {t.decision} | {t.pulled} | {_n(t.reused)} | "
                f"{t.prompt_tokens} | {_diff(t.logprob_diff)} |"
            )
    if API_PROMPTS:
        lines += [
            "",
            "One request per API with a system prompt, tools and a tool round (Messages: Claude",
            "Code's billing block, an inline system message, `thinking: disabled`; Responses: a",
            "developer message, a reasoning item, `reasoning.effort`, a built-in `web_search`",
            "tool): the ids the router sent P against vLLM's `/v1/messages/render` and",
            "`/v1/responses/render` (`vllm launch render`: the endpoints' own conversion and",
            "renderer), and the same request on P's own `/v1/messages` and `/v1/responses` under",
            "a fresh `cache_salt`: the prompt tokens it counted, how many of the router's ids it",
            "left in P's cache (every full block: same ids), and, for Responses, its first token's",
            "logprobs against a clean recompute of the router's ids.",
            "",
            "| API | ids sent to P | ids vLLM renders | equal | vLLM's endpoint ran | of them "
            "cached | Δ logprob |",
            "|---|---:|---:|---|---:|---:|---:|",
        ]
        for api, (sent, want, equal, ran, cached, diff) in API_PROMPTS.items():
            lines.append(
                f"| {api} | {sent} | {want} | {'yes' if equal else 'no'} | {ran} | {cached} | "
                f"{_diff(diff)} |"
            )
    return lines


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
