"""How a response (or a stream of chunks) becomes a turn, and drift diagnosis.

Sans-IO helpers shared by the sync and async conversations.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from agentkv._drift import classify_drift
from agentkv._ledger import Ledger, TurnResult
from agentkv._receipt import Drift
from agentkv.protocol.deltas import DeltaFold

__all__ = [
    "AgentKVWarning",
    "StreamAccumulator",
    "check_exact",
    "diagnose",
    "drift_windows",
    "result_from_completion",
]


class AgentKVWarning(UserWarning):
    """Something reduced reuse or exactness without failing the turn."""


def _dump(obj: Any) -> dict[str, Any]:
    dump = getattr(obj, "model_dump", None)
    data = dump() if callable(dump) else obj
    return data if isinstance(data, dict) else {}


def _assistant(message: Mapping[str, Any]) -> dict[str, Any]:
    """The assistant message as generated, in the shape clients send back."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        out["reasoning"] = reasoning
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": c.get("type") or "function",
                "function": {
                    "name": (c.get("function") or {}).get("name"),
                    "arguments": (c.get("function") or {}).get("arguments") or "",
                },
            }
            for c in calls
        ]
    return out


def _extra(obj: Any, name: str) -> Any:
    """A vLLM field the openai types do not declare (kept in ``model_extra``)."""
    extra = getattr(obj, "model_extra", None)
    if isinstance(extra, dict):
        return extra.get(name)
    return obj.get(name) if isinstance(obj, Mapping) else None


def result_from_completion(
    completion: Any, headers: Mapping[str, str], latency_s: float
) -> TurnResult:
    """The turn in a ``ChatCompletion`` (without copying its token-id lists)."""
    choice = completion.choices[0] if completion.choices else None
    usage = completion.usage
    return TurnResult(
        message=_assistant(_dump(choice.message) if choice is not None else {}),
        prompt_token_ids=_extra(completion, "prompt_token_ids"),
        output_token_ids=_extra(choice, "token_ids") if choice is not None else None,
        finish_reason=choice.finish_reason if choice is not None else None,
        usage=_dump(usage) if usage is not None else None,
        headers=dict(headers),
        latency_s=latency_s,
        request_id=completion.id,
        response_model=getattr(completion, "model", None) or None,
    )


class StreamAccumulator:
    """Collects a streamed turn: text, reasoning, tool calls, token ids, usage."""

    def __init__(
        self, headers: Mapping[str, str], started: float, chat_kwargs: Mapping[str, Any]
    ) -> None:
        self.headers = dict(headers)
        self.started = started
        options = chat_kwargs.get("stream_options") or {}
        self.user_wants_usage = bool(options.get("include_usage"))
        self.message = DeltaFold()
        self.token_ids: list[int] = []
        self.prompt_token_ids: list[int] | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.ttft_s: float | None = None
        self.request_id: str | None = None
        self.response_model: str | None = None

    def add(self, chunk: Any) -> bool:
        """Take one chunk; returns whether to pass it on to the caller."""
        data = _dump(chunk)
        self.request_id = self.request_id or data.get("id")
        self.response_model = self.response_model or data.get("model") or None
        if data.get("prompt_token_ids") is not None:
            self.prompt_token_ids = list(data["prompt_token_ids"])
        if data.get("usage"):
            self.usage = data["usage"]
        choices = data.get("choices") or []
        for choice in choices:
            delta = choice.get("delta") or {}
            got = self.message.feed(delta) or bool(delta.get("tool_calls"))
            if choice.get("token_ids"):
                self.token_ids.extend(choice["token_ids"])
                got = True
            if got and self.ttft_s is None:
                self.ttft_s = time.perf_counter() - self.started
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return bool(choices) or self.user_wants_usage or not data.get("usage")

    def result(self) -> TurnResult:
        return TurnResult(
            message=self.message.message(),
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=self.token_ids or None,
            finish_reason=self.finish_reason,
            usage=self.usage,
            headers=self.headers,
            latency_s=time.perf_counter() - self.started,
            ttft_s=self.ttft_s,
            request_id=self.request_id,
            response_model=self.response_model,
        )


def check_exact(ledger: Ledger, prompt_ids: list[int], result: TurnResult) -> list[int] | None:
    """The prompt ids to record for an exact-mode turn, or None when the server did not honour
    them (then the conversation falls back to messages mode, with a warning)."""
    problem = None
    got = result.prompt_token_ids
    if result.output_token_ids is None:
        problem = "the server returned no token ids (return_token_ids)"
    elif got is not None and (
        len(got) != len(prompt_ids)
        or got[:256] != prompt_ids[:256]
        or got[-256:] != prompt_ids[-256:]
    ):
        # length and both ends: a server that re-rendered the messages differs in all three
        problem = "the server ignored kv_transfer_params.prompt_token_ids (vLLM >= 0.33 honours it)"
    if problem is None:
        return prompt_ids
    ledger.mode = "messages"
    warnings.warn(
        f"agentkv: conversation {ledger.id} falls back to messages mode: {problem}.",
        AgentKVWarning,
        stacklevel=5,
    )
    return None


def drift_windows(ledger: Ledger, result: TurnResult) -> list[list[int]]:
    """Messages mode: the id windows whose text explains a drift (empty when none)."""
    point = _divergence(ledger, result)
    if point is None:
        return []
    expected, actual, at = point
    lo = max(0, at - 24)
    return [expected[lo : at + 48], actual[lo : at + 48]]


def _divergence(ledger: Ledger, result: TurnResult) -> tuple[list[int], list[int], int] | None:
    expected = ledger.expected_prefix()
    actual = result.prompt_token_ids
    if expected is None or actual is None:
        return None
    at = 0
    limit = min(len(expected), len(actual))
    while at < limit and expected[at] == actual[at]:
        at += 1
    if at == len(expected):
        return None
    return expected, actual, at


def diagnose(ledger: Ledger, result: TurnResult, texts: Sequence[str]) -> Drift | None:
    """Messages mode: where and why the re-rendered prompt stopped extending the last turn.

    ``texts`` are the decoded :func:`drift_windows` (expected, actual)."""
    point = _divergence(ledger, result)
    if point is None:
        return None
    expected, _actual, at = point
    before = ledger.last_prompt_ids or []
    in_output = at >= len(before)
    hazard, detail = classify_drift(
        expected_text=texts[0] if texts else "",
        actual_text=texts[1] if len(texts) > 1 else "",
        in_output=in_output,
        messages=ledger.messages,
    )
    index = ledger.message_at_token(at)
    drift = Drift(
        matched_tokens=at,
        expected_tokens=len(expected),
        message_index=index,
        hazard=hazard,
        detail=detail,
    )
    if not ledger.warned_drift:
        ledger.warned_drift = True
        warnings.warn(
            f"agentkv: conversation {ledger.id}: the re-rendered prompt keeps {at} of "
            f"{len(expected)} tokens of the last turn ({hazard}: {detail}). Use mode='exact' "
            "to keep every token.",
            AgentKVWarning,
            stacklevel=5,
        )
    return drift
