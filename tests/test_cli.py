from __future__ import annotations

from typer.testing import CliRunner

from agentkv import __version__
from agentkv.cli import app

runner = CliRunner()


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"agentkv {__version__}"


def test_sim_help_lists_the_protocol_flags():
    r = runner.invoke(app, ["sim", "--help"], terminal_width=200)
    assert r.exit_code == 0
    for flag in (
        "--role",
        "--block-size",
        "--decoder-kv-blocks-ttl",
        "--kv-recompute-threshold",
        "--kv-load-failure-policy",
        "--no-bidirectional",
        "--no-prefix-caching",
        "--compat",
        "--time-scale",
        "--preset",
    ):
        assert flag in r.output


def test_sim_rejects_a_bad_value_without_a_traceback():
    r = runner.invoke(app, ["sim", "--role", "router"])
    assert r.exit_code == 2
    assert "role" in r.output and "Traceback" not in r.output


def test_sim_rejects_an_unknown_preset():
    r = runner.invoke(app, ["sim", "--preset", "nope"])
    assert r.exit_code == 2 and "unknown preset" in r.output
