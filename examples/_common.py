"""What every example shares: its command line, its connection and the per-turn receipt line."""

from __future__ import annotations

import argparse
import os
import uuid
from typing import Any

from _sim import Scripts, clients

import agentkv


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--base-url",
        default=os.environ.get("AGENTKV_BASE_URL", "http://127.0.0.1:8000/v1"),
        help="agentkv's OpenAI-compatible URL (agentkv serve, or the router)",
    )
    parser.add_argument("--model", default="agentkv-sim", help="the served model name")
    parser.add_argument("--api-key", default=os.environ.get("AGENTKV_API_KEY", "agentkv"))
    parser.add_argument(
        "--simulate-tools",
        action="store_true",
        help="script the answers with the agentkv simulator's test hook, so that its model "
        "calls the tools (leave it off against a real model)",
    )
    return parser.parse_args()


def connection(args: argparse.Namespace, scripts: Scripts) -> dict[str, Any]:
    """An adapter's connection arguments: with ``--simulate-tools``, agentkv clients whose chat
    requests carry ``scripts`` (``client``, ``async_client``), else ``base_url`` and ``api_key``."""
    if not args.simulate_tools:
        return {"base_url": args.base_url, "api_key": args.api_key}
    client, async_client = clients(args.base_url, scripts, args.api_key)
    return {"client": client, "async_client": async_client}


RUN = uuid.uuid4().hex[:8]
_RECEIPTS: list[agentkv.TurnReceipt] = []


def conversation_id(name: str) -> str:
    """``name`` made unique to this run: a rerun starts a new conversation (the same id would
    meet the previous run's handle, whose history the new prompt does not extend: stale)."""
    return f"{name}-{RUN}"


def reused(receipt: agentkv.TurnReceipt) -> int:
    """The prompt tokens the turn did not recompute: what P read back from D (``pull``), or
    what D found in its own prefix cache on a turn decoded in place (``decode``, ``cpu``)."""
    if receipt.decision in ("decode", "cpu"):
        return receipt.cached_tokens or 0
    return receipt.reused_tokens or 0


def print_receipt(conversation: Any, receipt: agentkv.TurnReceipt) -> None:
    """One line per turn: the conversation, its epoch and what the router reused."""
    _RECEIPTS.append(receipt)
    rewrite = f" rewrite={receipt.rewrite.reason}" if receipt.rewrite else ""
    print(
        f"  [agentkv] conversation={receipt.conversation_id} turn={receipt.turn} "
        f"epoch={receipt.epoch} decision={receipt.decision} reused={reused(receipt)} "
        f"cached={receipt.cached_tokens} prompt={receipt.prompt_tokens} "
        f"ids={len(conversation.token_ids or [])}{rewrite}",
        flush=True,
    )


def print_summary() -> None:
    """The run in one line: prompt tokens reused, and the TTFT that saved. Behind agentkv's
    simulator the TTFT is its cost model's (noise-free): the turns as they ran, against the
    same prompts recomputed, with the local profile's cost model (the laptop preset)."""
    turns = len(_RECEIPTS)
    prompt = sum(r.prompt_tokens for r in _RECEIPTS)
    total = sum(reused(r) for r in _RECEIPTS)
    share = f" ({total / prompt:.0%})" if prompt else ""
    line = f"summary: {turns} turns, {total:,} of {prompt:,} prompt tokens reused{share}"
    modelled = [r for r in _RECEIPTS if r.model_ttft_ms is not None]
    if modelled:
        from agentkv.sim.costmodel import PRESETS

        cost = PRESETS["laptop"]
        recompute = sum(cost.ttft_s(r.prompt_tokens, 0) for r in modelled) * 1000
        as_run = sum(cost.ttft_s(r.prompt_tokens, reused(r)) for r in modelled) * 1000
        line += (
            f"; TTFT saved {recompute - as_run:,.0f} ms of {recompute:,.0f} ms "
            "(these turns against the same prompts recomputed, by the simulator's laptop "
            "cost model)"
        )
    else:
        line += "; TTFT saved: this server models no TTFT (compare with agentkv bench replay)"
    print(line, flush=True)
