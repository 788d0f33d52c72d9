"""Multi-turn traces in one shape: sessions of turns, whatever the file's format.

Three formats are read (``load_trace`` tells them apart):

* **Claude Code** (WEKA ``kv-cache-tester``; ``traces.jsonl[.xz]``, one session per line):
  ``requests[]`` with ``t``, ``in``, ``out``, 64-token chained block hash ids, ``input_types``,
  ``output_types``, ``api_time`` and ``think_time`` (the client's wait before the request:
  tool execution or human think time). Sub-agents are separate sessions when asked for.
* **Mooncake** (FAST'25; one request per line: ``timestamp`` in ms, ``input_length``,
  ``output_length``, 512-token chained global ``hash_ids``). There is no session id: a request
  continues the earlier, shorter request with the longest run of its full blocks (at least two)
  as its prefix; the first continuation extends the session, a second one starts a new
  session (it is a branch: the parent's KV was already taken by the first). The gap is
  arrival to arrival (the trace has no response times).
* **vLLM multi-turn benchmark** (``benchmarks/multi_turn``: a JSON list of ``{"id",
  "messages": [{"role", "content"}]}``): real text, no timing (gap 0). Token counts are
  estimated at 4 characters per token.

Transitions (:func:`transition`) say how a turn's prompt relates to the previous one, from the
block hash ids: an **append** (the previous prompt and its output, then new messages), a
**strip** (the previous prompt kept but part of the output, its reasoning, not resent) or a
**rewrite** (history changed: compaction, a reset, cleared tool results). :func:`ideal_reuse`
is how many of the new prompt's tokens the decode instance holds from the previous turn and a
verifying router could let prefill read back.
"""

from __future__ import annotations

import json
import lzma
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, Literal

from agentkv.protocol.prefix import common_prefix

__all__ = [
    "Session",
    "TraceError",
    "TraceFormat",
    "Transition",
    "Turn",
    "detect_format",
    "ideal_reuse",
    "iter_claude_code",
    "load_mooncake",
    "load_trace",
    "load_vllm_multi_turn",
    "transition",
]

TraceFormat = Literal["claude-code", "mooncake", "vllm-multi-turn"]
TurnKind = Literal["first", "tool_result", "user_text", "continue"]
TransitionKind = Literal["append", "strip", "rewrite"]


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and the line."""


@dataclass(frozen=True)
class Turn:
    """One request of a session."""

    t_s: float
    """Arrival, seconds from the session's start."""
    gap_s: float
    """How long the client waited before sending it, after the previous response (tool
    execution or human think time); 0 for the first turn."""
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...] = ()
    """Chained hash ids of the prompt's blocks (``Session.block_size`` tokens each; the last one
    may be partial). Empty for text traces."""
    kind: TurnKind = "continue"
    reasoning: bool = False
    """The output had a reasoning (thinking) part."""
    api_s: float | None = None
    """Server time in the trace, when known."""
    user_text: str | None = None
    """Text traces: the new user message."""
    output_text: str | None = None
    """Text traces: the assistant's answer."""
    tool_call: bool = False
    """The response ended in a tool call (Claude Code: ``stop == "tool_use"``, or a
    ``tool_use`` output when the stop reason is missing): the gap after it is a tool wait."""


@dataclass(frozen=True)
class Session:
    """One conversation."""

    id: str
    turns: tuple[Turn, ...]
    source: TraceFormat
    block_size: int = 0
    """Tokens per hash id (64 for Claude Code, 512 for Mooncake, 0 for text)."""
    namespace: str = ""
    """Hash ids mean the same content within a namespace: the session (Claude Code's ids are
    local; sub-agents share their parent's) or ``global`` (Mooncake)."""
    start_s: float = 0.0
    """Absolute start in the trace (Mooncake), else 0."""
    system_tokens: int = 0
    """Tokens of the system prompt and tool definitions at the start of the first prompt."""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def max_input_tokens(self) -> int:
        return max((t.input_tokens for t in self.turns), default=0)

    def truncated(self, max_turns: int) -> Session:
        """The first ``max_turns`` turns; ``meta["next_gap_s"]`` keeps the gap before the first
        turn cut off (D's retention after the last kept turn depends on it)."""
        if len(self.turns) <= max_turns:
            return self
        meta = {**self.meta, "next_gap_s": self.turns[max_turns].gap_s}
        return replace(self, turns=self.turns[:max_turns], meta=meta)


# -- transitions -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Transition:
    """How turn ``k``'s prompt relates to turn ``k - 1``'s (trace tokens)."""

    kind: TransitionKind
    shared_tokens: int
    """Leading tokens of the new prompt equal to the previous prompt (hash ids × block size)."""
    resent_output: int
    """Tokens of the previous output that the new prompt repeats."""
    stripped_output: int
    """Tokens of the previous output (its reasoning) that it does not repeat (strip)."""
    new_tokens: int
    """Tokens added after what is kept."""


def transition(prev: Turn, cur: Turn, block_size: int, *, min_new_tokens: int = 1) -> Transition:
    """Classify the step from ``prev`` to ``cur``.

    * The whole previous prompt is kept (all its full blocks are the new prompt's first ones):
      the growth is the previous output plus new messages. When the growth leaves fewer than
      ``min_new_tokens`` for the new messages and the previous output had reasoning, that
      reasoning was not resent (**strip**); otherwise the output is resent (**append**; new
      messages get at least ``min_new_tokens``).
    * Otherwise the history was rewritten from the first differing block (**rewrite**).

    Text traces (no block ids) are always appends of the whole output.
    """
    grow = cur.input_tokens - prev.input_tokens
    if not prev.block_ids or not cur.block_ids or block_size <= 0:
        new = max(grow - prev.output_tokens, min_new_tokens)
        return Transition("append", prev.input_tokens, prev.output_tokens, 0, new)
    common = common_prefix(prev.block_ids, cur.block_ids)
    if common >= prev.input_tokens // block_size:
        if grow - prev.output_tokens >= min_new_tokens:
            return Transition(
                "append", prev.input_tokens, prev.output_tokens, 0, grow - prev.output_tokens
            )
        if prev.reasoning and grow - min_new_tokens < prev.output_tokens:
            resent = max(0, grow - min_new_tokens)
            return Transition(
                "strip", prev.input_tokens, resent, prev.output_tokens - resent, min_new_tokens
            )
        return Transition("append", prev.input_tokens, prev.output_tokens, 0, min_new_tokens)
    shared = min(common * block_size, cur.input_tokens)
    return Transition("rewrite", shared, 0, 0, cur.input_tokens - shared)


def ideal_reuse(prev: Turn, step: Transition, cur_input_tokens: int, engine_block: int) -> int:
    """Tokens of the new prompt that the decode instance holds from ``prev`` (its prompt and
    output but the last token) and a verifying router may let prefill read: all it holds when
    the new prompt repeats all of it, else the matching prefix cut to whole engine blocks; and
    never the new prompt's last token (vLLM always computes it)."""
    held = prev.input_tokens + prev.output_tokens - 1
    if step.kind == "append":
        match = prev.input_tokens + step.resent_output
        reusable = held if match >= held else match // engine_block * engine_block
    elif step.kind == "strip":
        reusable = prev.input_tokens // engine_block * engine_block
    else:
        reusable = min(step.shared_tokens, held) // engine_block * engine_block
    return max(0, min(reusable, cur_input_tokens - 1))


# -- Claude Code (WEKA) -----------------------------------------------------------------------
def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """The file's non-blank lines, numbered from 1 (an ``.xz`` file read as it is)."""
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, line


def _ends_in_tool_call(request: dict[str, Any]) -> bool:
    stop = request.get("stop")
    if stop:
        return bool(stop == "tool_use")
    return "tool_use" in (request.get("output_types") or [])


def _weka_turns(requests: list[dict[str, Any]], where: str) -> tuple[Turn, ...]:
    turns: list[Turn] = []
    for i, r in enumerate(requests):
        try:
            inputs = r.get("input_types") or []
            kind: TurnKind = (
                "first"
                if i == 0
                else "tool_result"
                if "tool_result" in inputs
                else "user_text"
                if "text" in inputs
                else "continue"
            )
            turns.append(
                Turn(
                    t_s=float(r["t"]),
                    gap_s=0.0 if i == 0 else max(0.0, float(r.get("think_time") or 0.0)),
                    input_tokens=int(r["in"]),
                    output_tokens=max(1, int(r["out"])),
                    block_ids=tuple(int(h) for h in r["hash_ids"]),
                    kind=kind,
                    reasoning="thinking" in (r.get("output_types") or []),
                    api_s=float(r["api_time"]) if r.get("api_time") is not None else None,
                    tool_call=_ends_in_tool_call(r),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{where}: request {i}: {exc!r}") from None
    return tuple(turns)


def iter_claude_code(path: str | Path, *, include_subagents: bool = False) -> Iterator[Session]:
    """Sessions of a Claude Code trace, one line at a time (the file stays compressed)."""
    p = Path(path)
    for lineno, line in _lines(p):
        try:
            data = json.loads(line)
            sid = str(data["id"])
            requests = list(data["requests"])
            block = int(data.get("block_size") or 64)
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceError(f"{p}:{lineno}: not a Claude Code session: {exc!r}") from None
        main = [r for r in requests if r.get("type") != "subagent"]
        system = int(data.get("system_tokens") or 0) + int(data.get("tool_tokens") or 0)
        if main:
            yield Session(
                id=sid,
                turns=_weka_turns(main, f"{p}:{lineno}"),
                source="claude-code",
                block_size=block,
                namespace=sid,
                system_tokens=system,
                meta={"models": data.get("models") or []},
            )
        if not include_subagents:
            continue
        for sub in requests:
            if sub.get("type") != "subagent" or not sub.get("requests"):
                continue
            sub_system = int(sub.get("system_tokens") or 0) + int(sub.get("tool_tokens") or 0)
            yield Session(
                id=f"{sid}/{sub.get('agent_id', 'sub')}",
                turns=_weka_turns(list(sub["requests"]), f"{p}:{lineno} sub-agent"),
                source="claude-code",
                block_size=block,
                namespace=sid,
                start_s=float(sub.get("t") or 0.0),
                system_tokens=sub_system,
                meta={"subagent_type": sub.get("subagent_type")},
            )


# -- Mooncake ----------------------------------------------------------------------------------
_MOONCAKE_BLOCK = 512


def load_mooncake(path: str | Path, *, block_size: int = _MOONCAKE_BLOCK) -> list[Session]:
    """Sessions inferred from a Mooncake trace (see the module docstring)."""
    p = Path(path)
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    for lineno, line in _lines(p):
        try:
            d = json.loads(line)
            rows.append(
                (
                    float(d["timestamp"]) / 1000.0,
                    int(d["input_length"]),
                    max(1, int(d["output_length"])),
                    tuple(int(h) for h in d["hash_ids"]),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceError(f"{p}:{lineno}: not a Mooncake request: {exc!r}") from None
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])
    # last full block id -> index of the latest request whose full blocks end with it
    by_last: dict[int, int] = {}
    parent: dict[int, int] = {}
    for j in order:
        _t, n, _o, ids = rows[j]
        for pos in range(min(len(ids), n // block_size) - 1, 0, -1):  # at least 2 full blocks
            i = by_last.get(ids[pos])
            if i is not None and rows[i][1] < n:
                parent[j] = i
                break
        full = n // block_size
        if full >= 2:
            by_last[ids[full - 1]] = j
    session_of: dict[int, int] = {}
    chains: list[list[int]] = []
    for j in order:
        i = parent.get(j)
        if i is not None and i in session_of and chains[session_of[i]][-1] == i:
            session_of[j] = session_of[i]
            chains[session_of[j]].append(j)
        else:
            session_of[j] = len(chains)
            chains.append([j])
    sessions: list[Session] = []
    for k, chain in enumerate(chains):
        start = rows[chain[0]][0]
        turns: list[Turn] = []
        for pos, j in enumerate(chain):
            t, n, o, ids = rows[j]
            prev_t = rows[chain[pos - 1]][0] if pos else t
            turns.append(
                Turn(
                    t_s=t - start,
                    gap_s=max(0.0, t - prev_t),
                    input_tokens=n,
                    output_tokens=o,
                    block_ids=ids,
                    kind="first" if pos == 0 else "continue",
                )
            )
        sessions.append(
            Session(
                id=f"{p.stem}-{k}",
                turns=tuple(turns),
                source="mooncake",
                block_size=block_size,
                namespace="global",
                start_s=start,
            )
        )
    return sessions


# -- vLLM multi-turn benchmark -------------------------------------------------------------------
def _estimate_tokens(text: str) -> int:
    return max(1, (len(text) + 3) // 4)


def load_vllm_multi_turn(path: str | Path) -> list[Session]:
    """Conversations of vLLM's multi-turn benchmark JSON (``[{"id", "messages"}]``)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TraceError(f"{p}: not JSON: {exc}") from None
    if not isinstance(data, list):
        raise TraceError(f"{p}: expected a JSON list of conversations")
    sessions: list[Session] = []
    for n, item in enumerate(data):
        try:
            sid = str(item["id"])
            messages = list(item["messages"])
        except (KeyError, TypeError) as exc:
            raise TraceError(f"{p}: conversation {n}: {exc!r}") from None
        system = ""
        turns: list[Turn] = []
        context = 0
        pending: str | None = None
        for m in messages:
            role, content = m.get("role"), m.get("content")
            if not isinstance(content, str):
                raise TraceError(f"{p}: conversation {sid}: a message without text content")
            if role == "system" and not turns and pending is None:
                system += content
            elif role == "user":
                pending = content if pending is None else pending + "\n" + content
            elif role == "assistant" and pending is not None:
                if not turns:
                    context += _estimate_tokens(system) if system else 0
                context += _estimate_tokens(pending)
                turns.append(
                    Turn(
                        t_s=0.0,
                        gap_s=0.0,
                        input_tokens=context,
                        output_tokens=_estimate_tokens(content),
                        kind="first" if not turns else "user_text",
                        user_text=pending,
                        output_text=content,
                    )
                )
                context += _estimate_tokens(content)
                pending = None
        if turns:
            sessions.append(
                Session(
                    id=sid,
                    turns=tuple(turns),
                    source="vllm-multi-turn",
                    namespace=sid,
                    system_tokens=_estimate_tokens(system) if system else 0,
                    meta={"system": system} if system else {},
                )
            )
    return sessions


# -- any ---------------------------------------------------------------------------------------
def detect_format(path: str | Path) -> TraceFormat:
    """The format of a trace file, from its first line."""
    p = Path(path)
    try:
        with _open_text(p) as f:
            head = f.read(4096)
    except (OSError, lzma.LZMAError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read {p}: {exc}") from None
    stripped = head.lstrip()
    if stripped.startswith("["):
        return "vllm-multi-turn"
    first = stripped.split("\n", 1)[0]
    if '"requests"' in first or '"hash_id_scope"' in first:
        return "claude-code"
    if '"timestamp"' in first and '"hash_ids"' in first:
        return "mooncake"
    raise TraceError(
        f"{p}: unknown trace format (expected Claude Code sessions, Mooncake requests or vLLM's "
        "multi-turn JSON)"
    )


def load_trace(
    path: str | Path,
    *,
    format: TraceFormat | None = None,
    limit: int | None = None,
    include_subagents: bool = False,
) -> list[Session]:
    """Every session of a trace (the first ``limit`` ones when given; a Claude Code trace is
    then read only that far)."""
    fmt = format or detect_format(path)
    if fmt == "claude-code":
        out: list[Session] = []
        for session in iter_claude_code(path, include_subagents=include_subagents):
            if limit is not None and len(out) >= limit:
                break
            out.append(session)
        return out
    sessions = load_mooncake(path) if fmt == "mooncake" else load_vllm_multi_turn(path)
    return sessions[:limit] if limit is not None else sessions
