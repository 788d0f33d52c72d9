"""vLLM's OpenAI surface over the engine: request parsing.

Chat and completions requests become a :class:`RequestPlan` around a
:class:`~agentkv.sim.requests.GenRequest` (the answer's text, its script and stop strings:
:mod:`agentkv.sim.answer_text`); :mod:`agentkv.sim.responses` turns the engine's events into
vLLM 0.33's JSON bodies or SSE chunks.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from agentkv.chat.template import ChatTemplate, TemplateError
from agentkv.chat.tokenizer import ChatTokenizer
from agentkv.protocol import KVTransferParams
from agentkv.protocol import kv_transfer as kvt
from agentkv.protocol.errors import APIError
from agentkv.sim.answer_text import (
    StopHit,
    find_stop,
    output_seed,
    request_script,
    stop_strings,
)
from agentkv.sim.config import SimConfig
from agentkv.sim.requests import GenRequest
from agentkv.sim.script import SimScript, generate_text, native_syntax_for, render_script

__all__ = [
    "SYSTEM_FINGERPRINT",
    "RequestPlan",
    "SimRenderer",
    "plan_chat",
    "plan_completion",
]

_REUSED_IDS = "kv_transfer_params.prompt_token_ids"
SYSTEM_FINGERPRINT = "vllm-0.33.0-a9e7c5e1"
"""vLLM 0.33 (``--fingerprint-mode full``) sends ``vllm-<version>-<8 hex of its config hash>`` on
every response and on a stream's usage chunk; the simulator's is fixed."""
# vLLM's ``VLLMValidationError`` appends the parameter to its message.
_REUSED_IDS_PARAM = f"parameter={_REUSED_IDS}"


@dataclass
class RequestPlan:
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
    """On D: P's prefix-cache hit, from P's handle (what D reports as ``cached_tokens``)."""
    thinking: bool = True
    seed: int = 0
    tool_choice: str = "auto"
    stop: StopHit | None = None
    """The stop string that ends the planned output, if one does."""
    continuous_usage: bool = False
    """``stream_options.continuous_usage_stats`` (with ``include_usage``): usage on every chunk."""
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class SimRenderer:
    """Tokenizer + template + configuration: turns requests into prompts and outputs."""

    config: SimConfig
    tokenizer: ChatTokenizer
    template: ChatTemplate

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    # -- prompts -----------------------------------------------------------------------------
    def render_chat(self, body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "`messages` must be a non-empty list.", param="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, "Each message needs a string `role`.", param="messages")
            if not isinstance(m.get("content"), (str, list, type(None))):
                raise APIError(
                    400,
                    "A message's `content` must be a string, a list of content parts or null.",
                    param="messages",
                )
        add_gen = body.get("add_generation_prompt", True)
        cont = body.get("continue_final_message", False)
        if add_gen and cont:
            raise APIError(
                400,
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            )
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise APIError(400, "`chat_template_kwargs` must be an object.")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise APIError(400, "`tools` must be a list.", param="tools")
        try:
            template = self.template
            if isinstance(body.get("chat_template"), str):
                special = self.tokenizer.special_tokens_map
                template = ChatTemplate(
                    body["chat_template"], name="request", special_tokens=special
                )
            return template.render_request(
                messages,
                tools=tools,
                add_generation_prompt=bool(add_gen),
                continue_final_message=bool(cont),
                **kwargs,
            )
        except TemplateError as exc:
            # vLLM (``safe_apply_chat_template``): 400 with the template's own reason.
            raise APIError(400, str(exc)) from exc
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param="messages") from exc

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
                raise APIError(
                    400,
                    "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of "
                    f"non-negative integers. ({_REUSED_IDS_PARAM})",
                    param=_REUSED_IDS,
                )
            # vLLM's ``validate_token_ids`` names the largest id out of range.
            bad = [t for t in ids if not self.tokenizer.is_valid_id(t)]
            if bad:
                raise APIError(
                    400,
                    f"Token id {max(bad)} is out of vocabulary ({_REUSED_IDS_PARAM})",
                    param=_REUSED_IDS,
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
        raise APIError(
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
        min_tokens: int = 0,
    ) -> tuple[list[int], StopHit | None]:
        """The tokens the model will emit, and the stop string that ends them (if any)."""
        script = request_script(body, self.config.prompt_scripts)
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
            seed = output_seed(body, prompt_ids)
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
        ignore_eos = bool(body.get("ignore_eos"))
        if ignore_eos or len(ids) < min_tokens:
            want = max(min_tokens, max_tokens or 0) if ignore_eos else min_tokens
            # Never more than the engine can emit (the caller checked min_tokens against it).
            want = min(want, max(0, self.config.max_model_len - len(prompt_ids)))
            filler = 0
            while len(ids) < want:
                ids += self.tokenizer.encode(
                    generate_text(output_seed(body, prompt_ids) + filler, 256)
                )
                filler += 1
            if ignore_eos:
                end_with_eos = False
        hit = None
        stops = stop_strings(body)
        if stops:
            hit = find_stop(self.tokenizer, ids, stops, min_tokens)
            if hit is not None:
                ids = ids[: hit.num_tokens]
                end_with_eos = False
        if end_with_eos and eos is not None:
            ids.append(eos)
        if not ids:
            ids = [eos] if eos is not None else self.tokenizer.encode(".")
        return ids, hit

    def stop_ids(self) -> frozenset[int]:
        return frozenset() if self.eos_id is None else frozenset({self.eos_id})


def _opens_think(text: str) -> bool:
    stripped = text.rstrip()
    return stripped.endswith("<think>")


def _int_field(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise APIError(400, f"`{name}` must be a positive integer.", param=name)
        return value
    return None


def _check_handle(kv: dict[str, Any]) -> None:
    """Reject handle fields of the wrong type before the engine acts on any of them (vLLM's
    connector would fail inside the engine). ``prompt_token_ids`` has its own checks."""
    fields = {k: v for k, v in kv.items() if k != "prompt_token_ids"}
    try:
        KVTransferParams.model_validate(fields)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        where = ".".join(str(part) for part in errors[0]["loc"])
        detail = "; ".join(
            f"{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in errors
        )
        raise APIError(
            400,
            f"Invalid `kv_transfer_params`: {detail}",
            param=f"kv_transfer_params.{where}" if where else "kv_transfer_params",
        ) from exc


def _common(body: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise APIError(400, "`kv_transfer_params` must be an object.", param="kv_transfer_params")
    if kv is not None:
        _check_handle(kv)
    seed = body.get("seed")
    if seed is not None and (
        not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**63
    ):
        raise APIError(400, "`seed` must be a 64-bit integer.", param="seed")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise APIError(400, "The simulator serves n=1 only.", param="n")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise APIError(400, "`cache_salt` must be a string.", param="cache_salt")
    return (dict(kv) if kv is not None else None), salt


def _plan(r: SimRenderer, body: dict[str, Any], *, chat: bool, request_id: str) -> RequestPlan:
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
    room = r.config.max_model_len - len(prompt_ids)  # what the context leaves for output
    min_tokens = _min_tokens(body, max_tokens, room)
    kwargs = body.get("chat_template_kwargs") or {}
    thinking = bool(kwargs.get("enable_thinking", kwargs.get("thinking", True)))
    out, stop = r.output_ids(
        body,
        prompt_ids,
        chat=chat,
        max_tokens=max_tokens,
        thinking=thinking,
        prompt_ends_in_think=ends_in_think,
        min_tokens=min_tokens,
    )
    script = request_script(body, r.config.prompt_scripts)
    if stop is None and script is not None and script.finish_reason == "length":
        # The engine reports ``length`` when it stops at its limit: make the script's end one.
        if max_tokens is not None:
            max_tokens = min(max_tokens, len(out))
        elif len(out) < room:
            max_tokens = len(out)
    tool_choice = body.get("tool_choice", "auto")
    stream = bool(body.get("stream"))
    opts = body.get("stream_options") or {}
    tools = body.get("tools") if isinstance(body.get("tools"), list) else None
    remote_cached = kvt.prefill_cached_tokens(kv) if kv is not None else None
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
    return RequestPlan(
        gen=gen,
        chat=chat,
        model=str(body.get("model") or r.config.served_model_name),
        stream=stream,
        include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
        continuous_usage=bool(
            isinstance(opts, dict)
            and opts.get("include_usage")
            and opts.get("continuous_usage_stats")
        ),
        return_token_ids=bool(body.get("return_token_ids")),
        parse_tools=bool(tools) and tool_choice != "none",
        tools=tools,
        prompt_ends_in_think=ends_in_think,
        remote_cached_tokens=remote_cached,
        thinking=thinking,
        seed=output_seed(body, prompt_ids),
        tool_choice="none" if tool_choice == "none" else "auto",
        stop=stop,
    )


def _min_tokens(body: dict[str, Any], max_tokens: int | None, room: int) -> int:
    """``min_tokens`` checked as vLLM's ``SamplingParams`` does; ``room`` is what the context
    leaves for output (vLLM's default ``max_tokens``)."""
    value = body.get("min_tokens")
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise APIError(400, "`min_tokens` must be an integer.", param="min_tokens")
    if value < 0:
        raise APIError(
            400, f"min_tokens must be greater than or equal to 0, got {value}.", param="min_tokens"
        )
    limit = max_tokens if max_tokens is not None else room
    if value > limit > 0:
        raise APIError(
            400,
            f"min_tokens must be less than or equal to max_tokens={limit}, got {value}.",
            param="min_tokens",
        )
    return value


def plan_chat(r: SimRenderer, body: dict[str, Any], base_id: str | None) -> RequestPlan:
    return _plan(r, body, chat=True, request_id=_request_id("chatcmpl", base_id))


def plan_completion(r: SimRenderer, body: dict[str, Any], base_id: str | None) -> RequestPlan:
    return _plan(r, body, chat=False, request_id=_request_id("cmpl", base_id))


def _request_id(prefix: str, base: str | None) -> str:
    return f"{prefix}-{base or uuid.uuid4().hex}-{uuid.uuid4().hex[:8]}"
