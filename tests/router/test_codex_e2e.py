"""Codex CLI, unmodified, against the router: ``codex exec`` headless over ``/v1/responses``.

Codex is installed from npm once into ``~/.cache/agentkv/harness`` (reused across runs; the test
is skipped, saying why, only when npm or its registry cannot be reached). Codex speaks only the
Responses API, streamed, ``store: false``, with its session id as ``prompt_cache_key``
(``/work/shared/reference/agent-harnesses.md``).

A simulated model does not call tools on its own, and Codex lets no one add a body field, so the
simulators run with ``--prompt-scripts``: the user's prompt carries the model's answers (a call
of Codex's ``exec_command`` tool, then an answer to the tool's output). Codex runs the command
itself and sends its whole input again, and a second turn (``codex exec resume --last``) sends
it all once more: every request after the first must pull its predecessor's KV.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv.protocol.promtext import parse_metrics
from tests._support.stack import MODEL, Stack, stack

# paths.mode = "pull" (tests/_support/router_config.py): these tests check P's reads of
# D's KV (decision `pull`, X-AgentKV-Reused-Tokens, P's counters), which the default
# `choose` skips for a short turn by decoding it on D in place (test_paths_e2e.py)
pytestmark = [pytest.mark.e2e, pytest.mark.paths_pull]

CODEX = "@openai/codex@0.171.0"
HARNESS = Path.home() / ".cache" / "agentkv" / "harness"


def codex_binary() -> Path:
    """Codex from npm, installed once into the harness cache."""
    binary = HARNESS / "node_modules" / ".bin" / "codex"
    manifest = HARNESS / "node_modules" / "@openai" / "codex" / "package.json"
    wanted = CODEX.rsplit("@", 1)[1]
    if binary.exists() and json.loads(manifest.read_text()).get("version") == wanted:
        return binary
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: Codex CLI comes from the npm registry")
    HARNESS.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", CODEX],
            cwd=HARNESS,
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        pytest.skip("npm install of Codex CLI timed out (is the npm registry reachable?)")
    if done.returncode != 0 or not binary.exists():
        pytest.skip(f"npm could not install {CODEX} (registry unreachable?): {done.stderr[-400:]}")
    return binary


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with stack(tmp_path_factory.mktemp("codex")) as s:
        yield s


def run_codex(
    binary: Path, base_url: str, tmp: Path, prompt: str, *, resume: bool = False
) -> list[dict[str, Any]]:
    """``codex exec --json`` headless (``resume --last``: the next turn of the last session),
    its own HOME, no sandbox (the test machine may lack user namespaces); its JSON events."""
    home = tmp / "home"
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    (work / "notes.txt").write_text("hello\n")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CODEX_HOME": str(home / ".codex"),
        "OPENAI_API_KEY": "sk-local",
    }
    provider = (
        f'model_providers.local={{name="local",base_url="{base_url}/v1",'
        'wire_api="responses",env_key="OPENAI_API_KEY"}'
    )
    # fmt: off
    argv = [
        str(binary), "exec", "--skip-git-repo-check", "--json",
        "--dangerously-bypass-approvals-and-sandbox",
        "-c", "model_provider=local", "-c", provider, "-m", MODEL,
        *(["resume", "--last"] if resume else []), prompt,
    ]
    # fmt: on
    done = subprocess.run(
        argv,
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_codex_exec_one_turn(pd: Stack, tmp_path: Path) -> None:
    binary = codex_binary()
    events = run_codex(binary, pd.router.url, tmp_path, "Say hello.")
    messages = agent_messages(events)
    assert len(messages) == 1 and messages[0].strip()
    (usage,) = [e["usage"] for e in events if e.get("type") == "turn.completed"]
    assert usage["input_tokens"] > 1000 and usage["output_tokens"] > 0
    # Codex's session id (prompt_cache_key) named the conversation: D's handle is kept for it
    health = httpx.get(f"{pd.router.url}/health", timeout=10).json()
    assert health["handles"] >= 1
    assert pd.wrong_kv() == 0


def agent_messages(events: list[dict[str, Any]]) -> list[str]:
    return [
        e["item"]["text"]
        for e in events
        if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"
    ]


SCRIPT = [
    {
        "reasoning": "I will list the files.",
        "content": "",
        "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "ls"}}],
    },
    {"content": "There is one file: notes.txt."},
]
"""The simulated model's two answers to each user prompt: a call of Codex's ``exec_command``
tool, then a text answer after the tool's output."""


def test_codex_exec_tool_rounds_over_two_turns_pull(tmp_path: Path) -> None:
    """Nothing between Codex and the router: the script rides in the user's own prompt
    (``--prompt-scripts``), and Codex's own session signals name the conversation."""
    binary = codex_binary()
    common = ("--time-scale", "0", "--block-size", "16", "--prompt-scripts")
    (tmp_path / "stack").mkdir()
    with stack(tmp_path / "stack", common=common) as s:
        marker = "agentkv_sim: " + json.dumps(SCRIPT)
        first_turn = run_codex(binary, s.router.url, tmp_path, f"List the files here. {marker}")
        second_turn = run_codex(
            binary, s.router.url, tmp_path, f"List them again. {marker}", resume=True
        )
        text = httpx.get(f"{s.router.url}/metrics", timeout=10).text
        wrong = s.wrong_kv()
    decisions = {
        k.split("[")[1].rstrip("]"): v
        for k, v in parse_metrics(text, by="decision").items()
        if k.startswith("agentkv_router_requests_total[")
    }
    sources = {
        k.split("[")[1].rstrip("]"): v
        for k, v in parse_metrics(text, by="source").items()
        if k.startswith("agentkv_router_conversation_sources_total[")
    }
    # four requests (two per turn: the call, then the answer to its output), one session:
    # every request after the first reads the KV its predecessor left on D
    assert decisions == {"miss": 1, "pull": 3}, decisions
    assert sum(sources.values()) == 4 and set(sources) <= {"codex", "prompt-cache-key"}, sources
    assert agent_messages(first_turn) == ["There is one file: notes.txt."]
    assert agent_messages(second_turn) == ["There is one file: notes.txt."]
    commands = [
        e["item"]
        for e in [*first_turn, *second_turn]
        if e.get("type") == "item.completed" and e["item"].get("type") == "command_execution"
    ]
    assert len(commands) == 2 and all(
        "notes.txt" in c.get("aggregated_output", "") for c in commands
    ), commands
    for events in (first_turn, second_turn):
        (usage,) = [e["usage"] for e in events if e.get("type") == "turn.completed"]
        assert usage["cached_input_tokens"] > 0
    assert wrong == 0
