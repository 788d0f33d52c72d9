"""What the integration tests share: the model name and the per-turn recorder."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import agentkv

ROOT = Path(__file__).resolve().parents[2]
# Where each adapter's import packages live: src/ (langchain-agentkv, agentkv-openai-agents), or
# the project folder itself (llama-index-llms-agentkv: the llama_index/llms/ namespace layout).
ADAPTER_SOURCES = [
    folder / "src" if (folder / "src").is_dir() else folder
    for folder in sorted((ROOT / "integrations").iterdir())
    if (folder / "pyproject.toml").is_file()
]
MODEL = "agentkv-sim"
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: be brief." for i in range(20))
# .ci/run's lower-bounds stage: the frameworks at their declared floors (.ci/lower-bounds.txt)
LOWER_BOUNDS = os.environ.get("AGENTKV_LOWER_BOUNDS") == "1"


def run_process(
    args: list[str], *, env: Mapping[str, str], cwd: Path, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run a child process to its end, its output captured as text (checked by the caller)."""
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=dict(env), cwd=cwd
    )


@dataclass
class Seen:
    conversation_id: str
    receipt: agentkv.TurnReceipt
    token_ids: list[int]
    mode: str


@dataclass
class Recorder:
    """An ``on_turn`` callback: every turn's receipt and the conversation's ids after it."""

    turns: list[Seen] = field(default_factory=list)

    def __call__(self, conversation: Any, receipt: agentkv.TurnReceipt) -> None:
        ids = list(conversation.token_ids or [])
        self.turns.append(Seen(conversation.id, receipt, ids, conversation.mode))

    def of(self, conversation_id: str) -> list[Seen]:
        return [t for t in self.turns if t.conversation_id == conversation_id]

    def ids(self) -> list[str]:
        return list(dict.fromkeys(t.conversation_id for t in self.turns))

    def assert_only_exact(self, conversation_id: str) -> None:
        """The test's one conversation is ``conversation_id``, and it is token-exact."""
        self.assert_exact(conversation_id)
        assert self.ids() == [conversation_id]

    def assert_exact(self, conversation_id: str) -> None:
        """Within an epoch every prompt is the previous prompt + its output + the new messages,
        and every turn after an epoch's first one reused D's KV through the router."""
        turns = self.of(conversation_id)
        assert turns, f"no turn of {conversation_id}"
        for seen in turns:
            assert seen.mode == "exact" and seen.receipt.mode == "exact"
        for prev, cur in pairwise(turns):
            if cur.receipt.epoch != prev.receipt.epoch:
                assert cur.receipt.epoch == prev.receipt.epoch + 1
                assert cur.receipt.rewrite is not None
                assert_rewrite_reads_only_what_survived(cur.receipt)
                continue
            assert cur.token_ids[: len(prev.token_ids)] == prev.token_ids
            assert cur.receipt.decision in REUSED, cur.receipt
            assert reused(cur.receipt) >= len(prev.token_ids) - 16, cur.receipt


REUSED = ("pull", "decode")
"""The decisions of a turn that reused D's KV of its history: read back by P (``pull``), or
decoded on that D in place (``decode``, the default ``paths.mode``'s pick for a short turn)."""


def reused(receipt: agentkv.TurnReceipt) -> int:
    """The history's tokens a turn did not recompute: what P read back, or on a ``decode``
    turn what D found in its own prefix cache (the answer's ``cached_tokens``)."""
    if receipt.decision == "decode":
        return receipt.cached_tokens or 0
    return receipt.reused_tokens or 0


def assert_rewrite_reads_only_what_survived(receipt: agentkv.TurnReceipt) -> None:
    """A rewrite turn drops D's handle (``stale``, ``recompute``) or, since the router's planner
    trims it to the verified prefix, reuses that prefix (``pull`` or ``decode``): never more
    than survived the rewrite."""
    assert receipt.decision in ("stale", "recompute", *REUSED), receipt
    if receipt.decision in REUSED:
        assert receipt.trim_cause == "rewrite" and receipt.rewrite is not None, receipt
        survived = receipt.rewrite.surviving_tokens
        got = reused(receipt)
        assert got > 0 and (survived is None or got <= survived), receipt


def adapter_settings(sdk_clients: tuple[Any, Any], recorder: Recorder) -> dict[str, Any]:
    """A chat model's arguments in these tests: the served model, the scripted agentkv clients
    (the ``sdk_clients`` fixture), short answers, and ``recorder`` as ``on_turn``."""
    client, async_client = sdk_clients
    return {
        "model": MODEL,
        "client": client,
        "async_client": async_client,
        "max_tokens": 200,
        "on_turn": recorder,
    }
