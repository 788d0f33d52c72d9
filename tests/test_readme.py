"""Every snippet of README.md runs as written against a real ``agentkv serve local``.

The server runs on free ports (``agentkv serve local --port R --base-port B``), so the one
change made to a snippet is its ports: ``localhost:8000`` / ``127.0.0.1:8000`` become the
router's free port, and any other port a snippet names (``--port 8100``, ``localhost:8100``)
a free port of its own. A block that is not meant to run (installs, the whole test suite) is
marked by an HTML comment on the line before its fence::

    <!-- readme-test: skip (why) -->
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentkv import procs
from agentkv.procs import free_port, free_port_range
from agentkv.serve import load_profile
from agentkv.serve.ports import engine_ports

pytestmark = pytest.mark.e2e

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP = re.compile(r"^<!--\s*readme-test:\s*skip\b.*-->$")
FENCE = re.compile(r"^```(\w*)\s*$")
PORT = re.compile(r"(?:(?<=localhost:)|(?<=127\.0\.0\.1:)|(?<=--port ))(\d{4,5})\b")


def snippets(text: str) -> list[tuple[int, str, str, bool]]:
    """(line, language, code, skipped) of each fenced block."""
    out: list[tuple[int, str, str, bool]] = []
    lines = text.splitlines()
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
        skipped = start > 0 and bool(SKIP.match(lines[start - 1].strip()))
        out.append((start + 1, lang, "\n".join(lines[start + 1 : j]) + "\n", skipped))
        i = j + 1
    return out


def with_free_ports(code: str, router_port: int) -> str:
    mapping: dict[str, str] = {"8000": str(router_port)}

    def swap(m: re.Match[str]) -> str:
        return mapping.setdefault(m.group(1), str(free_port()))

    return PORT.sub(swap, code)


@pytest.fixture(scope="module")
def serve_local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """``agentkv serve local`` on free ports, once it says it is ready: the router's port."""
    port = free_port()
    base = free_port_range(engine_ports(load_profile("local")))
    argv = ["serve", "local", "--port", str(port), "--base-port", str(base)]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
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


BLOCKS = snippets(README.read_text(encoding="utf-8"))


def test_the_readme_has_runnable_snippets() -> None:
    langs = [lang for _, lang, _, skipped in BLOCKS if not skipped]
    assert "python" in langs and "bash" in langs
    for line, lang, _, skipped in BLOCKS:
        assert skipped or lang in ("python", "bash"), f"README.md:{line}: ```{lang} cannot run"


@pytest.mark.parametrize(
    ("line", "lang", "code"),
    [pytest.param(n, lang, code, id=f"README.md:{n}") for n, lang, code, s in BLOCKS if not s],
)
def test_snippet_runs(serve_local: int, line: int, lang: str, code: str) -> None:
    code = with_free_ports(code, serve_local)
    argv = (
        [sys.executable, "-c", code]
        if lang == "python"
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
    assert proc.returncode == 0, f"README.md:{line}\n{code}\n{stdout}\n{stderr}"
    out = stdout.strip()
    assert out and out.splitlines()[-1] != "null", f"README.md:{line}: printed {out!r}"
