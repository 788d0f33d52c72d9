"""Conversations for the router data-plane benchmark: prompts of a chosen length, turns in each API.

A conversation is ``TURNS`` turns; each next prompt is the history, the answer and a new question,
so turns 2 on can pull the last turn's KV from D. Its first prompt is about ``length`` tokens: a
system prompt unique to the conversation, then a filler of words (one token each for the
simulator's Qwen3 vocabulary) shared by every conversation of that length. The same
conversation is sent as

* ``chat``: Chat Completions messages (``X-Conversation-Id``; the body's ``conversation_id``
  too, which vLLM's example proxy keys on);
* ``exact``: the same with ``kv_transfer_params.prompt_token_ids`` and ``return_token_ids``, as
  agentkv's SDK sends them (the ids are built without a tokenizer in the client: a rendered
  prefix, ids unique to the conversation, the filler's ids, each turn's answer ids and a
  rendered question; the engines take ids as given);
* ``pd``: the client itself sends the exact ids to P then D, keeping D's handle;
* ``messages``: Anthropic Messages (``POST /v1/messages``, system and content as blocks, as
  Claude Code sends them; ``X-Conversation-Id``);
* ``responses``: OpenAI Responses as Codex sends it: ``store: false``, the whole input every
  turn (input and output text parts), the conversation's id as ``prompt_cache_key``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from benchmarks._loadgen import Connection
from benchmarks._relay_floor import PREFILL as PREFILL_PARAMS

MODEL = "sim"
TURNS = 8
CHAT = "/v1/chat/completions"
PATHS = {"messages": "/v1/messages", "responses": "/v1/responses"}
WORDS = [
    *("agents", "resend", "their", "whole", "growing", "history", "every"),
    *("turn", "so", "the", "prefix", "matters", "a", "lot"),
]
NO_THINKING = {"enable_thinking": False}


@dataclass(frozen=True)
class Workload:
    key: str
    name: str
    stream: bool
    max_tokens: int


STREAMED = Workload("stream", "streamed, 128 tokens", True, 128)
PLAIN = Workload("plain", "non-streamed, 8 tokens", False, 8)


@dataclass
class Target:
    key: str
    name: str
    url: str
    kind: str
    """``chat``, ``exact``, ``pd``, ``messages`` or ``responses`` (see the module's doc)."""
    pid: int | None = None


def system_prompt(cell: str, i: int) -> str:
    return (
        f"You are coding agent {i} of run {cell}. You work in a repository with a router, a "
        "store and a simulator. Answer briefly and name the files you touch."
    )


def question(turn: int) -> str:
    return f"Step {turn}: which file should change next, and why?"


def filler(words: int) -> str:
    return " ".join(WORDS[k % len(WORDS)] for k in range(words))


class Material:
    """What the conversations of one prompt length are made of (``length`` 0: the short
    conversations of the concurrency sweep, a system prompt of about 40 tokens)."""

    def __init__(self, p_url: str, d_url: str, length: int) -> None:
        self.p_url, self.d_url, self.length = p_url, d_url, length
        self.base = self._tok({"messages": [{"role": "system", "content": "x" * 200}]})
        self.suffix = [
            self._tok(
                {
                    "prompt": f"<|im_end|>\n<|im_start|>user\n{question(t)}<|im_end|>\n"
                    "<|im_start|>assistant\n",
                    "add_special_tokens": False,
                }
            )
            for t in range(TURNS)
        ]
        self.filler_text, self.filler_ids = "", []
        want = length - len(self.base) - 8 - len(self.suffix[0])
        if want > 0:
            words = want
            for _ in range(3):  # the filler's words are one token each; check, adjust once
                text = filler(words)
                ids = self._tok({"prompt": " " + text, "add_special_tokens": False})
                if len(ids) == want:
                    break
                words = max(1, round(words * want / len(ids)))
            self.filler_text, self.filler_ids = text, ids
        self.exact_tokens = len(self.first("probe", 0))
        """Tokens of a first prompt in exact ids."""
        messages = [
            {"role": "system", "content": self.system("probe", 0)},
            {"role": "user", "content": question(0)},
        ]
        self.chat_tokens = len(
            self._tok({"messages": messages, "chat_template_kwargs": NO_THINKING})
        )
        """Tokens of a first prompt as P renders the chat messages."""

    def _tok(self, body: dict[str, Any]) -> list[int]:
        r = httpx.post(
            f"{self.p_url}/tokenize", json={"model": MODEL, **body}, timeout=120, trust_env=False
        )
        r.raise_for_status()
        return [int(t) for t in r.json()["tokens"]]

    def system(self, cell: str, i: int) -> str:
        head = system_prompt(cell, i)
        return f"{head} {self.filler_text}" if self.filler_text else head

    def first(self, cell: str, i: int) -> list[int]:
        seed = hash((cell, i)) & 0xFFFFFFFF
        unique = [1000 + (seed >> (4 * k)) % 60000 for k in range(8)]
        return [*self.base, *unique, *self.filler_ids, *self.suffix[0]]


@dataclass
class Stats:
    latencies: list[float] = field(default_factory=list)
    ttfb: list[float] = field(default_factory=list)
    decisions: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)


# -- bodies and answers ----------------------------------------------------------------------------


def _blocks(text: str, kind: str = "text") -> list[dict[str, Any]]:
    return [{"type": kind, "text": text}]


def messages_body(messages: list[dict[str, Any]], wl: Workload) -> dict[str, Any]:
    """Anthropic Messages, the way Claude Code sends a turn (system and content as blocks)."""
    return {
        "model": MODEL,
        "system": _blocks(messages[0]["content"]),
        "messages": [{"role": m["role"], "content": _blocks(m["content"])} for m in messages[1:]],
        "max_tokens": wl.max_tokens,
        "stream": wl.stream,
        "chat_template_kwargs": NO_THINKING,
    }


def responses_body(messages: list[dict[str, Any]], wl: Workload, cid: str) -> dict[str, Any]:
    """OpenAI Responses, the way Codex sends a turn: stateless, the whole input every time."""
    items = [
        {
            "type": "message",
            "role": m["role"],
            "content": _blocks(
                m["content"], "output_text" if m["role"] == "assistant" else "input_text"
            ),
        }
        for m in messages[1:]
    ]
    return {
        "model": MODEL,
        "instructions": messages[0]["content"],
        "input": items,
        "max_output_tokens": wl.max_tokens,
        "stream": wl.stream,
        "store": False,
        "prompt_cache_key": cid,
        "chat_template_kwargs": NO_THINKING,
    }


def _events(data: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: {")]


def content(data: bytes, stream: bool, kind: str) -> str:
    """The answer's text, from any of the APIs' answers; raises when the answer did not end as
    its API says a complete answer ends."""
    if kind == "messages":
        if not stream:
            return "".join(b.get("text") or "" for b in orjson.loads(data)["content"])
        events = _events(data)
        if not any(e.get("type") == "message_stop" for e in events):
            raise RuntimeError(f"no message_stop: {data[-300:]!r}")
        return "".join(
            e["delta"].get("text") or ""
            for e in events
            if e.get("type") == "content_block_delta" and e["delta"].get("type") == "text_delta"
        )
    if kind == "responses":
        if not stream:
            answer = orjson.loads(data)
            return "".join(
                part.get("text") or ""
                for item in answer.get("output") or []
                if item.get("type") == "message"
                for part in item.get("content") or []
            )
        events = _events(data)
        if not any(e.get("type") in ("response.completed", "response.incomplete") for e in events):
            raise RuntimeError(f"no response.completed: {data[-300:]!r}")
        return "".join(
            e.get("delta") or "" for e in events if e.get("type") == "response.output_text.delta"
        )
    if not stream:
        return str(orjson.loads(data)["choices"][0]["message"].get("content") or "")
    return "".join(
        (choice.get("delta") or {}).get("content") or ""
        for e in _events(data)
        for choice in e.get("choices") or []
    )


def out_ids(data: bytes) -> list[int]:
    """The output token ids of a chat answer (``"token_ids"``, not the prompt's echo)."""
    out: list[int] = []
    at = 0
    while (at := data.find(b'"token_ids":[', at)) >= 0:
        at += 13
        close = data.index(b"]", at)
        if close > at:
            out.extend(int(x) for x in data[at:close].split(b","))
    return out


def d_handle(data: bytes, stream: bool) -> dict[str, Any] | None:
    if not stream:
        return orjson.loads(data).get("kv_transfer_params")  # type: ignore[no-any-return]
    for line in data.split(b"\n"):
        if b'"kv_transfer_params":{' in line:
            return orjson.loads(line[6:])["kv_transfer_params"]  # type: ignore[no-any-return]
    return None


# -- driving -----------------------------------------------------------------------------------


async def conversation(
    conns: list[Connection],
    i: int,
    t: Target,
    wl: Workload,
    cell: str,
    mat: Material,
    st: Stats,
    turns: int = TURNS,
) -> None:
    """One conversation of ``turns`` turns to ``t``; ``conns``: the target, P, D."""
    loop = asyncio.get_running_loop()
    cid = f"{cell}-{i}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": mat.system(cell, i)},
        {"role": "user", "content": question(0)},
    ]
    ids = mat.first(cell, i)
    handle: dict[str, Any] | None = None
    headers = {"X-Conversation-Id": cid}
    for turn in range(turns):
        path = PATHS.get(t.kind, CHAT)
        if t.kind == "messages":
            body = messages_body(messages, wl)
        elif t.kind == "responses":
            body = responses_body(messages, wl, cid)
        else:
            body = {
                "model": MODEL,
                "messages": messages,
                "max_tokens": wl.max_tokens,
                "chat_template_kwargs": NO_THINKING,
            }
            if wl.stream:
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
        t0 = loop.time()
        conn = conns[0]
        if t.kind == "pd":
            params = (
                dict(handle, do_remote_decode=True, do_remote_prefill=False) if handle else None
            )
            p_body = {
                "model": MODEL,
                "prompt": ids,
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": params or PREFILL_PARAMS,
            }
            status, _, data = await conns[1].post("/v1/completions", orjson.dumps(p_body))
            if status != 200:
                raise RuntimeError(f"P answered {status}: {data[:200]!r}")
            p_params = orjson.loads(data)["kv_transfer_params"]
            body["kv_transfer_params"] = dict(p_params, prompt_token_ids=ids)
            body["return_token_ids"] = True
            conn = conns[2]
            status, hdrs, data = await conn.post(CHAT, orjson.dumps(body))
        elif t.kind == "responses":
            status, hdrs, data = await conn.post(path, orjson.dumps(body))
        else:
            if t.kind != "messages":
                body["conversation_id"] = cid
            if t.kind == "exact":
                body["kv_transfer_params"] = {"prompt_token_ids": ids}
                body["return_token_ids"] = True
            status, hdrs, data = await conn.post(path, orjson.dumps(body), headers)
        elapsed = loop.time() - t0
        if status != 200:
            raise RuntimeError(f"{t.name} answered {status}: {data[:200]!r}")
        text = content(data, wl.stream, t.kind)
        st.latencies.append(elapsed)
        st.ttfb.append(conn.first_byte_at - t0)
        st.decisions[hdrs.get("x-agentkv-decision", "—")] += 1
        if t.kind in ("exact", "pd"):
            out = out_ids(data)
            if not out:
                raise RuntimeError(f"{t.name}: no token ids in the answer")
            ids = [*ids, *out, *mat.suffix[(turn + 1) % TURNS]]
        if t.kind == "pd":
            handle = d_handle(data, wl.stream)
        messages = [
            *messages,
            {"role": "assistant", "content": text},
            {"role": "user", "content": question(turn + 1)},
        ]


async def drive(
    t: Target,
    wl: Workload,
    concurrency: int,
    conversations: int,
    cell: str,
    mat: Material,
    turns: int = TURNS,
) -> tuple[Stats, float]:
    """``conversations`` conversations to ``t``, ``concurrency`` at a time (closed loop)."""
    st = Stats()
    counter = iter(range(conversations))

    async def worker() -> None:
        conns = [Connection(t.url), Connection(mat.p_url), Connection(mat.d_url)]
        try:
            for i in counter:
                try:
                    await conversation(conns, i, t, wl, cell, mat, st, turns)
                except Exception as exc:
                    st.failures.append(f"{type(exc).__name__}: {exc}"[:300])
                    for c in conns:
                        await c.close()
        finally:
            for c in conns:
                await c.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return st, time.perf_counter() - started
