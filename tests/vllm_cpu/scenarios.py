"""Conformance scenarios, run the same way on real vLLM (CPU) and on the simulator.

Each scenario drives agentkv's SDK through agentkv's router and records, per turn, the router's
decision, the tokens P read from D (P's ``external_kv_transfer`` counter) and, on real vLLM,
how far the first token's top-5 logprobs are from a clean recompute of the same prompt.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

import agentkv
from agentkv.promtext import parse_metrics

MODEL = "tiny"
SYSTEM = "You are a meticulous assistant. " + " ".join(
    f"Rule {i}: always answer politely and cite fact number {i}." for i in range(30)
)
EXT = "vllm:prompt_tokens_by_source_total[external_kv_transfer]"


@dataclass
class Turn:
    scenario: str
    turn: int
    decision: str | None
    pulled: int
    prompt_tokens: int
    cached_tokens: int | None
    logprob_diff: float | None = None
    seconds: float = 0.0


@dataclass
class Stack:
    """URLs of one deployment (router, P, D)."""

    router: str
    prefill: str
    decode: str
    real: bool
    records: list[Turn] = field(default_factory=list)
    pending: list[tuple[Turn, list[int], dict[str, float]]] = field(default_factory=list)

    def settle(self) -> None:
        """Compare logprobs with clean recomputes, after the scenario: a reference request
        between turns would delay the next turn towards the handle's TTL."""
        for record, ids, got in self.pending:
            record.logprob_diff = self.recompute_diff(ids, got)
        self.pending.clear()

    def metrics(self, url: str) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)

    def pulled(self) -> float:
        return self.metrics(self.prefill).get(EXT, 0.0)

    def d_blocks_in_use(self) -> float:
        """D's referenced blocks (real vLLM: usage × 32,768 blocks of 1 GiB fp32 tiny model)."""
        m = self.metrics(self.decode)
        if "agentkv_sim_kv_blocks_used" in m:
            return m["agentkv_sim_kv_blocks_used"]
        return round(m.get("vllm:kv_cache_usage_perc", 0.0) * 32768)

    def client(self, router: str | None = None) -> agentkv.Client:
        return agentkv.Client(base_url=f"{router or self.router}/v1", api_key="k", timeout=300)

    def recompute_diff(self, ids: list[int], got: dict[str, float]) -> float | None:
        """Max |Δ logprob| between ``got`` and P's clean recompute of ``ids`` (real vLLM)."""
        if not self.real:
            return None
        body = {
            "model": MODEL,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": 5,
            "cache_salt": uuid.uuid4().hex,
        }
        ref = httpx.post(f"{self.prefill}/v1/completions", json=body, timeout=300).json()
        top = ref["choices"][0]["logprobs"]["top_logprobs"][0]
        common = set(top) & set(got)
        assert len(common) >= 3, (top, got)
        return max(abs(top[k] - got[k]) for k in common)


def turn(stack: Stack, conv: Any, scenario: str, n: int, *, stream: bool = False) -> Turn:
    before, started = stack.pulled(), time.perf_counter()
    kwargs: dict[str, Any] = {
        "max_tokens": 40,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    if stack.real and not stream:
        kwargs |= {"logprobs": True, "top_logprobs": 5}
    got: dict[str, float] = {}
    if stream:
        list(conv.create(stream=True, **kwargs))
    else:
        completion = conv.create(**kwargs)
        if completion.choices[0].logprobs is not None:
            got = {
                t.token: t.logprob for t in completion.choices[0].logprobs.content[0].top_logprobs
            }
    receipt = conv.last_receipt
    record = Turn(
        scenario,
        n,
        receipt.decision,
        int(stack.pulled() - before),
        receipt.prompt_tokens,
        receipt.cached_tokens,
        None,
        time.perf_counter() - started,
    )
    if got:
        stack.pending.append((record, conv._ledger.last_prompt_ids or [], got))
    stack.records.append(record)
    return record


def six_turns(stack: Stack) -> list[Turn]:
    with stack.client() as c:
        conv = c.conversation(model=MODEL, system=f"[six-turns] {SYSTEM}")
        out = []
        for i in range(6):
            conv.add_user(f"Question {i}: explain P/D disaggregation.")
            out.append(turn(stack, conv, "six-turns", i + 1))
    stack.settle()
    return out


def rewrite(stack: Stack, router: str | None = None, name: str = "rewrite") -> list[Turn]:
    """Three SDK turns, then a client that rewrites the history (a summary replaces the first
    exchange) without saying so (same conversation id, same epoch): the router has to notice by
    token ids. Then the rewritten prompt once more with no handle at all (is D's prefix cache
    clean?)."""
    base = router or stack.router
    with stack.client(base) as c:
        conv = c.conversation(model=MODEL, system=f"[{name}] {SYSTEM}")
        out = []
        for i in range(3):
            conv.add_user(f"Question {i}: explain KV reuse.")
            out.append(turn(stack, conv, name, i + 1))
        msgs = conv.messages
    summary = [
        msgs[0],
        {"role": "user", "content": "Summary: we discussed KV reuse."},
        *msgs[-2:],
        {"role": "user", "content": "Go on."},
    ]
    ids = httpx.post(
        f"{base}/tokenize", json={"model": MODEL, "messages": summary}, timeout=60
    ).json()["tokens"]
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": summary,
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "kv_transfer_params": {"prompt_token_ids": ids},
    }
    if stack.real:
        body |= {"logprobs": True, "top_logprobs": 5}
    before, started = stack.pulled(), time.perf_counter()
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json=body,
        timeout=300,
        headers={"X-Conversation-Id": conv.id, "X-AgentKV-Epoch": "0"},
    )
    assert r.status_code == 200, r.text
    data = r.json()
    usage = data["usage"]
    record = Turn(
        name,
        4,
        r.headers.get("x-agentkv-decision"),
        int(stack.pulled() - before),
        usage["prompt_tokens"],
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        None,
        time.perf_counter() - started,
    )
    stack.settle()
    if stack.real:
        top = {
            t["token"]: t["logprob"]
            for t in data["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        }
        record.logprob_diff = stack.recompute_diff(ids, top)
    stack.records.append(record)
    out.append(record)
    if stack.real:
        again = httpx.post(
            f"{stack.decode}/v1/completions",
            json={"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 5},
            timeout=300,
        ).json()
        diff = stack.recompute_diff(ids, again["choices"][0]["logprobs"]["top_logprobs"][0])
        stack.records.append(Turn(name, 5, "no handle (D)", 0, len(ids), None, diff))
        out.append(stack.records[-1])
    return out


def early_release(stack: Stack) -> tuple[float, float, float]:
    """D's pinned blocks: holding one turn, after a stale turn (old released, new held)."""
    with stack.client() as c:
        conv = c.conversation(model=MODEL, system=f"[early-release] {SYSTEM}")
        base = stack.d_blocks_in_use()
        conv.add_user("Hello.")
        turn(stack, conv, "early-release", 1)
        held = stack.d_blocks_in_use()
        conv.strip_reasoning()  # epoch moves on: the handle is released, not read
        conv.add_user("After the rewrite.")
        turn(stack, conv, "early-release", 2)
        time.sleep(1.0)
        after = stack.d_blocks_in_use()
        conv.close()
    stack.settle()
    return base, held, after


def after_ttl(stack: Stack, wait_s: float) -> Turn:
    with stack.client() as c:
        conv = c.conversation(model=MODEL, system=f"[after-ttl] {SYSTEM}")
        conv.add_user("Hello.")
        turn(stack, conv, "after-ttl", 1)
        time.sleep(wait_s)
        conv.add_user("Back after a long pause.")
        late = turn(stack, conv, "after-ttl", 2)
    stack.settle()
    return late


def streaming(stack: Stack) -> list[Turn]:
    with stack.client() as c:
        conv = c.conversation(model=MODEL, system=f"[streaming] {SYSTEM}")
        out = []
        for i in range(3):
            conv.add_user(f"Streamed question {i}.")
            out.append(turn(stack, conv, "streaming", i + 1, stream=True))
        return out


def dump(records: list[Turn]) -> str:
    return json.dumps([asdict(r) for r in records], indent=1)
