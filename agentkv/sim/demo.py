"""``agentkv demo``: bidirectional KV reuse on two simulated engines, and why it must be verified.

1. Start a simulated prefill (P, prefix caching off, as in the published benchmark) and decode
   (D) instance as real processes on loopback, with the Qwen3-32B P5en cost model.
2. Drive a multi-turn conversation in exact token ids, acting as a minimal router: P with D's
   last handle, then D; each turn's prompt is the previous prompt + the generated ids + the new
   message. Before attaching a handle, check by token ids that the prompt extends what D holds.
3. Replay the same prompts with no handle (recompute every turn) for a baseline.
4. Rewrite the history (a summary replaces the first exchange) and send it twice: with the old
   handle as is (what vLLM's example proxy does) and with the handle trimmed to the verified
   prefix. The simulator counts prompt tokens that ran on KV computed for other tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from rich.console import Console
from rich.table import Table

from agentkv.protocol import HEADER_SIM_WRONG_KV_TOKENS
from agentkv.sim.launch import SimProcess, start_sims

__all__ = ["run_demo"]

BLOCK = 16
SYSTEM = (
    "You are a careful coding agent working in a large repository. Follow the rules below. "
    + " ".join(
        f"Rule {i}: read the file before editing it, keep changes small, and cite line {i}."
        for i in range(320)
    )
)
QUESTIONS = [
    "List the modules that handle KV transfer.",
    "Which of them decide when a handle expires?",
    "Show the function that trims a handle to a verified prefix.",
    "Summarise what we found so far in three bullet points.",
    "What would break if the block size changed?",
    "Write a test for the expiry margin.",
]


@dataclass
class Row:
    turn: str
    prompt_tokens: int
    decision: str
    reused: int
    ttft_ms: float
    wrong_kv: int


class _Router:
    """The smallest correct router: exact ids, verified handles, P then D."""

    def __init__(self, client: httpx.Client, p: SimProcess, d: SimProcess) -> None:
        self.client, self.p, self.d = client, p, d

    def tokenize_text(self, text: str) -> list[int]:
        body = {"prompt": text, "add_special_tokens": False}
        tokens: list[int] = self.client.post(f"{self.p.url}/tokenize", json=body).json()["tokens"]
        return tokens

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        tokens: list[int] = self.client.post(
            f"{self.p.url}/tokenize", json={"messages": messages}
        ).json()["tokens"]
        return tokens

    def turn(
        self, ids: list[int], handle: dict[str, Any] | None, *, max_tokens: int = 64
    ) -> tuple[dict[str, Any], int, float, int]:
        """One turn: returns (D's response, P's cached tokens, TTFT ms, wrong-KV tokens)."""
        started = time.perf_counter()
        kv: dict[str, Any] = dict(handle) if handle else {"do_remote_decode": True}
        kv["prompt_token_ids"] = ids
        p_body = {
            "messages": [{"role": "user", "content": "-"}],
            "max_tokens": 1,
            "kv_transfer_params": kv,
        }
        p = self.client.post(f"{self.p.url}/v1/chat/completions", json=p_body)
        p.raise_for_status()
        wrong = int(p.headers.get(HEADER_SIM_WRONG_KV_TOKENS, "0"))
        cached = int(p.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        d_kv = dict(p.json()["kv_transfer_params"], prompt_token_ids=ids)
        d_body = {
            "messages": [{"role": "user", "content": "-"}],
            "max_tokens": max_tokens,
            "stream": True,
            "return_token_ids": True,
            "kv_transfer_params": d_kv,
        }
        out: dict[str, Any] = {"token_ids": [], "kv_transfer_params": None}
        ttft = 0.0
        with self.client.stream("POST", f"{self.d.url}/v1/chat/completions", json=d_body) as r:
            r.raise_for_status()
            wrong += int(r.headers.get(HEADER_SIM_WRONG_KV_TOKENS, "0"))
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    if choice.get("token_ids"):
                        if not out["token_ids"]:
                            ttft = (time.perf_counter() - started) * 1000
                        out["token_ids"].extend(choice["token_ids"])
                if chunk.get("kv_transfer_params"):
                    out["kv_transfer_params"] = chunk["kv_transfer_params"]
        return out, cached, ttft, wrong


def _verified(
    handle: dict[str, Any] | None, held: list[int], prompt: list[int]
) -> tuple[dict[str, Any] | None, str]:
    """Trim ``handle`` to the blocks whose tokens the new prompt starts with."""
    if handle is None:
        return None, "miss"
    n = min(handle["remote_num_tokens"], len(held))
    same = 0
    while same < min(n, len(prompt)) and held[same] == prompt[same]:
        same += 1
    k = same // BLOCK
    if same >= n:
        return handle, "pull"
    trimmed = dict(handle)
    trimmed["remote_block_ids"] = [g[:k] for g in handle["remote_block_ids"]]
    trimmed["remote_num_tokens"] = k * BLOCK
    return trimmed, ("trimmed" if k else "release")


def run_demo(*, turns: int = 4, time_scale: float = 1.0, console: Console | None = None) -> int:
    """Run the demo; returns a process exit code (0 when every claim held)."""
    console = console or Console()
    turns = max(2, min(turns, len(QUESTIONS)))
    common = [
        "--preset",
        "qwen3-32b-p5en",
        "--time-scale",
        str(time_scale),
        "--block-size",
        str(BLOCK),
        "--kv-load-failure-policy",
        "recompute",
    ]
    console.print(
        "[bold]agentkv demo[/]: starting a simulated prefill and decode engine on 127.0.0.1 …"
    )
    sims = start_sims(
        [["--role", "prefill", "--no-prefix-caching", *common], ["--role", "decode", *common]]
    )
    p, d = sims
    try:
        with httpx.Client(timeout=60, trust_env=False) as client:
            router = _Router(client, p, d)
            return _script(router, console, turns)
    finally:
        for sim in sims:
            sim.stop()


def _script(router: _Router, console: Console, turns: int) -> int:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    ids = router.tokenize_chat(messages)
    prompts: list[list[int]] = []
    reuse_rows: list[Row] = []
    handle: dict[str, Any] | None = None
    held: list[int] = []
    for t in range(turns):
        prompts.append(ids)
        attach, decision = _verified(handle, held, ids)
        out, cached, ttft, wrong = router.turn(ids, attach)
        reuse_rows.append(Row(f"{t + 1}", len(ids), decision, cached, ttft, wrong))
        handle = out["kv_transfer_params"]
        held = ids + out["token_ids"]
        if t + 1 < turns:
            tail = f"\n<|im_start|>user\n{QUESTIONS[t + 1]}<|im_end|>\n<|im_start|>assistant\n"
            ids = held + router.tokenize_text(tail)

    base_rows = []
    second_handle: dict[str, Any] | None = None
    for t, prompt in enumerate(prompts):
        out, cached, ttft, wrong = router.turn(prompt, None)
        base_rows.append(Row(f"{t + 1}", len(prompt), "recompute", cached, ttft, wrong))
        second_handle = out["kv_transfer_params"]  # same tokens as `held` on the last turn

    # History rewritten: a summary replaces the first exchange; the old handle is stale.
    summary = router.tokenize_chat(
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "(summary) We listed the KV transfer modules."},
        ]
    )
    rewritten = summary + held[len(prompts[1]) :] if len(prompts) > 1 else summary
    # Verified first: the unverified read poisons P's output and then D's prefix cache too.
    attach, _ = _verified(second_handle, held, rewritten)
    _, cached_ok, _, wrong_ok = router.turn(rewritten, attach)
    _, cached_bad, _, wrong_bad = router.turn(rewritten, handle)

    table = Table(title="multi-turn agent, simulated Qwen3-32B 1P1D (P prefix caching off)")
    for col in (
        "turn",
        "prompt tokens",
        "decision",
        "reused tokens",
        "TTFT ms (reuse)",
        "TTFT ms (recompute)",
        "wrong-KV tokens",
    ):
        table.add_column(col, justify="right")
    for a, b in zip(reuse_rows, base_rows, strict=True):
        table.add_row(
            a.turn,
            str(a.prompt_tokens),
            a.decision,
            str(a.reused),
            f"{a.ttft_ms:.0f}",
            f"{b.ttft_ms:.0f}",
            str(a.wrong_kv),
        )
    console.print(table)
    hazard = Table(title="history rewritten (summary), old handle still held by D")
    for col in ("router", "reused tokens", "wrong-KV tokens (P + D)"):
        hazard.add_column(col, justify="right")
    hazard.add_row("verified by token ids (agentkv)", str(cached_ok), f"[green]{wrong_ok}[/]")
    hazard.add_row("unverified (vLLM example proxy)", str(cached_bad), f"[red]{wrong_bad}[/]")
    console.print(hazard)
    later = reuse_rows[1:]
    speedup = sum(b.ttft_ms for b in base_rows[1:]) / max(1e-9, sum(a.ttft_ms for a in later))
    console.print(
        f"turns 2-{turns}: reuse TTFT is {speedup:.1f}x faster than recompute on these engines."
    )
    ok = all(r.wrong_kv == 0 for r in reuse_rows) and wrong_bad > 0 and wrong_ok == 0
    if not ok:
        console.print("[red]demo check failed: wrong-KV counts are not as expected[/]")
    return 0 if ok else 1
