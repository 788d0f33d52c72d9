"""Where a simulated answer's text comes from and where it stops: the request's script
(``agentkv_sim``) or the one its prompt carries (``--prompt-scripts``), the seed of generated text,
stop strings as vLLM's detokenizer finds them, and each token's text as it releases it."""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import orjson
from pydantic import ValidationError

from agentkv.chat.tokenizer import ChatTokenizer
from agentkv.protocol import BODY_SIM_SCRIPT
from agentkv.protocol.errors import APIError
from agentkv.sim.script import SimScript

__all__ = [
    "PROMPT_SCRIPT_MARKER",
    "StopHit",
    "find_stop",
    "output_seed",
    "prompt_script",
    "request_script",
    "stop_strings",
    "token_pieces",
]

PROMPT_SCRIPT_MARKER = f"{BODY_SIM_SCRIPT}:"
"""What precedes a script in a prompt (``--prompt-scripts``)."""


def request_script(body: dict[str, Any], from_prompt: bool = False) -> SimScript | None:
    """The request's script (``agentkv_sim``); without one, the prompt's when ``from_prompt``."""
    raw = body.get(BODY_SIM_SCRIPT)
    if raw is None:
        return prompt_script(body) if from_prompt else None
    try:
        return SimScript.model_validate(raw)
    except ValidationError as exc:
        raise APIError(400, f"Invalid `{BODY_SIM_SCRIPT}`: {exc}", param=BODY_SIM_SCRIPT) from exc


def prompt_script(body: dict[str, Any]) -> SimScript | None:
    """The script a chat prompt carries (``--prompt-scripts``): the JSON after
    ``agentkv_sim:`` in the last user message that has it (a string content or its text parts),
    one script or a list; the n-th answer after that message (n = the assistant messages since)
    gets the n-th, and answers past the list are generated text (which ends an agent's loop)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for at in range(len(messages) - 1, -1, -1):
        message = messages[at]
        if not isinstance(message, dict) or message.get("role") != "user":
            continue
        raw = _marked(message.get("content"))
        if raw is None:
            continue
        steps = raw if isinstance(raw, list) else [raw]
        n = sum(isinstance(m, dict) and m.get("role") == "assistant" for m in messages[at + 1 :])
        if n >= len(steps):
            return None
        try:
            return SimScript.model_validate(steps[n])
        except ValidationError as exc:
            raise APIError(400, f"Invalid `{PROMPT_SCRIPT_MARKER}` script: {exc}") from exc
    return None


def _marked(content: Any) -> Any:
    """The JSON value after the marker in a message's text, or None."""
    if isinstance(content, str):
        texts = [content]
    elif isinstance(content, list):
        texts = [
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
    else:
        return None
    for text in texts:
        at = text.find(PROMPT_SCRIPT_MARKER)
        if at < 0:
            continue
        start = at + len(PROMPT_SCRIPT_MARKER)
        start += len(text[start:]) - len(text[start:].lstrip())
        try:
            value, _ = json.JSONDecoder().raw_decode(text, start)
        except ValueError as exc:
            raise APIError(
                400, f"The `{PROMPT_SCRIPT_MARKER}` script in the prompt is not JSON: {exc}"
            ) from exc
        return value
    return None


def output_seed(body: dict[str, Any], prompt_ids: Sequence[int]) -> int:
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed
    digest = hashlib.blake2b(orjson.dumps(list(prompt_ids)), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(frozen=True)
class StopHit:
    """Where a stop string ends the output (vLLM ``Detokenizer.update``)."""

    stop: str
    num_tokens: int
    """Tokens kept: up to and including the one that completes the stop string."""
    text_len: int
    """The output text is cut here, before the stop string."""


def stop_strings(body: dict[str, Any]) -> list[str]:
    stops = body.get("stop")
    if stops is None:
        return []
    if isinstance(stops, str):
        stops = [stops]
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, "`stop` must be a string or a list of strings.", param="stop")
    return [s for s in stops if s]


def find_stop(
    tok: ChatTokenizer, ids: list[int], stops: list[str], min_tokens: int
) -> StopHit | None:
    """The stop string that completes first in the text after the first ``min_tokens`` tokens
    (ties: list order). vLLM keeps the token that completes it and cuts the text before it."""
    pieces = token_pieces(tok, ids)
    if min_tokens >= len(pieces):
        return None
    text = "".join(pieces)
    ends = list(accumulate(len(p) for p in pieces))
    floor = ends[min_tokens - 1] if min_tokens > 0 else 0
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for s in stops:
        start = text.find(s, max(0, floor - len(s) + 1))
        if start >= 0 and (best is None or start + len(s) < best[0]):
            best = (start + len(s), start, s)
    if best is None:
        return None
    end, start, stop = best
    return StopHit(stop, bisect_left(ends, end) + 1, start)


def token_pieces(tok: ChatTokenizer, ids: Sequence[int]) -> list[str]:
    """Each token's text as vLLM's incremental detokenizer releases it: a sliding window, and
    an incomplete UTF-8 character held back until it completes."""
    pieces: list[str] = []
    prefix_offset = read_offset = 0
    for k in range(1, len(ids) + 1):
        prefix_text = tok.decode(ids[prefix_offset:read_offset], skip_special_tokens=True)
        new_text = tok.decode(ids[prefix_offset:k], skip_special_tokens=True)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            pieces.append(new_text[len(prefix_text) :])
            prefix_offset, read_offset = read_offset, k
        else:
            pieces.append("")
    return pieces
