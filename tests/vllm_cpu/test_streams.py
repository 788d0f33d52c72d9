"""The simulator's streamed chunk layout against real vLLM 0.33, for the same requests.

P (``max_tokens`` 1, ``do_remote_decode``) and then D (P's handle, a few tokens, ``ignore_eos``)
are asked the same streamed request, on the chat and the completions endpoint, with
``include_usage`` and ``return_token_ids``. Each chunk becomes its shape: which of role, text,
token_ids, prompt ids, finish_reason, a non-null ``kv_transfer_params`` and usage it carries (and
its top-level keys); runs of equal shapes count once, since real vLLM puts several tokens in one
chunk when its reader lags. The two engines must give the same sequence, and handles with the
same fields.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests._support.vllm_scenarios import MODEL, SHAPES, Stack

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(900)]

MESSAGES = [
    {"role": "system", "content": "[shapes] " + "Chunk layout probe. " * 30},
    {"role": "user", "content": "hi"},
]
REQUESTS: dict[str, dict[str, Any]] = {
    # no thinking: real vLLM runs without a reasoning parser, the simulator with one
    "/v1/chat/completions": {
        "messages": MESSAGES,
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "/v1/completions": {"prompt": "[shapes] " + "Chunk layout probe. " * 40},
}
COMMON = {
    "model": MODEL,
    "temperature": 0,
    "return_token_ids": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        lines = list(r.iter_lines())
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]", lines[-3:]
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def shape(chunk: dict[str, Any]) -> str:
    parts = []
    choices = chunk.get("choices") or []
    if not choices:
        parts.append("no choices")
    for choice in choices:
        delta = choice.get("delta") or {}
        if delta.get("role"):
            parts.append("role")
        if delta.get("content") or delta.get("reasoning") or choice.get("text"):
            parts.append("text")
        if choice.get("token_ids"):
            parts.append("token_ids")
        if choice.get("prompt_token_ids"):
            parts.append("prompt ids")
        if choice.get("finish_reason"):
            parts.append("finish_reason")
    if chunk.get("prompt_token_ids"):
        parts.append("prompt ids")
    if chunk.get("kv_transfer_params") is not None:
        parts.append("handle")
    if chunk.get("usage") is not None:
        parts.append("usage")
    return "+".join(parts) + " {" + ",".join(sorted(chunk)) + "}"


def runs(shapes: list[str]) -> list[str]:
    out: list[str] = []
    for s in shapes:
        if not out or out[-1] != s:
            out.append(s)
    return out


def layout(stack: Stack, endpoint: str) -> dict[str, Any]:
    body = {**COMMON, **REQUESTS[endpoint]}
    p = stream(
        f"{stack.prefill}{endpoint}",
        {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    p_handles = [c["kv_transfer_params"] for c in p if c.get("kv_transfer_params") is not None]
    assert len(p_handles) == 1, p
    d = stream(
        f"{stack.decode}{endpoint}",
        {**body, "max_tokens": 6, "ignore_eos": True, "kv_transfer_params": p_handles[0]},
    )
    d_handles = [c["kv_transfer_params"] for c in d if c.get("kv_transfer_params") is not None]
    assert len(d_handles) == 1, d
    usage = d[-1]["usage"]
    assert usage["completion_tokens"] == 6
    # the handle covers prompt + output - 1 tokens, in ceil(that / block size) blocks
    assert d_handles[0]["remote_num_tokens"] == usage["prompt_tokens"] + 6 - 1
    assert len(d_handles[0]["remote_block_ids"][0]) == -(-d_handles[0]["remote_num_tokens"] // 32)
    return {
        "P": runs([shape(c) for c in p]),
        "D": runs([shape(c) for c in d]),
        "P handle": sorted(p_handles[0]),
        "D handle": sorted(d_handles[0]),
    }


@pytest.mark.parametrize("endpoint", list(REQUESTS))
def test_simulator_streams_the_chunks_real_vllm_streams(
    real: Stack, sim: Stack, endpoint: str
) -> None:
    got_real, got_sim = layout(real, endpoint), layout(sim, endpoint)
    for role in ("P", "D"):
        SHAPES[(endpoint, role)] = [s.split(" {")[0] for s in got_real[role]]
    # the handle is on the chunk with finish_reason; content chunks carry a null one; the
    # trailing usage chunk has no choices and no handle
    assert got_real["D"][-2].startswith("text+token_ids+finish_reason+handle")
    assert got_real["D"][-1].startswith("no choices+usage")
    assert got_sim == got_real
