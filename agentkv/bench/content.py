"""Token content for hashed traces: the same block hash id always becomes the same words.

A hashed trace (Claude Code, Mooncake) says only how long each prompt is and which of its blocks
equal earlier ones. To replay it on the wire, each session becomes a scripted conversation:

* **Words from hashes.** A prompt of ``n`` trace tokens becomes about ``n × token_scale`` words;
  wire slot ``q`` covers trace position ``⌊q / token_scale⌋``, whose block's hash id ``h`` picks
  the word ``WORDS[blake2b(namespace, h, q) mod 512]``. Every word in :data:`WORDS` is a single
  token after a space in the Qwen vocabulary (and in most BPE vocabularies), and spaces split
  words before BPE merges, so ``n`` words are ``n`` tokens and decode/encode round-trips.
  Chained hash ids fix their position, so equal ids give equal words at equal places: the
  trace's prefix sharing becomes token-level prefix sharing.
* **Messages.** The first prompt is a system message (the trace's system and tool prompt, when
  it says how long that is) and a user message. Each later turn adds one user message with the
  new tokens (tool results are sent as user messages too). Chat-template framing (about five
  tokens a message) comes on top and is not scaled.
* **Outputs.** The simulator's scripted output (``agentkv_sim``) is the words the next prompt
  repeats at those positions, so the decode instance holds exactly what the next turn resends.
  Exact mode keeps the generated ids, so nothing is re-tokenized on ordinary turns.
* **Strips.** When the next prompt repeats less than the output and the output had reasoning,
  the missing tokens are scripted as reasoning and stripped before the next turn
  (``strip_reasoning()``: a real rewrite through the SDK).
* **Rewrites.** When the next prompt shares fewer blocks than the previous prompt had, the
  history is rewritten (``rewrite()``): messages wholly inside the shared blocks are kept as
  they were, the first changed one is regenerated from the new prompt's hash ids (so its shared
  blocks keep their words when the role stays the same) and runs to the end of the new prompt.

Text traces (vLLM's multi-turn JSON) are replayed with their own text.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from agentkv.bench.traces import Session, Transition, Turn, transition

__all__ = [
    "WORDS",
    "ScriptedTurn",
    "WireMessage",
    "script_session",
    "words_for",
]

_WORD_TEXT = """
about above accept access account action active actual added adding address after again
against agent alert allow almost alone along already also always amount angle answer apple
apply april area argue around array arrive article aside asked assume attach august author
autumn avoid award aware back balance ball bank base basic batch beach bear beauty become
before begin behind being belong below best better beyond bird black blank block blue board
body bold book border both bottom bound brain branch brand bread break bridge brief bright
bring broad brown budget build built business button cache call calm camera cancel card care
carry case cash castle catch cause center chain chair chance change channel chapter charge
chart check cheese chief child choice choose circle city claim class clean clear client climb
clock close cloud club coast code coffee cold collect color column come comment common company
compare complete config connect contact content context control copy corner correct cost count
country couple course cover create credit cross crowd current custom cycle daily damage dance
danger dark data date daughter dead deal dear debug decide deep default define degree delay
delete deliver demand depth design detail device dialog differ dinner direct doctor document
dollar domain door double down draft drag draw dream dress drink drive drop during duty each
early earth east easy edge effect effort eight either element else email empty enable energy
engine enjoy enough enter entire entry equal error escape even event every exact example
except exist expect export extend extra face fact fail fair fall family famous farm fast
father fault favor feature feel field figure file fill filter final find fine finger finish
fire first fish five flag flat flight floor flow focus follow food force forest form format
forward found frame free fresh friend front fruit full function future game garden gate
general gift girl give glass global goal gold good grant graph great green ground group grow
guard guess guide half hand handle happen happy hard head health hear heart heavy held help
hidden high hill history hold hole home hope horse host hotel hour house human idea image
impact import include income index input inside install instead island issue item join journey
judge jump just keep kind king kitchen know label lake land large last late layer layout lead
learn least leave left legal length less letter level library life light limit line link list
listen little live load local lock logic long look loop lose loss love lower machine main
major make manage many map mark market master match matter maybe meal mean measure media meet
member memory menu message metal method middle might mind minute mirror miss mode model modern
moment money month more morning most mother motion mount mouse move much music name native
nature near need network never next night noise none normal north note nothing notice number
object ocean offer office often open option order other output owner page pain paint pair
panel paper parent park part party pass past path pattern peace people period person phone
photo piece place plan plant
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())
"""512 common English words, each one token after a space (checked in the tests)."""

Role = Literal["system", "user", "assistant"]


def _word(namespace: str, block_id: int | str, slot: int) -> str:
    digest = hashlib.blake2b(f"{namespace}|{block_id}|{slot}".encode(), digest_size=8).digest()
    return WORDS[int.from_bytes(digest, "little") % len(WORDS)]


def _slot(position: int, scale: float) -> int:
    return round(position * scale)


def words_for(
    namespace: str,
    block_ids: Sequence[int],
    block_size: int,
    scale: float,
    start: int,
    end: int,
    *,
    fallback: str,
    at_least: int = 1,
) -> str:
    """The words of trace positions ``[start, end)`` of a prompt with ``block_ids`` (a leading
    space before each). Positions past the last block id use ``fallback`` as their id."""
    first, last = _slot(start, scale), _slot(end, scale)
    last = max(last, first + at_least)
    out: list[str] = []
    for q in range(first, last):
        index = int(q / scale) // block_size if block_size > 0 else len(block_ids)
        key: int | str = block_ids[index] if index < len(block_ids) else f"{fallback}:{index}"
        out.append(" " + _word(namespace, key, q))
    return "".join(out)


@dataclass(frozen=True)
class WireMessage:
    """A message to send, and the trace positions it stands for."""

    role: Role
    content: str
    start: int
    end: int


@dataclass(frozen=True)
class ScriptedTurn:
    """What the driver does for one turn of a session."""

    index: int
    kind: Literal["first", "append", "strip", "rewrite"]
    gap_s: float
    """Trace seconds to wait after the previous response."""
    add: tuple[WireMessage, ...]
    """Messages to add before sending (after ``keep`` when rewriting)."""
    keep: int | None
    """Rewrite: keep the first ``keep`` messages of the history, then ``add`` (None: no rewrite)."""
    strip: bool
    """Strip the previous answer's reasoning before adding (a rewrite through the SDK)."""
    reasoning: str
    """Scripted reasoning of this turn's answer ("" for none)."""
    content: str
    """Scripted answer."""
    output_tokens: int
    """Tokens the scripted answer should have on the wire (words; framing excluded)."""
    trace: Turn
    step: Transition | None
    """How the trace goes from the previous turn to this one (None for the first)."""

    @property
    def sim_script(self) -> dict[str, str]:
        """The ``agentkv_sim`` body field."""
        script = {"content": self.content}
        if self.reasoning:
            script["reasoning"] = self.reasoning
        return script


def _first_messages(session: Session, turn: Turn, scale: float) -> list[WireMessage]:
    ns, ids, bs = session.namespace, turn.block_ids, session.block_size
    n = turn.input_tokens
    if not ids:  # text trace
        out: list[WireMessage] = []
        text = str(session.meta.get("system") or "")
        if text:
            out.append(WireMessage("system", text, 0, session.system_tokens))
        out.append(WireMessage("user", turn.user_text or "", session.system_tokens, n))
        return out
    system = session.system_tokens
    if 0 < system < n and _slot(system, scale) >= 1 and _slot(n, scale) > _slot(system, scale):
        return [
            WireMessage(
                "system", words_for(ns, ids, bs, scale, 0, system, fallback="p0"), 0, system
            ),
            WireMessage("user", words_for(ns, ids, bs, scale, system, n, fallback="p0"), system, n),
        ]
    return [WireMessage("user", words_for(ns, ids, bs, scale, 0, n, fallback="p0"), 0, n)]


def script_session(
    session: Session, *, token_scale: float = 1.0, max_turns: int | None = None
) -> list[ScriptedTurn]:
    """The scripted conversation for ``session`` (see the module docstring)."""
    if token_scale <= 0:
        raise ValueError("token_scale must be positive")
    turns = session.turns[:max_turns] if max_turns is not None else session.turns
    scale = token_scale if session.block_size else 1.0
    ns, bs = session.namespace, session.block_size
    min_new = max(1, math.ceil(1 / scale))
    steps: list[Transition | None] = [None] + [
        transition(a, b, bs, min_new_tokens=min_new) for a, b in itertools.pairwise(turns)
    ]
    history: list[WireMessage] = []
    out: list[ScriptedTurn] = []
    for k, turn in enumerate(turns):
        step = steps[k]
        nxt = steps[k + 1] if k + 1 < len(turns) else None
        keep: int | None = None
        strip = False
        add: list[WireMessage]
        if step is None:
            add = _first_messages(session, turn, scale)
            kind: Literal["first", "append", "strip", "rewrite"] = "first"
        elif step.kind == "rewrite":
            kind = "rewrite"
            keep = 0
            while keep < len(history) and history[keep].end <= step.shared_tokens:
                keep += 1
            start = history[keep].start if keep < len(history) else step.shared_tokens
            role: Role = history[keep].role if keep < len(history) else "user"
            add = []
            fallback = f"p{k}"
            if role == "system" and history[keep].end < turn.input_tokens:
                end = history[keep].end
                text = words_for(ns, turn.block_ids, bs, scale, start, end, fallback=fallback)
                add.append(WireMessage("system", text, start, end))
                start, role = end, "user"
            role = "user" if role == "assistant" else role
            if not turn.block_ids:
                text = turn.user_text or ""
            else:
                text = words_for(
                    ns, turn.block_ids, bs, scale, start, turn.input_tokens, fallback=fallback
                )
            add.append(WireMessage(role, text, start, turn.input_tokens))
        else:
            kind = step.kind
            strip = step.kind == "strip"
            prev = turns[k - 1]
            start = prev.input_tokens + step.resent_output
            if turn.block_ids:
                text = words_for(
                    ns, turn.block_ids, bs, scale, start, turn.input_tokens, fallback=f"p{k}"
                )
            else:
                text = turn.user_text or ""
            add = [WireMessage("user", text, start, turn.input_tokens)]
        if keep is not None:
            history = history[:keep]
        history.extend(add)
        # This turn's answer: what the next prompt repeats, and reasoning it drops.
        reasoning = ""
        begin = turn.input_tokens
        if not turn.block_ids:
            content = turn.output_text or " ok"
            words = max(1, (len(content) + 3) // 4)
        elif nxt is not None and nxt.kind in ("append", "strip"):
            ids = turns[k + 1].block_ids
            content = words_for(
                ns, ids, bs, scale, begin, begin + nxt.resent_output, fallback=f"o{k}", at_least=0
            )
            if nxt.kind == "strip":
                reasoning = words_for(
                    f"{ns}|reasoning", (), 0, scale, 0, nxt.stripped_output, fallback=f"r{k}"
                )
            if not content:
                content = words_for(f"{ns}|tail", (), 0, scale, 0, 1, fallback=f"o{k}")
            words = content.count(" ") + reasoning.count(" ")
        else:
            content = words_for(
                f"{ns}|out", (), 0, scale, begin, begin + turn.output_tokens, fallback=f"o{k}"
            )
            words = content.count(" ")
        resent = nxt.resent_output if nxt is not None and nxt.kind != "rewrite" else 0
        history.append(WireMessage("assistant", content, begin, begin + resent))
        out.append(
            ScriptedTurn(
                index=k,
                kind=kind,
                gap_s=turn.gap_s,
                add=tuple(add),
                keep=keep,
                strip=strip,
                reasoning=reasoning,
                content=content,
                output_tokens=words,
                trace=turn,
                step=step,
            )
        )
    return out
