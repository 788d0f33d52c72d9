"""Every example runs as its own process against the router + simulator stack."""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests._support.integration import ADAPTER_SOURCES, ROOT, run_process
from tests._support.stack import Stack

pytestmark = pytest.mark.e2e

EXAMPLES = ROOT / "examples"
RECEIPT = re.compile(
    r"\[agentkv\] conversation=(?P<conv>\S+) turn=(?P<turn>\d+) epoch=(?P<epoch>\d+) "
    r"decision=(?P<decision>\w+) reused=(?P<reused>\d+)"
)
SUMMARY = re.compile(
    r"summary: (?P<turns>\d+) turns, (?P<reused>[\d,]+) of [\d,]+ prompt tokens reused.*"
    r"TTFT saved (?P<saved>[\d,]+) ms"
)
# (script, conversation it must keep, whether its history is rewritten on the way)
CASES = [
    ("openai_tool_loop.py", None, False),
    ("langgraph_react.py", "langgraph-example", True),
    ("llamaindex_function_agent.py", "llamaindex-example", True),
    ("openai_agents_session.py", "agents-example", True),
]


@pytest.mark.parametrize(("script", "conversation", "rewritten"), CASES)
def test_example_runs_and_prints_its_receipts(
    pd: Stack, script: str, conversation: str | None, rewritten: bool
) -> None:
    sources = [str(p) for p in ADAPTER_SOURCES]
    path = os.pathsep.join([*sources, os.environ.get("PYTHONPATH", "")])
    url = f"{pd.router.url}/v1"
    env = {**os.environ, "PYTHONPATH": path}
    args = [sys.executable, str(EXAMPLES / script), "--base-url", url, "--simulate-tools"]
    done = run_process(args, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    receipts = [m.groupdict() for m in RECEIPT.finditer(done.stdout)]
    assert len(receipts) >= 5, done.stdout
    # the conversation the script names, made unique to the run ("name-<8 hex>")
    own = re.compile(
        rf"{conversation}-[0-9a-f]{{8}}" if conversation else re.escape(receipts[0]["conv"])
    )
    main = [r for r in receipts if own.fullmatch(r["conv"])]
    assert len({r["conv"] for r in main}) == 1, receipts
    assert int(main[-1]["turn"]) == len(main)  # one conversation, every turn of it
    assert main[0]["decision"] == "miss"
    reused = sum(r["decision"] in ("pull", "decode") for r in main)
    assert reused >= len(main) - 1 - int(rewritten), main
    assert ("rewrite=sync" in done.stdout) == rewritten
    if rewritten:
        assert int(main[-1]["epoch"]) >= 1
    assert pd.wrong_kv() == 0
    summary = SUMMARY.search(done.stdout)
    assert summary is not None, done.stdout
    reused = sum(int(r["reused"]) for r in receipts)
    assert int(summary["reused"].replace(",", "")) == reused > 0
    assert int(summary["turns"]) == len(receipts)
    assert float(summary["saved"].replace(",", "")) > 0
    if conversation is not None:  # a rerun: a new conversation, not the last run's (stale)
        again = run_process(done.args, env=env, cwd=ROOT)
        assert again.returncode == 0, again.stdout + again.stderr
        rerun = [m.groupdict() for m in RECEIPT.finditer(again.stdout)]
        first = next(r for r in rerun if own.fullmatch(r["conv"]))
        assert first["conv"] != main[0]["conv"] and first["decision"] == "miss"
        assert "stale" not in {r["decision"] for r in rerun}
