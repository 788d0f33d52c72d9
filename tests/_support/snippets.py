"""The fenced code blocks of README.md and docs/*.md, and how each is checked.

Every block names its language (```` ```python ````, ``bash``, ``toml``, ``json``, or ``text`` for
a diagram or printed output). A block runs as printed unless the line before its fence says
otherwise::

    <!-- doc-test: skip (why) -->       not run: it installs packages, needs a GPU, ...
    <!-- doc-test: parse (why) -->      bash: every `agentkv ...` command in it is parsed by the
                                         CLI itself (the command, its options and their values),
                                         not run: it starts a server, or names hosts and files
                                         that are not here. Other lines (pip install) are not run.
    <!-- doc-test: synopsis (why) -->   bash: a command's synopsis (``[--flag N]``, ``a|b``):
                                         every command and ``--flag`` it names exists

Python and bash blocks run against one real ``agentkv serve local`` on free ports: the one
change made to a block is its ports (``localhost:8000`` / ``127.0.0.1:8000`` become the
router's free port; any other port a block names, ``--port 8100`` or ``localhost:8100``, a free
port of its own). A ``print(...)  # ... name='value' ...`` comment is a promise: every
``name=value`` written in it (a quoted string or an integer) must appear in what the block
printed. TOML and JSON blocks load through the model they document (``test_doc_snippets.py``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from agentkv import procs
from agentkv.procs import free_port, free_port_range
from agentkv.serve import load_profile
from agentkv.serve.ports import engine_ports

ROOT = Path(__file__).resolve().parents[2]
LANGUAGES = ("python", "bash", "toml", "json", "text")
MODES = ("run", "skip", "parse", "synopsis")
MARKER = re.compile(r"^<!--\s*doc-test:\s*(\w+)\s*(?:\((.*)\))?\s*-->$")
FENCE = re.compile(r"^```(\w*)\s*$")
PORT = re.compile(r"(?:(?<=localhost:)|(?<=127\.0\.0\.1:)|(?<=--port ))(\d{4,5})\b")
PROMISE = re.compile(r"\bprint\(.*\)\s*#(.*)$")
PROMISED = re.compile(r"\b(\w+)=('[^']*'|\d+)(?=[,)\s]|$)")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its code and how it is checked."""

    file: str
    line: int
    lang: str
    code: str
    mode: str = "run"
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file."""
    name = path.relative_to(ROOT).as_posix()
    out: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        marker = MARKER.match(lines[start - 1].strip()) if start > 0 else None
        mode, reason = (marker.group(1), (marker.group(2) or "").strip()) if marker else ("run", "")
        code = "\n".join(lines[start + 1 : j]) + "\n"
        out.append(Block(name, start + 1, lang, code, mode, reason))
        i = j + 1
    return out


def problems(block: Block) -> list[str]:
    """What is wrong with a block's fence or marker (not its code)."""
    out = []
    if block.lang not in LANGUAGES:
        out.append(f"{block.where}: ```{block.lang} (name one of {', '.join(LANGUAGES)})")
    if block.mode not in MODES:
        out.append(f"{block.where}: doc-test: {block.mode} (one of {', '.join(MODES[1:])})")
    if block.mode != "run" and not block.reason:
        out.append(f"{block.where}: doc-test: {block.mode} needs a reason: ({{why}})")
    if block.mode in ("parse", "synopsis") and block.lang != "bash":
        out.append(f"{block.where}: doc-test: {block.mode} is for bash blocks")
    return out


def with_free_ports(code: str, router_port: int) -> str:
    mapping: dict[str, str] = {"8000": str(router_port)}

    def swap(m: re.Match[str]) -> str:
        return mapping.setdefault(m.group(1), str(free_port()))

    return PORT.sub(swap, code)


@contextlib.contextmanager
def serve_local(log: Path) -> Iterator[int]:
    """``agentkv serve local`` on free ports, once it says it is ready: the router's port."""
    port = free_port()
    base = free_port_range(engine_ports(load_profile("local")))
    argv = ["serve", "local", "--port", str(port), "--base-port", str(base)]
    # ready once it says so: the engines are healthy too
    with procs.start(
        [sys.executable, "-m", "agentkv", *argv],
        name="agentkv serve local",
        log=log,
        ready=procs.log_contains("OpenAI base URL"),
        timeout_s=120,
    ) as serve:
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        yield port
        serve.stop(30)


def run_block(block: Block, router_port: int) -> None:
    """Run a python or bash block against the router on ``router_port``; fail with its output
    unless it exits 0, prints something (not ``null``) and keeps its print comments' promises."""
    code = with_free_ports(block.code, router_port)
    argv = (
        [sys.executable, "-c", code]
        if block.lang == "python"
        else ["bash", "-eo", "pipefail", "-c", code]
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    with tempfile.TemporaryFile("w+") as out_file, tempfile.TemporaryFile("w+") as err_file:
        # its own process group: what the block starts in the background (`&`) stops after it
        proc = subprocess.Popen(
            argv, stdout=out_file, stderr=err_file, text=True, env=env, start_new_session=True
        )
        try:
            proc.wait(120)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out_file.seek(0)
        err_file.seek(0)
        stdout, stderr = out_file.read(), err_file.read()
    assert proc.returncode == 0, f"{block.where}\n{code}\n{stdout}\n{stderr}"
    out = stdout.strip()
    assert out and out.splitlines()[-1] != "null", f"{block.where}: printed {out!r}"
    broken = [f"{k}={v}" for k, v in promises(block.code) if f"{k}={v}" not in out]
    assert not broken, f"{block.where}: promised {broken} in a comment, printed:\n{out}"


def promises(code: str) -> list[tuple[str, str]]:
    """The ``name=value`` pairs written in the comments of a block's ``print`` lines."""
    found = []
    for line in code.splitlines():
        m = PROMISE.search(line)
        if m is not None:
            found += PROMISED.findall(m.group(1))
    return found


def agentkv_commands(code: str) -> list[list[str]]:
    """The argv (after ``agentkv``) of every ``agentkv`` command in a bash block: line
    continuations joined, comments dropped, ``&&``/``;``/``&`` split, ``VAR=value`` prefixes
    skipped."""
    joined = re.sub(r"\\\n", " ", code)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        command: list[str] = []
        for word in [*words, ";"]:
            if word in ("&&", ";", "&", "||"):
                while command and re.match(r"^[A-Z_][A-Z0-9_]*=", command[0]):
                    command.pop(0)
                if command and command[0] == "agentkv":
                    out.append(command[1:])
                command = []
            else:
                command.append(word.rstrip(";&") if word.endswith((";", "&")) else word)
    return out
