"""``agentkv <cmd> --help`` as users see it (the installed command, a real subprocess): the
defaults written in help texts survive rich markup, no flag shows a type it cannot take
(``<bool>``, ``<list[str]>``), and docstrings are rewrapped, not broken where the source is."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

COMMANDS = [
    ["--help"],
    ["sim", "--help"],
    ["demo", "--help"],
    ["serve", "--help"],
    ["router", "--help"],
    ["check-template", "--help"],
    ["plan", "--help"],
    ["calibrate", "--help"],
    ["profiles", "render", "--help"],
    ["bench", "replay", "--help"],
    ["bench", "curves", "--help"],
    ["setup", "vllm-cpu", "--help"],
]
# (command, text its --help must contain; spaces may become line breaks inside the box)
DEFAULTS = [
    ("router", "[default: 127.0.0.1]"),
    ("router", "[default: 8000]"),
    ("serve", "[default: local without a GPU]"),
    ("serve", "[default: the profile's]"),
    ("bench replay", "[default: local]"),
    ("bench replay", "vllm-multi-turn [auto]"),
    ("plan", "[default: qwen3-32b-p5en]"),
    ("plan", "vllm-multi-turn [auto]"),
    ("calibrate", "[the server's first]"),
    ("profiles render", "[default: argv]"),
    ("demo", "[default: the profile's, 8000 for local]"),
    ("sim", "HTTP port (127.0.0.1 unless --host). [default: 8100]"),  # not the router's 8000
    ("sim", "Cost model preset: zero | laptop | qwen3-32b-p5en | glm-5-fp8-p5en."),
    ("serve", "A built-in profile (cpu-tiny, glm-5-fp8-1p1d,"),
    ("demo", "local (simulated engines) or a vLLM profile"),
]


def help_text(*argv: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "agentkv", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"},
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def flat(text: str) -> str:
    """The help's words in order, the box drawing and line breaks gone."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a))
def test_no_types_that_cannot_be_passed(argv: list[str]) -> None:
    text = help_text(*argv)
    assert "<bool>" not in text and "<list[" not in text, text


@pytest.mark.parametrize(("command", "shown"), DEFAULTS)
def test_defaults_written_in_help_are_shown(command: str, shown: str) -> None:
    assert shown in flat(help_text(*command.split(), "--help")), (command, shown)


def test_repeatable_options_say_their_element_type() -> None:
    text = flat(help_text("router", "--help"))
    assert "--prefill <str> Prefill instance URL (repeat for several)." in text


def test_top_level_help_rewraps_docstrings() -> None:
    text = help_text("--help")
    # each command's summary wraps inside its column: no line holds only a stray word or two
    # where the docstring's source line ended (e.g. "and" / "compare" alone before the break)
    lines = [line.strip("│ ").strip() for line in text.splitlines()]
    assert not [line for line in lines if line in ("compare", "TEMPLATE and", "time", "and")]
    joined = flat(text)
    assert "compare verified reuse with a naive client" in joined
    assert "pull time per block and decode time per token on a live deployment" in joined


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a))
def test_help_points_only_to_what_a_pip_user_has(argv: list[str]) -> None:
    """The wheel ships no docs/ and no reference/: help names neither, nor internal jargon."""
    text = flat(help_text(*argv))
    for word in ("docs/", ".md", "reference/", "planner v2"):
        assert word not in text, (argv, word)


def test_serve_help_names_every_built_in_profile() -> None:
    from agentkv.serve import builtin_profiles

    text = flat(help_text("serve", "--help"))
    for name in builtin_profiles():
        assert name in text, name
