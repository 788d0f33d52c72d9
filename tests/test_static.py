"""The project's own gates, so the README's single test command enforces them too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_check():
    r = _run("ruff", "check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format():
    r = _run("ruff", "format", "--check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_mypy_strict():
    r = _run("mypy")
    assert r.returncode == 0, r.stdout + r.stderr


def test_layers_import_one_way():
    """protocol imports nothing else from agentkv; sim imports only protocol and chat; chat
    imports only itself; the SDK never imports the simulator."""
    for path in (ROOT / "agentkv" / "protocol").glob("*.py"):
        text = path.read_text()
        assert "from agentkv." not in text.replace("from agentkv.protocol", ""), path
    for path in (ROOT / "agentkv" / "sim").glob("*.py"):
        for line in path.read_text().splitlines():
            if line.startswith(("from agentkv.", "import agentkv")):
                assert line.startswith(
                    ("from agentkv.sim", "from agentkv.protocol", "from agentkv.chat")
                ), (path, line)
    for path in (ROOT / "agentkv" / "chat").glob("*.py"):
        for line in path.read_text().splitlines():
            if line.startswith(("from agentkv.", "import agentkv")):
                assert line.startswith("from agentkv.chat"), (path, line)
    for path in (ROOT / "agentkv").glob("_*.py"):
        assert "agentkv.sim" not in path.read_text(), path
