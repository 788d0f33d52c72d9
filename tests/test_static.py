"""The project's own gates, so the README's single test command enforces them too."""

from __future__ import annotations

import os
import shutil
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
    """The import-linter contracts of pyproject.toml (docs/architecture.md) hold."""
    r = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports"))],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def test_a_backwards_import_breaks_a_contract(tmp_path):
    """The rule can fail: an indented import of the router inside the simulator is caught."""
    copy = tmp_path / "agentkv"
    shutil.copytree(ROOT / "agentkv", copy, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    clock = copy / "sim" / "clock.py"
    clock.write_text(
        clock.read_text() + "\n\ndef _leak() -> None:\n    from agentkv.router import pd\n"
    )
    r = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports"))],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert r.returncode != 0, r.stdout
    assert "the simulator never imports the router or the SDK BROKEN" in r.stdout
