"""vLLM's OpenAI surface over the engine: request parsing and response shapes.

Chat and completions requests become a :class:`~agentkv.sim.engine.GenRequest`; the engine's
events become vLLM 0.33's JSON bodies or SSE chunks (``data: {...}`` lines, ``data: [DONE]``).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import ValidationError

from agentkv.protocol import BODY_SIM_SCRIPT
from agentkv.sim.config import SimConfig
from agentkv.sim.engine import EngineError, Finished, GenRequest, Scheduled
from agentkv.sim.outputs import (
    SimScript,
    generate_text,
    native_syntax_for,
    parse_output,
    render_script,
    stream_deltas,
)
from agentkv.sim.template import ChatTemplate, TemplateError
from agentkv.sim.tokenizer import SimTokenizer

__all__ = ["Plan", "Renderer", "plan_chat", "plan_completion", "sse"]


def sse(data: dict[str, Any] | str) -> bytes:
    """One SSE event in vLLM's framing."""
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    return b"data: " + payload + b"\n\n"


@dataclass
class Plan:
    """A parsed request: what to run and how to answer."""

    gen: GenRequest
    chat: bool
    model: str
    stream: bool
    include_usage: bool
    return_token_ids: bool
    parse_tools: bool
    tools: list[dict[str, Any]] | None
    prompt_ends_in_think: bool
    remote_cached_tokens: int | None
    """On D: P's ``remote_prefill_cached_tokens`` (what D reports as ``cached_tokens``)."""
    thinking: bool = True
    seed: int = 0
    tool_choice: str = "auto"
    stop_reason: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class Renderer:
    """Tokenizer + template + configuration: turns requests into prompts and outputs."""

    config: SimConfig
    tokenizer: SimTokenizer
    template: ChatTemplate

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    # -- prompts -----------------------------------------------------------------------------
    def render_chat(self, body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EngineError(400, "`messages` must be a non-empty list.", param="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise EngineError(400, "Each message needs a string `role`.", param="messages")
        add_gen = body.get("add_generation_prompt", True)
        cont = body.get("continue_final_message", False)
        if add_gen and cont:
            raise EngineError(
                400,
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            )
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise EngineError(400, "`chat_template_kwargs` must be an object.")
        template = self.template
        if isinstance(body.get("chat_template"), str):
            special = self.tokenizer.special_tokens_map
            template = ChatTemplate(body["chat_template"], name="request", special_tokens=special)
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise EngineError(400, "`tools` must be a list.", param="tools")
        try:
            return template.render_request(
                messages,
                tools=tools,
                add_generation_prompt=bool(add_gen),
                continue_final_message=bool(cont),
                **kwargs,
            )
        except TemplateError as exc:
            raise EngineError(400, f"Chat template error: {exc}", param="messages") from exc
        except ValueError as exc:
            raise EngineError(400, str(exc), param="messages") from exc

    def chat_prompt_ids(
        self, body: dict[str, Any], kv: dict[str, Any] | None
    ) -> tuple[list[int], bool]:
        """The prompt ids of a chat request and whether the prompt opens a reasoning block."""
        ids = kv.pop("prompt_token_ids", None) if kv is not None else None
        if ids is not None and not body.get("echo"):
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
            ):
                raise EngineError(
                    400,
                    "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of "
                    "non-negative integers.",
                    param="kv_transfer_params.prompt_token_ids",
                )
            for t in ids:
                if not self.tokenizer.is_valid_id(t):
                    raise EngineError(
                        400,
                        f"Token id {t} is out of vocabulary",
                        param="kv_transfer_params.prompt_token_ids",
                    )
            tail = self.tokenizer.decode(ids[-4:])
            return list(ids), _opens_think(tail)
        text = self.render_chat(body)
        add_special = bool(body.get("add_special_tokens", False))
        return self.tokenizer.encode(text, add_special_tokens=add_special), _opens_think(text)

    def completion_prompt_ids(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(
                prompt, add_special_tokens=bool(body.get("add_special_tokens", True))
            )
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            return list(prompt)
        raise EngineError(
            400,
            "`prompt` must be a string or a non-empty list of token ids (one prompt per request "
            "in the simulator).",
            param="prompt",
        )

    # -- outputs -----------------------------------------------------------------------------
    def output_ids(
        self,
        body: dict[str, Any],
        prompt_ids: Sequence[int],
        *,
        chat: bool,
        max_tokens: int | None,
        thinking: bool = True,
        prompt_ends_in_think: bool = False,
    ) -> tuple[list[int], str | None]:
        """The tokens the model will emit, and the stop string that cut them (if any)."""
        script = _script(body)
        eos = self.eos_id
        end_with_eos = True
        native = native_syntax_for(self.template.source)
        reasons = chat and self.config.reasoning_parser and thinking
        if script is not None and script.text is not None:
            text = script.text
        elif script is not None:
            text = render_script(
                script, native=native, thinking=reasons, prompt_ends_in_think=prompt_ends_in_think
            )
        else:
            seed = _seed(body, prompt_ids)
            chars = 8 * self.config.max_output_tokens_default
            ids = self.tokenizer.encode(generate_text(seed, max_chars=chars))
            natural = 8 + seed % max(1, self.config.max_output_tokens_default - 8)
            content = self.tokenizer.decode(ids[:natural])
            if reasons:
                thought = self.tokenizer.decode(ids[natural : natural + natural // 2])
                generated = SimScript(reasoning=thought.strip(), content=content)
                text = render_script(
                    generated,
                    native=native,
                    thinking=True,
                    prompt_ends_in_think=prompt_ends_in_think,
                )
            else:
                text = content
        if script is not None and script.finish_reason == "length":
            end_with_eos = False
        ids = self.tokenizer.encode(text)
        min_tokens = int(body.get("min_tokens") or 0)
        ignore_eos = bool(body.get("ignore_eos"))
        if ignore_eos or len(ids) < min_tokens:
            want = max(min_tokens, max_tokens or 0) if ignore_eos else min_tokens
            filler = 0
            while len(ids) < want:
                ids += self.tokenizer.encode(generate_text(_seed(body, prompt_ids) + filler, 256))
                filler += 1
            if ignore_eos:
                end_with_eos = False
        stop_reason = None
        stops = body.get("stop")
        if isinstance(stops, str):
            stops = [stops]
        if isinstance(stops, list) and stops:
            ids, stop_reason = _cut_at_stop(
                self.tokenizer, ids, [s for s in stops if isinstance(s, str) and s]
            )
            if stop_reason is not None:
                end_with_eos = False
        if end_with_eos and eos is not None:
            ids.append(eos)
        if not ids:
            ids = [eos] if eos is not None else self.tokenizer.encode(".")
        return ids, stop_reason

    def stop_ids(self) -> frozenset[int]:
        return frozenset() if self.eos_id is None else frozenset({self.eos_id})


def _script(body: dict[str, Any]) -> SimScript | None:
    raw = body.get(BODY_SIM_SCRIPT)
    if raw is None:
        return None
    try:
        return SimScript.model_validate(raw)
    except ValidationError as exc:
        raise EngineError(
            400, f"Invalid `{BODY_SIM_SCRIPT}`: {exc}", param=BODY_SIM_SCRIPT
        ) from exc


def _seed(body: dict[str, Any], prompt_ids: Sequence[int]) -> int:
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed
    digest = hashlib.blake2b(orjson.dumps(list(prompt_ids)), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _opens_think(text: str) -> bool:
    stripped = text.rstrip()
    return stripped.endswith("<think>")


def _cut_at_stop(
    tok: SimTokenizer, ids: list[int], stops: list[str]
) -> tuple[list[int], str | None]:
    text = tok.decode(ids, skip_special_tokens=True)
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return ids, None
    for k in range(len(ids) + 1):
        if len(tok.decode(ids[:k], skip_special_tokens=True)) > best[0]:
            return ids[: max(0, k - 1)], best[1]
    return ids, best[1]


def _int_field(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise EngineError(400, f"`{name}` must be a positive integer.", param=name)
        return value
    return None


def _common(body: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise EngineError(
            400, "`kv_transfer_params` must be an object.", param="kv_transfer_params"
        )
    n = body.get("n", 1)
    if n not in (None, 1):
        raise EngineError(400, "The simulator serves n=1 only.", param="n")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise EngineError(400, "`cache_salt` must be a string.", param="cache_salt")
    return (dict(kv) if kv is not None else None), salt


def _plan(r: Renderer, body: dict[str, Any], *, chat: bool, request_id: str) -> Plan:
    kv, salt = _common(body)
    if chat:
        prompt_ids, ends_in_think = r.chat_prompt_ids(body, kv)
    else:
        prompt_ids, ends_in_think = r.completion_prompt_ids(body), False
    max_tokens = (
        _int_field(body, "max_completion_tokens", "max_tokens")
        if chat
        else _int_field(body, "max_tokens")
    )
    if not chat and max_tokens is None:
        max_tokens = 16  # OpenAI's completions default, which vLLM keeps
    kwargs = body.get("chat_template_kwargs") or {}
    thinking = bool(kwargs.get("enable_thinking", kwargs.get("thinking", True)))
    out, stop_reason = r.output_ids(
        body,
        prompt_ids,
        chat=chat,
        max_tokens=max_tokens,
        thinking=thinking,
        prompt_ends_in_think=ends_in_think,
    )
    tool_choice = body.get("tool_choice", "auto")
    stream = bool(body.get("stream"))
    opts = body.get("stream_options") or {}
    tools = body.get("tools") if isinstance(body.get("tools"), list) else None
    remote_cached = None
    if kv is not None and kv.get("do_remote_prefill"):
        value = kv.get("remote_prefill_cached_tokens")
        remote_cached = int(value) if isinstance(value, int) else None
    gen = GenRequest(
        request_id=request_id,
        prompt_ids=prompt_ids,
        output_ids=out,
        stop_ids=r.stop_ids(),
        max_tokens=max_tokens,
        kv_params=kv,
        cache_salt=salt,
        streaming=stream,
    )
    return Plan(
        gen=gen,
        chat=chat,
        model=str(body.get("model") or r.config.served_model_name),
        stream=stream,
        include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
        return_token_ids=bool(body.get("return_token_ids")),
        parse_tools=bool(tools) and tool_choice != "none",
        tools=tools,
        prompt_ends_in_think=ends_in_think,
        remote_cached_tokens=remote_cached,
        thinking=thinking,
        seed=_seed(body, prompt_ids),
        tool_choice="none" if tool_choice == "none" else "auto",
        stop_reason=stop_reason,
    )


def plan_chat(r: Renderer, body: dict[str, Any], base_id: str | None) -> Plan:
    return _plan(r, body, chat=True, request_id=_request_id("chatcmpl", base_id))


def plan_completion(r: Renderer, body: dict[str, Any], base_id: str | None) -> Plan:
    return _plan(r, body, chat=False, request_id=_request_id("cmpl", base_id))


def _request_id(prefix: str, base: str | None) -> str:
    return f"{prefix}-{base or uuid.uuid4().hex}-{uuid.uuid4().hex[:8]}"


# -- responses ------------------------------------------------------------------------------
def usage(r: Renderer, plan: Plan, sched: Scheduled, completion_tokens: int) -> dict[str, Any]:
    n = sched.num_prompt_tokens
    out: dict[str, Any] = {
        "prompt_tokens": n,
        "total_tokens": n + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }
    if r.config.prompt_tokens_details:
        cached = (
            plan.remote_cached_tokens
            if plan.remote_cached_tokens is not None
            else sched.cached_tokens
        )
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _finish_reason(plan: Plan, fin: Finished, has_tools: bool) -> str:
    if has_tools and fin.finish_reason == "stop":
        return "tool_calls"
    return fin.finish_reason


def _parse_kwargs(r: Renderer, plan: Plan) -> dict[str, Any]:
    return {
        "reasoning": r.config.reasoning_parser,
        "thinking": plan.thinking,
        "tool_format": r.config.tool_format if plan.parse_tools else "none",
        "tools": plan.tools,
        "seed": plan.seed,
    }


def _message(r: Renderer, plan: Plan, ids: Sequence[int]) -> tuple[dict[str, Any], bool]:
    text = r.tokenizer.decode(ids, skip_special_tokens=True)
    parsed = parse_output(text, **_parse_kwargs(r, plan))
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": parsed.content,
        "refusal": None,
        "reasoning": parsed.reasoning,
    }
    if parsed.tool_calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls
        ]
    return msg, bool(parsed.tool_calls)


def full_response(r: Renderer, plan: Plan, sched: Scheduled, fin: Finished) -> dict[str, Any]:
    gen = plan.gen
    common = {
        "id": gen.request_id.rsplit("-", 1)[0],
        "created": plan.created,
        "model": plan.model,
        "usage": usage(r, plan, sched, len(fin.output_ids)),
        "system_fingerprint": None,
        "kv_transfer_params": fin.kv_transfer_params,
    }
    if plan.chat:
        msg, has_tools = _message(r, plan, fin.output_ids)
        choice: dict[str, Any] = {
            "index": 0,
            "message": msg,
            "logprobs": None,
            "finish_reason": _finish_reason(plan, fin, has_tools),
            "stop_reason": plan.stop_reason,
            "token_ids": list(fin.output_ids) if plan.return_token_ids else None,
        }
        return {
            "object": "chat.completion",
            "choices": [choice],
            "prompt_logprobs": None,
            "prompt_token_ids": list(gen.prompt_ids) if plan.return_token_ids else None,
            **common,
        }
    text = r.tokenizer.decode(fin.output_ids, skip_special_tokens=True)
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": fin.finish_reason,
        "stop_reason": plan.stop_reason,
        "prompt_logprobs": None,
        "prompt_token_ids": list(gen.prompt_ids) if plan.return_token_ids else None,
        "token_ids": list(fin.output_ids) if plan.return_token_ids else None,
    }
    return {"object": "text_completion", "choices": [choice], **common}


class StreamWriter:
    """Turns engine tokens into vLLM's SSE chunks for one request.

    The simulated model's output is known when the request is planned, so the chat deltas
    (reasoning, content, tool calls as vLLM's parsers stream them) are computed once up front
    and sent token by token as the engine releases each token.
    """

    def __init__(self, r: Renderer, plan: Plan, *, with_handle: bool) -> None:
        self.r, self.plan, self.with_handle = r, plan, with_handle
        self.id = plan.gen.request_id.rsplit("-", 1)[0]
        self.count = 0
        emitted = _emitted(plan.gen)
        self.pieces = _pieces(r.tokenizer, emitted)
        self.deltas: list[dict[str, Any] | None] = (
            stream_deltas(self.pieces, **_parse_kwargs(r, plan)) if plan.chat else []
        )

    def _chunk(self, choice: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.plan.chat else "text_completion"
        body: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.plan.created,
            "model": self.plan.model,
            "choices": [] if choice is None else [choice],
            "usage": None,
        }
        body.update(extra)
        return body

    def first(self) -> list[bytes]:
        """Chat opens with the assistant role (and the prompt ids when asked)."""
        if not self.plan.chat:
            return []
        extra: dict[str, Any] = {}
        if self.plan.return_token_ids:
            extra["prompt_token_ids"] = list(self.plan.gen.prompt_ids)
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [sse(self._chunk(choice, **extra))]

    def token(self, token_id: int) -> list[bytes]:
        i = self.count
        self.count += 1
        ids = [token_id] if self.plan.return_token_ids else None
        if self.plan.chat:
            delta = self.deltas[i] if i < len(self.deltas) else None
            if delta is None and ids is None:
                return []
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta or {},
                "logprobs": None,
                "finish_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": self.pieces[i] if i < len(self.pieces) else "",
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
            }
            if i == 0 and self.plan.return_token_ids:
                choice["prompt_token_ids"] = list(self.plan.gen.prompt_ids)
        if ids is not None:
            choice["token_ids"] = ids
        return [sse(self._chunk(choice))]

    def finish(self, sched: Scheduled, fin: Finished) -> list[bytes]:
        out: list[bytes] = []
        handle = fin.kv_transfer_params if self.with_handle else None
        if self.plan.chat:
            _, has_tools = _message(self.r, self.plan, fin.output_ids)
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {},
                "logprobs": None,
                "finish_reason": _finish_reason(self.plan, fin, has_tools),
                "stop_reason": self.plan.stop_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": "",
                "logprobs": None,
                "finish_reason": fin.finish_reason,
                "stop_reason": self.plan.stop_reason,
            }
        out.append(sse(self._chunk(choice, kv_transfer_params=handle)))
        if self.plan.include_usage:
            out.append(
                sse(self._chunk(None, usage=usage(self.r, self.plan, sched, len(fin.output_ids))))
            )
        out.append(sse("[DONE]"))
        return out


def _emitted(gen: GenRequest) -> list[int]:
    """The tokens the engine will release: up to the first stop token, within max_tokens."""
    out: list[int] = []
    for token in gen.output_ids:
        if gen.max_tokens is not None and len(out) >= gen.max_tokens:
            break
        out.append(token)
        if token in gen.stop_ids:
            break
    return out


def _pieces(tok: SimTokenizer, ids: Sequence[int]) -> list[str]:
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
