from __future__ import annotations

import re

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


# --- `agentkv sim`'s flags are SimConfig's fields ----------------------------------------------


def _sim_flags() -> set[str]:
    text = runner.invoke(app, ["sim", "--help"], terminal_width=300).output
    return {w.strip(",.)") for w in text.split() if w.startswith("--")}


def test_every_simconfig_field_is_a_sim_flag():
    from agentkv.cli.sim import SIM_FLAGS
    from agentkv.sim import SimConfig

    flags = _sim_flags()
    for name, info in SimConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if info.annotation is bool and info.default is True:  # the switch that turns it off
            flag = (SIM_FLAGS[name].off if name in SIM_FLAGS else None) or "--no-" + flag[2:]
        assert flag in flags, name


def test_sim_flags_reach_the_config(monkeypatch):
    import agentkv.sim

    seen = {}

    def create_app(config, *, faults):
        seen.update(config=config, faults=faults)
        raise OSError("stop here")

    monkeypatch.setattr(agentkv.sim, "create_app", create_app)
    r = runner.invoke(
        app,
        [
            "sim",
            "--role",
            "prefill",
            "--no-bidirectional",
            "--no-prefix-caching",
            "--side-channel-port",
            "9001",
            "--tool-format",
            "hermes",
            "--no-reasoning-parser",
            "--max-output-tokens-default",
            "7",
            "--engine-id",
            "e1",
            "--fail-next",
            "2",
            "--delay",
            "0.5",
        ],
    )
    assert r.exit_code == 2 and "stop here" in r.output
    config, faults = seen["config"], seen["faults"]
    assert config.role == "prefill" and config.engine_id == "e1"
    assert not config.bidirectional_kv_xfer and not config.prefix_caching
    assert config.prompt_tokens_details and not config.reasoning_parser
    assert (config.side_channel_port, config.tool_format, config.max_output_tokens_default) == (
        9001,
        "hermes",
        7,
    )
    assert (faults.fail_next, faults.delay_s, faults.cut_stream_after) == (2, 0.5, None)


def test_sim_rejects_bad_json_and_bad_choices_in_one_line():
    r = runner.invoke(app, ["sim", "--kv-events-config", "{nope"])
    assert r.exit_code == 2 and "--kv-events-config is not valid JSON" in r.output
    r = runner.invoke(app, ["sim", "--tool-format", "xml"])
    assert r.exit_code == 2 and "--tool-format: 'xml'" in r.output, r.output


def test_a_new_model_field_is_a_new_flag():
    """The generator itself, on a model the CLI knows nothing about."""
    import uuid
    from typing import Any, Literal

    import typer
    from pydantic import BaseModel, ConfigDict, Field

    from agentkv.cli._options import Flag, model_values, with_model_options

    class Inner(BaseModel):
        a: int = 1

    class Model(BaseModel):
        model_config = ConfigDict(use_attribute_docstrings=True)

        count: int = Field(3, description="How many.")
        mode: Literal["x", "y"] = "x"
        """The mode. More words here."""
        on: bool = True
        loud: bool = False
        maybe: float | None = None
        inner: Inner | None = None
        ident: str = Field(default_factory=lambda: str(uuid.uuid4()))

    got: dict[str, Any] = {}

    def cmd(**values: Any) -> None:
        got.update(model_values(Model, values))

    one = typer.Typer()
    one.command()(with_model_options(Model, {"on": Flag(off="--off")})(cmd))
    help_text = runner.invoke(one, ["--help"], terminal_width=200).output
    for shown in ("--count", "How many.", "--mode", "The mode. (x | y)", "--off", "--loud"):
        assert shown in help_text, shown
    assert "More words" not in help_text and "--on " not in help_text
    argv = ["--count", "5", "--mode", "y", "--off", "--loud", "--inner", '{"a": 2}']
    r = runner.invoke(one, argv)
    assert r.exit_code == 0, r.output
    assert got == {"count": 5, "mode": "y", "on": False, "loud": True, "inner": {"a": 2}}
    assert Model.model_validate(got).inner == Inner(a=2)


def test_a_model_of_groups_gives_group_flags_unset_unless_given():
    """``--GROUP-FIELD`` per field of each group; only what was given comes back (nested), so a
    file's and the environment's values show through; old names are hidden aliases."""
    from typing import Any

    import typer
    from pydantic import BaseModel, ConfigDict

    from agentkv.cli._options import Flag, group_values, with_model_options

    class Net(BaseModel):
        model_config = ConfigDict(use_attribute_docstrings=True)

        port: int = 8000
        """The port."""
        fast: bool = False
        """Go fast."""
        keep: bool = True
        """Keep things."""

    class Model(BaseModel):
        model_config = ConfigDict(use_attribute_docstrings=True)

        net: Net = Net()
        """Networking."""

    got: dict[str, Any] = {}

    def cmd(**values: Any) -> None:
        got.clear()
        got.update(group_values(Model, values))

    one = typer.Typer(rich_markup_mode="markdown")  # as agentkv's: "[default: …]" shown
    flags = {"net.port": Flag(aliases=("--port",))}
    one.command()(with_model_options(Model, flags, groups=True)(cmd))
    output = runner.invoke(one, ["--help"], env={"COLUMNS": "200"}).output
    help_text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", output).split())
    for shown in (
        "net: Networking.",
        "--net-port",
        "Also --port. [default: 8000]",
        "--no-net-keep",
    ):
        assert shown in help_text, shown
    assert runner.invoke(one, []).exit_code == 0 and got == {}
    assert runner.invoke(one, ["--port", "9"]).exit_code == 0 and got == {"net": {"port": 9}}
    r = runner.invoke(one, ["--net-port", "7", "--net-fast", "--no-net-keep"])
    assert r.exit_code == 0 and got == {"net": {"port": 7, "fast": True, "keep": False}}
