"""Write a benchmark's figures into its own section of docs/benchmarks.md."""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
HEADER = """# Benchmarks

Every figure here is written by a script in `benchmarks/` that measures agentkv against a
baseline in the same run, on the machine named in its section. Re-run a script to refresh its
section; the other sections are left as they are.
"""


def arguments(description: str, quick: str) -> argparse.ArgumentParser:
    """A benchmark's command line: ``--quick`` (``quick`` says what it runs) and ``--no-write``
    (print only: docs/benchmarks.md keeps its section)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    return parser


def machine() -> str:
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    cores = (
        len(re.findall(r"^processor", Path("/proc/cpuinfo").read_text(), re.M))
        if Path("/proc/cpuinfo").exists()
        else 0
    )
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        rev = "?"
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"{when}, commit {rev}, {cores} × {cpu}, Python {platform.python_version()}"


def write_section(name: str, body: str) -> None:
    text = DOC.read_text() if DOC.exists() else HEADER
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
