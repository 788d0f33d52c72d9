"""Replay sessions through raw HTTP clients (``--client chat|messages|responses``): the same
scripted turns the SDK replays, sent as a client that knows nothing of agentkv would send them
(:mod:`agentkv.bench.wire`).

**Tool rounds.** Where the trace's answer ended in a tool call and the next request brings the
tool's result, the scripted answer ends with a call (:data:`~agentkv.bench.wire.TOOL_CALL`) and
the next turn's new tokens go back as that call's result (a ``tool`` message, a
``tool_result`` block, a ``function_call_output`` item); a compaction that keeps a call but not
its result regenerates the result. Everything else is what the SDK sends: the same words in the
same messages.

**The ideal.** A raw client sees no token ids, so the driver measures apart from the client's
traffic, after each session, with the server's ``/tokenize``: the prompt of the SDK's exact mode
for the same history (:func:`~agentkv.bench.wire.shadow`: each answer the client sent back
unchanged as the model generated it, every other message, an answer the client changed
included, as the client sent it, rendered by the replay's template), and what D held from the
previous turn (that prompt + the generated ids, the answer's text re-tokenized: exact on the
simulator, whose answers are tokenized text; where its count differs from the answer's, the ids
count as unknown and match nothing). The ideal is then the SDK's rule on those ids, so a raw
client reads back the ideal only where the router keeps the token identity the client cannot
(an unchanged answer re-rendered without its tool call or empty think block is trimmed, cause
``drift``, or leaves D holding less of the next prompt). ``ideal_generated_tokens`` is the same
rule with the changed answers as generated too (their tool calls, which a template that writes
only text drops): what no client can be given, reported apart.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx

from agentkv.bench.replay_records import (
    Policy,
    ReplaySettings,
    SessionScript,
    TurnRecord,
    ideal_tokens,
    session_done,
    start_record,
)
from agentkv.bench.wire import (
    TOOL_CALL,
    Answer,
    Codec,
    Message,
    RawClientName,
    Turn,
    WireError,
    same_answer,
    shadow,
    sse_events,
    strip_reasoning,
)
from agentkv.bench.wire_codecs import codec_for
from agentkv.protocol import (
    HEADER_DECISION,
    HEADER_REUSED_TOKENS,
    HEADER_VERIFIED_PREFIX_TOKENS,
)

__all__ = ["RawClients"]

_TOOL_ALLOWANCE = 48
"""More ``max_tokens`` for a raw client's answer: a tool call, an empty think block."""
_EMPTY_THINK = "<think></think>"


@dataclass
class _Sent:
    """One answered turn, for the ideal measured after the session."""

    record: TurnRecord
    history: list[Message]
    """The history the request carried."""
    returned: list[Message | None]
    """Per message of ``history``: the answer as the engine returned it, when the client sent
    it back unchanged (:func:`~agentkv.bench.wire.same_answer`); None otherwise."""
    gen: list[int] | None
    """The generated ids (the answer's text re-tokenized), None when unknown."""
    completion_tokens: int


def _tool_turns(script: SessionScript) -> set[int]:
    """Turns whose scripted answer ends in a tool call: the trace's did, and the next request
    brings the tool's result without rewriting the history."""
    turns = script.turns
    return {
        k
        for k in range(len(turns) - 1)
        if turns[k].trace.tool_call
        and turns[k + 1].keep is None
        and turns[k + 1].trace.kind == "tool_result"
    }


def _added(history: list[Message], role: str, text: str) -> Message:
    """A new message: a user message after an answer that called a tool is its result."""
    last = history[-1] if history else None
    if role == "user" and last is not None and last.role == "assistant" and last.calls:
        return Message("tool", text, call_id=last.calls[0].id)
    if role == "system":
        return Message("system", text)
    return Message("user", text)


def _header_int(headers: dict[str, str], name: str) -> int:
    value = headers.get(name.lower())
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0


class RawClients:
    """The raw HTTP client of one policy's run: one connection pool for every session."""

    def __init__(
        self, client: RawClientName, base_url: str, api_key: str, settings: ReplaySettings
    ) -> None:
        self.codec: Codec = codec_for(client)
        self.client_name = client
        self.base_url = base_url.rstrip("/")
        self.root = self.base_url.removesuffix("/v1")
        self.api_key, self.settings = api_key, settings
        conns = 2 * max(8, settings.concurrency)
        self.http = httpx.AsyncClient(
            timeout=settings.request_timeout_s,
            trust_env=False,
            limits=httpx.Limits(max_connections=conns),
        )

    async def __aenter__(self) -> RawClients:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    # -- measurement (not the client's traffic) -------------------------------------------------
    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        url = f"{self.root}/tokenize"
        r = await self.http.post(url, json={"model": self.settings.model, **body})
        if r.status_code != 200:
            raise WireError(f"/tokenize: {r.status_code} {r.text[:200]}")
        return [int(t) for t in r.json()["tokens"]]

    async def _generated(self, answer: Answer) -> tuple[str | None, list[int] | None]:
        """The text the model generated and its ids, when the answer's token count confirms
        them (the stop token, when there is one, not among the ids)."""
        raw = answer.message().raw or ""
        candidates = [raw] if answer.reasoning is not None else [raw, _EMPTY_THINK + raw]
        for text in candidates:
            ids = await self._tokenize({"prompt": text, "add_special_tokens": False})
            if len(ids) + 1 == answer.completion_tokens:
                return text, ids
            if len(ids) == answer.completion_tokens:  # no stop token (max_tokens)
                return text, ids[:-1]
        return None, None

    async def _prompt_ids(
        self, history: Sequence[Message], returned: Sequence[Message | None], changed: bool
    ) -> list[int]:
        return await self._tokenize(
            {
                "messages": shadow(history, returned, changed_as_generated=changed),
                "add_generation_prompt": True,
                "chat_template_kwargs": dict(self.settings.chat_template_kwargs),
            }
        )

    async def _ideals(self, sent: Sequence[_Sent]) -> None:
        """Fill each turn's prompt, held, common prefix and ideal on exact-mode ids: every
        answer the client sent back unchanged as generated, every other message as sent
        (``ideal_tokens``); and with every answer as generated, changed ones too
        (``ideal_generated_tokens``: more only where the template renders a changed answer
        otherwise than the model wrote it, e.g. without its tool call)."""
        held: list[int] = []
        held_all: list[int] = []
        unknown = -1
        for s in sent:
            rec = s.record
            try:
                prompt = await self._prompt_ids(s.history, s.returned, False)
                changed = any(
                    m.role == "assistant" and r is None
                    for m, r in zip(s.history, s.returned, strict=True)
                )
                every = await self._prompt_ids(s.history, s.returned, True) if changed else prompt
            except (httpx.HTTPError, WireError, ValueError, KeyError) as exc:
                rec.record_error(exc, "ideal: ")
                return
            if held:
                ideal, lcp = ideal_tokens(prompt, held, self.settings.block_size)
                rec.lcp_tokens, rec.reusable_tokens = lcp, ideal
                rec.ideal_tokens = ideal if rec.within_ttl else 0
                generated, _ = ideal_tokens(every, held_all, self.settings.block_size)
                rec.ideal_generated_tokens = generated if rec.within_ttl else 0
            rec.held_tokens = len(held)
            if s.gen is not None:
                tail = s.gen
            else:
                n = max(0, s.completion_tokens - 1)
                tail = list(range(unknown, unknown - n, -1))
                unknown -= n
            held, held_all = prompt + tail, every + tail

    # -- one session ---------------------------------------------------------------------------
    async def run_session(
        self,
        script: SessionScript,
        policy: Policy,
        salt: str,
        t0: float,
        on_turn: Callable[[TurnRecord], None],
    ) -> list[TurnRecord]:
        settings, codec = self.settings, self.codec
        base_id = f"bench-{policy}-{script.id}-{uuid.uuid4().hex[:8]}"
        device = uuid.uuid4().hex
        tools = _tool_turns(script)
        history: list[Message] = []
        returned: list[Message | None] = []
        """Per message: the answer as the engine returned it while the client keeps it so."""
        sent: list[_Sent] = []
        records: list[TurnRecord] = []
        answered = time.perf_counter()
        tool_wait = False
        for turn in script.turns:
            rec = start_record(
                policy, script.id, turn, settings, tool_wait=tool_wait, client=self.client_name
            )
            gap_real = rec.gap_real_s
            wait = answered + gap_real - time.perf_counter()
            if turn.index and wait > 0:
                await asyncio.sleep(wait)
            if turn.keep is not None:
                history, returned = history[: turn.keep], returned[: turn.keep]
            elif turn.strip:
                history = strip_reasoning(history)
                returned = [
                    r if r is not None and same_answer(r, m) else None
                    for m, r in zip(history, returned, strict=True)
                ]
            for m in turn.add:
                history.append(_added(history, m.role, m.content))
                returned.append(None)
            session = base_id if policy != "none" else f"{base_id}-t{turn.index}"
            sim: dict[str, Any] = dict(turn.sim_script)
            if turn.index in tools:
                sim["tool_calls"] = [TOOL_CALL]
            request = Turn(
                model=settings.model,
                session=session,
                max_tokens=turn.output_tokens + settings.extra_output_tokens + _TOOL_ALLOWANCE,
                script=sim,
                salt=salt,
                api_key=self.api_key,
                chat_template_kwargs=settings.chat_template_kwargs,
                device=device,
            )
            rec.started_s = time.perf_counter() - t0
            started = time.perf_counter()
            try:
                answer, headers = await self._send(codec, history, request, rec, started)
                answered = time.perf_counter()
                text, gen = await self._generated(answer)
            except (httpx.HTTPError, WireError, ValueError, KeyError, TypeError) as exc:
                rec.record_error(exc)
                records.append(rec)
                on_turn(rec)
                break
            rec.latency_ms = (answered - started) * 1000
            rec.prompt_tokens = answer.prompt_tokens
            rec.output_tokens = answer.completion_tokens
            rec.read_reuse(headers.get(HEADER_DECISION.lower(), ""), answer.cached_tokens)
            rec.router_reused_tokens = _header_int(headers, HEADER_REUSED_TOKENS)
            rec.verified_tokens = _header_int(headers, HEADER_VERIFIED_PREFIX_TOKENS)
            rec.read_headers(headers)
            # what D holds for the next turn: the prompt it ran and the answer but its last token
            rec.generated_known = gen is not None
            rec.retained_blocks = math.ceil(
                max(0, rec.prompt_tokens + rec.output_tokens - 1) / settings.block_size
            )
            sent.append(_Sent(rec, list(history), list(returned), gen, answer.completion_tokens))
            history.append(replace(answer.message(), raw=text))
            returned.append(history[-1])
            tool_wait = turn.trace.tool_call
            records.append(rec)
            on_turn(rec)
        await self._ideals(sent)
        return session_done(records, settings, script)

    async def _send(
        self,
        codec: Codec,
        history: Sequence[Message],
        request: Turn,
        rec: TurnRecord,
        started: float,
    ) -> tuple[Answer, dict[str, str]]:
        headers, body = codec.request(history, request)
        url = self.base_url + codec.path
        async with self.http.stream("POST", url, json=body, headers=headers) as response:
            got = {k.lower(): v for k, v in response.headers.items()}
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise WireError(f"HTTP {response.status_code}: {text[:240]}")
            reader = codec.stream()
            async for event, data in sse_events(response.aiter_lines()):
                if reader.feed(event, data) and rec.wall_ttft_ms is None:
                    rec.wall_ttft_ms = (time.perf_counter() - started) * 1000
        return reader.answer(), got
