"""vLLM 0.33's response shapes for the simulator: the JSON body of a finished request, the SSE
chunks of a streamed one (:class:`StreamWriter`), and ``usage``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentkv.protocol.http import sse
from agentkv.sim.answer_text import token_pieces
from agentkv.sim.outputs import parse_output, stream_deltas
from agentkv.sim.requests import Finished, GenRequest, Scheduled
from agentkv.sim.serving import SYSTEM_FINGERPRINT, RequestPlan, SimRenderer

__all__ = ["StreamWriter", "full_response", "usage"]


def usage(
    r: SimRenderer, plan: RequestPlan, sched: Scheduled, completion_tokens: int
) -> dict[str, Any]:
    n = sched.num_prompt_tokens
    out: dict[str, Any] = {
        "prompt_tokens": n,
        "total_tokens": n + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    if r.config.prompt_tokens_details:
        cached = (
            plan.remote_cached_tokens
            if plan.remote_cached_tokens is not None
            else sched.cached_tokens
        )
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _stopped(plan: RequestPlan, ids: Sequence[int]) -> bool:
    """Whether ``ids`` (what the engine emitted) end at the planned stop string."""
    return plan.stop is not None and len(ids) == plan.stop.num_tokens


def _stop_reason(plan: RequestPlan, ids: Sequence[int]) -> str | None:
    return plan.stop.stop if plan.stop is not None and _stopped(plan, ids) else None


def _engine_finish(plan: RequestPlan, fin: Finished) -> str:
    # A stop string wins over the length limit on the same token (vLLM's output processor).
    return "stop" if _stopped(plan, fin.output_ids) else fin.finish_reason


def _finish_reason(plan: RequestPlan, fin: Finished, has_tools: bool) -> str:
    finish = _engine_finish(plan, fin)
    if has_tools and finish == "stop":
        return "tool_calls"
    return finish


def _text(r: SimRenderer, plan: RequestPlan, ids: Sequence[int]) -> str:
    """The output text vLLM returns for ``ids``: cut before the stop string that ended it."""
    text = r.tokenizer.decode(ids, skip_special_tokens=True)
    if plan.stop is not None and _stopped(plan, ids):
        text = text[: plan.stop.text_len]
    return text


def _parse_kwargs(r: SimRenderer, plan: RequestPlan) -> dict[str, Any]:
    return {
        "reasoning": r.config.reasoning_parser,
        "thinking": plan.thinking,
        "tool_format": r.config.tool_format if plan.parse_tools else "none",
        "tools": plan.tools,
        "seed": plan.seed,
    }


def _message(r: SimRenderer, plan: RequestPlan, ids: Sequence[int]) -> tuple[dict[str, Any], bool]:
    parsed = parse_output(_text(r, plan, ids), **_parse_kwargs(r, plan))
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": parsed.content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if parsed.tool_calls:  # vLLM drops an empty ``tool_calls`` list from the message
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls
        ]
    msg["reasoning"] = parsed.reasoning
    return msg, bool(parsed.tool_calls)


def full_response(
    r: SimRenderer, plan: RequestPlan, sched: Scheduled, fin: Finished
) -> dict[str, Any]:
    """The non-streaming body: every field of vLLM 0.33's response model, as ``model_dump()``
    writes it (unset fields ``null``)."""
    gen = plan.gen
    ids = list(fin.output_ids) if plan.return_token_ids else None
    prompt_ids = list(gen.prompt_ids) if plan.return_token_ids else None
    if plan.chat:
        msg, has_tools = _message(r, plan, fin.output_ids)
        choice: dict[str, Any] = {
            "index": 0,
            "message": msg,
            "logprobs": None,
            "finish_reason": _finish_reason(plan, fin, has_tools),
            "stop_reason": _stop_reason(plan, fin.output_ids),
            "token_ids": ids,
            "routed_experts": None,
            "weight_versions": None,
        }
        kind = "chat.completion"
        prompt: dict[str, Any] = {
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids,
            "prompt_text": None,
        }
    else:
        choice = {
            "index": 0,
            "text": _text(r, plan, fin.output_ids),
            "logprobs": None,
            "finish_reason": _engine_finish(plan, fin),
            "stop_reason": _stop_reason(plan, fin.output_ids),
            "token_ids": ids,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids,
            "routed_experts": None,
            "weight_versions": None,
        }
        kind, prompt = "text_completion", {}  # a completion's prompt fields are its choice's
    return {
        "id": gen.request_id.rsplit("-", 1)[0],
        "object": kind,
        "created": plan.created,
        "model": plan.model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage(r, plan, sched, len(fin.output_ids)),
        **prompt,
        "kv_transfer_params": fin.kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


class StreamWriter:
    """Turns engine tokens into vLLM's SSE chunks for one request.

    The simulated model's output is known when the request is planned, so the chat deltas
    (reasoning, content, tool calls as vLLM's parsers stream them) are computed once up front
    and sent token by token as the engine releases each token. Chunks carry the fields vLLM
    sets on them (it serializes with ``exclude_unset``); the last token comes in the same chunk
    as ``finish_reason`` and the handle (:meth:`last`), as in vLLM, whose final engine output
    carries both.
    """

    def __init__(self, r: SimRenderer, plan: RequestPlan, *, with_handle: bool) -> None:
        self.r, self.plan, self.with_handle = r, plan, with_handle
        self.id = plan.gen.request_id.rsplit("-", 1)[0]
        self.count = 0
        emitted = _emitted(plan.gen, r.config.max_model_len)
        self.expected = len(emitted)
        pieces = token_pieces(r.tokenizer, emitted)
        if plan.stop is not None and _stopped(plan, emitted):
            pieces = _cut_pieces(pieces, plan.stop.text_len)
        self.pieces = pieces
        self.deltas: list[dict[str, Any] | None] = (
            stream_deltas(self.pieces, **_parse_kwargs(r, plan)) if plan.chat else []
        )

    def _chunk(self, choice: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.plan.chat else "text_completion",
            "created": self.plan.created,
            "model": self.plan.model,
            "choices": [] if choice is None else [choice],
        }
        if choice is not None and self.plan.continuous_usage:
            # vLLM's continuous usage stats: the counts so far on every chunk
            n = len(self.plan.gen.prompt_ids)
            body["usage"] = {
                "prompt_tokens": n,
                "total_tokens": n + self.count,
                "completion_tokens": self.count,
                "completion_tokens_details": None,
            }
        body.update(extra)
        return body

    def expects_last(self) -> bool:
        """Whether the next token should be the request's last (then the engine's
        :class:`Finished` follows it at once, and :meth:`last` sends both in one chunk)."""
        return self.count + 1 == self.expected

    def first(self) -> list[bytes]:
        """Chat opens with the assistant role (and the prompt ids when asked)."""
        if not self.plan.chat:
            return []
        prompt_ids = list(self.plan.gen.prompt_ids) if self.plan.return_token_ids else None
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [sse(self._chunk(choice, prompt_token_ids=prompt_ids, prompt_text=None))]

    def _choice(self, token_id: int | None) -> dict[str, Any] | None:
        """The choice for one token (None: vLLM sends nothing for it)."""
        plan = self.plan
        ids = None
        delta = None
        text = ""
        first = self.count == 0
        if token_id is not None:
            i = self.count
            self.count += 1
            ids = [token_id] if plan.return_token_ids else None
            delta = self.deltas[i] if i < len(self.deltas) else None
            text = self.pieces[i] if i < len(self.pieces) else ""
        if plan.chat:
            if token_id is not None and delta is None and ids is None:
                return None
            return {
                "index": 0,
                "delta": delta or {},
                "logprobs": None,
                "finish_reason": None,
                "token_ids": ids,
            }
        return {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
            "prompt_token_ids": (
                list(plan.gen.prompt_ids) if first and plan.return_token_ids else None
            ),
            "token_ids": ids,
            "weight_versions": None,
        }

    def token(self, token_id: int) -> list[bytes]:
        choice = self._choice(token_id)
        if choice is None:
            return []
        return [sse(self._chunk(choice, kv_transfer_params=None))]

    def last(self, token_id: int | None, sched: Scheduled, fin: Finished) -> list[bytes]:
        """The final chunk (with the last token, when given), the usage chunk when asked for,
        and ``[DONE]``."""
        # A chat token with nothing to say still carries finish_reason (and an empty delta).
        choice = self._choice(token_id) or {"index": 0, "delta": {}, "token_ids": None}
        if self.plan.chat:
            _, has_tools = _message(self.r, self.plan, fin.output_ids)
            finish = _finish_reason(self.plan, fin, has_tools)
            choice = {
                "index": 0,
                "delta": choice["delta"],
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": _stop_reason(self.plan, fin.output_ids),
                "token_ids": choice["token_ids"],
                "weight_versions": None,
            }
        else:
            choice["finish_reason"] = _engine_finish(self.plan, fin)
            choice["stop_reason"] = _stop_reason(self.plan, fin.output_ids)
        handle = fin.kv_transfer_params if self.with_handle else None
        out = [sse(self._chunk(choice, kv_transfer_params=handle))]
        if self.plan.include_usage:
            # vLLM serializes this one with ``exclude_none``.
            info = usage(self.r, self.plan, sched, len(fin.output_ids))
            info = {k: v for k, v in info.items() if v is not None}
            out.append(sse(self._chunk(None, usage=info, system_fingerprint=SYSTEM_FINGERPRINT)))
        out.append(sse("[DONE]"))
        return out

    def finish(self, sched: Scheduled, fin: Finished) -> list[bytes]:
        """The final chunks when no token is left to send with them."""
        return self.last(None, sched, fin)


def _cut_pieces(pieces: list[str], text_len: int) -> list[str]:
    """The streamed pieces of a text cut at ``text_len`` characters."""
    out: list[str] = []
    at = 0
    for piece in pieces:
        out.append(piece[: max(0, text_len - at)])
        at += len(piece)
    return out


def _emitted(gen: GenRequest, max_model_len: int) -> list[int]:
    """The tokens the engine will release: up to the first stop token, within its limit."""
    limit = gen.max_tokens if gen.max_tokens is not None else max_model_len - len(gen.prompt_ids)
    out: list[int] = []
    for token in gen.output_ids:
        if len(out) >= limit:
            break
        out.append(token)
        if token in gen.stop_ids:
            break
    return out
