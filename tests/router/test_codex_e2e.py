"""Codex CLI, unmodified, against the router: ``codex exec`` headless over ``/v1/responses``.

Codex is installed from npm once into ``~/.cache/agentkv/harness`` (reused across runs; the test
is skipped, saying why, only when npm or its registry cannot be reached). Codex speaks only the
Responses API, streamed, ``store: false``, with its session id as ``prompt_cache_key``
(``/work/shared/reference/agent-harnesses.md``).

A simulated model does not call tools on its own, and Codex lets no one add a body field, so the
tool rounds go through a small scripting proxy on loopback that adds the simulator's
``agentkv_sim`` field from what Codex sent: a call of Codex's ``exec_command`` tool to the user's
request, an answer to the tool's output. Codex runs the command itself and sends its whole input
again, and a second turn (``codex exec resume --last``) sends it all once more: every request
after the first must pull its predecessor's KV.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from stack import MODEL, Stack, stack
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from agentkv.sim.launch import free_port

pytestmark = pytest.mark.e2e

CODEX = "@openai/codex@0.171.0"
HARNESS = Path.home() / ".cache" / "agentkv" / "harness"
_HOP = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding"}


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


class ScriptingProxy:
    """Codex -> this -> the router: adds a simulator script to each ``/responses`` request
    (chosen from the request's last input item) and records the router's answers."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.requests: list[dict[str, Any]] = []
        self.decisions: list[str] = []
        self.statuses: list[int] = []
        app = Starlette(routes=[Route("/{path:path}", self.forward, methods=["GET", "POST"])])
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ScriptingProxy:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the scripting proxy did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    @staticmethod
    def script(body: dict[str, Any]) -> dict[str, Any]:
        last = (body.get("input") or [{}])[-1]
        if last.get("type") == "function_call_output":
            return {"content": "There is one file: notes.txt."}
        call = {"name": "exec_command", "arguments": {"cmd": "ls"}}
        return {"reasoning": "I will list the files.", "content": "", "tool_calls": [call]}

    async def forward(self, request: Request) -> Response:
        raw = await request.body()
        if request.method == "POST" and request.url.path.endswith("/responses"):
            body = json.loads(raw)
            self.requests.append(body)
            body["agentkv_sim"] = self.script(body)
            raw = json.dumps(body).encode()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        client = httpx.AsyncClient(timeout=60)
        upstream = await client.send(
            client.build_request(
                request.method, self.upstream + request.url.path, headers=headers, content=raw
            ),
            stream=True,
        )
        self.statuses.append(upstream.status_code)
        if "x-agentkv-decision" in upstream.headers:
            self.decisions.append(upstream.headers["x-agentkv-decision"])

        async def body() -> AsyncIterator[bytes]:
            try:
                async for part in upstream.aiter_raw():
                    yield part
            finally:
                await upstream.aclose()
                await client.aclose()

        passed = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
        return StreamingResponse(body(), status_code=upstream.status_code, headers=passed)


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


def test_codex_exec_tool_rounds_over_two_turns_pull(pd: Stack, tmp_path: Path) -> None:
    binary = codex_binary()
    with ScriptingProxy(pd.router.url) as proxy:
        first_turn = run_codex(binary, proxy.url, tmp_path, "List the files here.")
        second_turn = run_codex(binary, proxy.url, tmp_path, "List them again.", resume=True)
    assert proxy.statuses == [200] * 4, proxy.statuses
    first, second, third, fourth = proxy.requests
    assert all(r["store"] is False for r in proxy.requests)
    assert {r["prompt_cache_key"] for r in proxy.requests} == {first["prompt_cache_key"]}
    # Codex ran the command and sent everything again, with the call and its output
    kinds = [i.get("type") for i in second["input"]]
    assert kinds[-2:] == ["function_call", "function_call_output"], kinds
    assert "notes.txt" in json.dumps(second["input"][-1])
    assert len(fourth["input"]) > len(third["input"]) > len(second["input"])
    # every request after the first reads the KV its predecessor left on D
    assert proxy.decisions[0] in ("miss", "recompute")
    assert proxy.decisions[1:] == ["pull", "pull", "pull"], proxy.decisions
    assert agent_messages(first_turn) == ["There is one file: notes.txt."]
    assert agent_messages(second_turn) == ["There is one file: notes.txt."]
    for events in (first_turn, second_turn):
        (usage,) = [e["usage"] for e in events if e.get("type") == "turn.completed"]
        assert usage["cached_input_tokens"] > 0
    assert pd.wrong_kv() == 0
