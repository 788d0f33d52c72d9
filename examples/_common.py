"""What every example shares: its command line and the per-turn receipt line."""

from __future__ import annotations

import argparse
import os
from typing import Any

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


def print_receipt(conversation: Any, receipt: agentkv.TurnReceipt) -> None:
    """One line per turn: the conversation, its epoch and what the router reused."""
    rewrite = f" rewrite={receipt.rewrite.reason}" if receipt.rewrite else ""
    print(
        f"  [agentkv] conversation={receipt.conversation_id} turn={receipt.turn} "
        f"epoch={receipt.epoch} decision={receipt.decision} reused={receipt.reused_tokens} "
        f"cached={receipt.cached_tokens} prompt={receipt.prompt_tokens} "
        f"ids={len(conversation.token_ids or [])}{rewrite}",
        flush=True,
    )
