"""Conformance scenarios, run the same way on real vLLM (CPU) and on the simulator.

Each scenario drives agentkv's SDK through agentkv's router and records, per turn, the router's
decision, the tokens P read from D (P's ``external_kv_transfer`` counter), what the receipt says
P read, and, on real vLLM, how far the first token's top-5 logprobs are from a clean recompute of
the same prompt.

P caches its prompts (prefix caching on), so what a later turn can read from D is the previous
answer plus the previous prompt's partial last block: answers are forced to ``OUT`` = 72 tokens,
so that this clears ``kv_recompute_threshold`` (64) on every turn.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

import agentkv
from agentkv.protocol.promtext import parse_metrics
from agentkv.serve import expand, load_profile
from agentkv.serve.supervisor import start_router
from tests._support.router_config import router_data

MODEL = "tiny"
SYSTEM = "You are a meticulous assistant. " + " ".join(
    f"Rule {i}: always answer politely and cite fact number {i}." for i in range(30)
)
EXT = "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
OUT = 72
VLLM_VERSION = "0.33.0"


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
    reused: int | None = None
    """``X-AgentKV-Reused-Tokens``: what the receipt says P read from D."""
    stream_spread_s: float | None = None
    """Streamed turns: seconds between the first and the last chunk the client got."""


# What the tier's tests record, for the agreement test and docs/conformance.md.
RESULTS: dict[str, dict[str, list[Turn]]] = {"vllm": {}, "sim": {}}
ROWS: list[tuple[str, Turn, Turn]] = []
SHAPES: dict[tuple[str, str], list[str]] = {}
"""(endpoint, "P"/"D") → the chunk layout both engines share."""
TEMPLATE_RUNS: dict[str, tuple[str, int, str]] = {}
"""template → (result, turns run, the router's decisions)."""
TIMINGS: dict[str, float] = {}
"""``stack_ready_s`` (cpu-tiny started until the router answers), ``tier_s`` (the session)."""
TEMPLATE_PULLED: list[int] = []
"""Tokens P read from D over all the template conversations (its counter)."""
API_TURNS: dict[str, list[Turn]] = {}
"""``messages`` / ``responses`` → the turns of test_apis.py's conversation."""
API_PROMPTS: dict[str, tuple[int, int, bool, int, int, float | None]] = {}
"""``messages`` / ``responses`` → (ids the router sent P, ids vLLM's render endpoint gave, equal,
prompt tokens vLLM's own endpoint ran, of the router's ids found in P's cache after it, Δ logprob
of its first token against a clean recompute of the router's ids (Responses))."""


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

    def wait_decode_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        time.sleep(0.5)
        while time.monotonic() < deadline:
            if self.metrics(self.decode).get("vllm:num_requests_running", 0.0) == 0.0:
                break
            time.sleep(0.5)
        time.sleep(1.0)  # the router stores what D returned

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
        if not common:  # wrong KV can change the whole top 5
            return float("inf")
        return max(abs(top[k] - got[k]) for k in common)


def router_on(real: Stack, tmp: Path, **options: object) -> Iterator[str]:
    """A second router on the real engines (cpu-tiny's settings, ``paths.mode = "pull"`` as
    the tier's main router, plus ``options``: groups, merged key by key)."""
    config = dict(
        expand(
            load_profile(
                "cpu-tiny", environ={"AGENTKV_VLLM_BIN": "x", "AGENTKV_CPU_TINY_MODEL": "x"}
            )
        ).router_config
    )
    pull = {"paths": {"mode": "pull"}}
    with start_router(router_data(config, pull, options), workdir=tmp) as router:
        yield router.url


def turn(stack: Stack, conv: Any, scenario: str, n: int, *, stream: bool = False) -> Turn:
    before, started = stack.pulled(), time.perf_counter()
    kwargs: dict[str, Any] = {
        "max_tokens": OUT,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    if stack.real and not stream:
        kwargs |= {"logprobs": True, "top_logprobs": 5}
    got: dict[str, float] = {}
    spread = None
    if stream:
        arrivals = [time.perf_counter() for _ in conv.create(stream=True, **kwargs)]
        spread = arrivals[-1] - arrivals[0]
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
        receipt.reused_tokens,
        spread,
    )
    if got:
        stack.pending.append((record, conv._ledger.last_prompt_ids or [], got))
    stack.records.append(record)
    return record


def ask(
    stack: Stack, conv: Any, scenario: str, questions: Sequence[str], *, stream: bool = False
) -> list[Turn]:
    """One :func:`turn` per question, numbered from 1."""
    out = []
    for n, question in enumerate(questions, 1):
        conv.add_user(question)
        out.append(turn(stack, conv, scenario, n, stream=stream))
    return out


def six_turns(stack: Stack) -> list[Turn]:
    with stack.client() as c:
        conv = c.conversation(model=MODEL, system=f"[six-turns] {SYSTEM}")
        questions = [f"Question {i}: explain P/D disaggregation." for i in range(6)]
        out = ask(stack, conv, "six-turns", questions)
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
        out = ask(stack, conv, name, [f"Question {i}: explain KV reuse." for i in range(3)])
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
        "max_tokens": OUT,
        "temperature": 0,
        "ignore_eos": True,
        "kv_transfer_params": {"prompt_token_ids": ids},
    }
    record, _, top = post_turn(stack, base, body, name, 4, conv.id, 0)
    stack.settle()
    if top is not None:
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
        return ask(
            stack, conv, "streaming", [f"Streamed question {i}." for i in range(3)], stream=True
        )


def _int(value: str | None) -> int | None:
    return None if value is None else int(value)


def tail_ids(base: str, user: str) -> list[int]:
    """The Qwen3 template's ids after an answer cut by max_tokens: end of turn, a user message,
    the assistant's header (what exact mode appends)."""
    text = f"<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    r = httpx.post(
        f"{base}/tokenize",
        json={"model": MODEL, "prompt": text, "add_special_tokens": False},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["tokens"]
    return tokens


def raw_turn(
    stack: Stack, name: str, n: int, conv_id: str, epoch: int, ids: list[int]
) -> tuple[Turn, list[int]]:
    """One chat turn sent by hand (exact ids, the given epoch); returns it and its output ids."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "(exact ids)"}],
        "max_tokens": OUT,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "kv_transfer_params": {"prompt_token_ids": ids},
    }
    record, data, top = post_turn(stack, stack.router, body, name, n, conv_id, epoch)
    if top is not None:
        stack.pending.append((record, ids, top))
    stack.records.append(record)
    return record, list(data["choices"][0]["token_ids"])


def post_turn(
    stack: Stack, base: str, body: dict[str, Any], name: str, n: int, conv_id: str, epoch: int
) -> tuple[Turn, dict[str, Any], dict[str, float] | None]:
    """Send a hand-made chat turn through the router at ``base``: its Turn (no logprob diff
    yet), the response body, and (real engine) the first token's top logprobs."""
    if stack.real:
        body |= {"logprobs": True, "top_logprobs": 5}
    before, started = stack.pulled(), time.perf_counter()
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json=body,
        timeout=300,
        headers={"X-Conversation-Id": conv_id, "X-AgentKV-Epoch": str(epoch)},
    )
    assert r.status_code == 200, r.text
    data = r.json()
    usage = data["usage"]
    record = Turn(
        name,
        n,
        r.headers.get("x-agentkv-decision"),
        int(stack.pulled() - before),
        usage["prompt_tokens"],
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        None,
        time.perf_counter() - started,
        _int(r.headers.get("x-agentkv-reused-tokens")),
    )
    if not stack.real:
        return record, data, None
    top = {
        t["token"]: t["logprob"]
        for t in data["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    }
    return record, data, top


def new_epoch(stack: Stack) -> list[Turn]:
    """Two SDK turns, then a turn that announces a rewrite (epoch 1) while its history is
    intact, token for token: issue 11 verifies handles whatever the epoch, so it pulls."""
    with stack.client() as c:
        conv = c.conversation(model=MODEL, system=f"[new-epoch] {SYSTEM}")
        out = ask(
            stack, conv, "new-epoch", [f"Question {i}: what survives a rewrite?" for i in range(2)]
        )
        ids = [*conv.token_ids, *tail_ids(stack.router, "After the rewrite.")]
        record, _ = raw_turn(stack, "new-epoch", 3, conv.id, 1, ids)
        out.append(record)
    stack.settle()
    return out


def branches(stack: Stack) -> list[Turn]:
    """Two branches on one conversation id (two agents on one thread), turns interleaved:
    A1 B1 A2 B2 A3 B3. With K handles per conversation each branch keeps its own."""
    conv_id = f"branches-{uuid.uuid4().hex[:8]}"
    with stack.client() as c:
        convs = {
            name: c.conversation(model=MODEL, system=f"[branches] {SYSTEM}", id=conv_id)
            for name in ("A", "B")
        }
        out = []
        for i in range(3):
            for name, conv in convs.items():
                conv.add_user(f"Branch {name}, question {i}: which handle is mine?")
                out.append(turn(stack, conv, f"branch-{name}", i + 1))
    stack.settle()
    return out


def dropped_stream(stack: Stack) -> list[Turn]:
    """A streamed turn the client drops after two chunks, then the same turn again. Issue 11:
    the router reads D to the end, keeps D's handle, and the resent turn finds it (P holds the
    resent prompt itself, so it reads little or nothing: not ``miss``); the turn after pulls."""
    with stack.client() as c:
        conv = c.conversation(model=MODEL, system=f"[dropped-stream] {SYSTEM}")
        conv.add_user("Hello.")
        out = [turn(stack, conv, "dropped-stream", 1)]
        conv.add_user("A question whose answer the client will not wait for.")
        stream = conv.create(
            stream=True, max_tokens=OUT, temperature=0, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        next(chunks)
        next(chunks)
        stream.close()
        stack.wait_decode_idle()  # D finishes (or aborts) the answer
        out.append(turn(stack, conv, "dropped-stream", 2))
        conv.add_user("And after that?")
        out.append(turn(stack, conv, "dropped-stream", 3))
    stack.settle()
    return out


def dump(records: list[Turn]) -> str:
    return json.dumps([asdict(r) for r in records], indent=1)
