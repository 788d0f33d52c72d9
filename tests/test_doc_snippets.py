"""Every fenced block of docs/*.md (and README.md) runs as printed, or loads through the model it
documents.

How blocks are marked and run: ``tests/_support/snippets.py``. Python and bash blocks run
against one ``agentkv serve local`` for the whole module; ``doc-test: parse`` blocks go through
the CLI's own parser; TOML and JSON blocks load through the model they document
(:data:`LOADERS`: a new TOML or JSON block in another file needs its model named here).
README.md's blocks: ``test_readme.py``."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentkv._toml import tomllib
from agentkv.router.config import RouterConfig
from agentkv.sim.costmodel import CostModel, load_cost_file
from agentkv.sim.script import SimScript
from tests._support.snippets import (
    ROOT,
    Block,
    agentkv_commands,
    blocks,
    problems,
    promises,
    run_block,
    serve_local,
)

DOCS = sorted((ROOT / "docs").glob("*.md"))
BLOCKS = [b for path in [ROOT / "README.md", *DOCS] for b in blocks(path)]
"""README.md's too: its python and bash blocks run in ``test_readme.py``, the rest here."""


def _json_values(text: str) -> list[Any]:
    """The JSON values of a block, one after another (JSON Lines, or values spanning lines)."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return values
        value, i = decoder.raw_decode(text, i)
        values.append(value)


def _router_config(block: Block, tmp: Path) -> None:
    """As ``agentkv router --config router.toml`` reads it."""
    path = tmp / "router.toml"
    path.write_text(block.code)
    RouterConfig.load(str(path))


def _sim_scripts(block: Block, tmp: Path) -> None:
    """Request bodies' ``agentkv_sim`` field, as the simulator reads it."""
    values = _json_values(block.code)
    assert values
    for value in values:
        assert set(value) == {"agentkv_sim"}, value
        SimScript.model_validate(value["agentkv_sim"])


def _cost_file(block: Block, tmp: Path) -> None:
    """A cost file, as ``agentkv sim --costs`` and ``agentkv plan --costs`` read it."""
    path = tmp / "costs.json"
    path.write_text(block.code)
    (value,) = _json_values(block.code)
    model = load_cost_file(path)
    assert set(value["cost_model"]) == set(CostModel.model_fields), "not every field is shown"
    assert model == CostModel.model_validate(value["cost_model"])


LOADERS: dict[tuple[str, str], Callable[[Block, Path], None]] = {
    ("docs/configuration.md", "toml"): _router_config,
    ("docs/simulator.md", "json"): _sim_scripts,
    ("docs/plan.md", "json"): _cost_file,
}


def test_every_block_names_its_language_and_marks_are_explained() -> None:
    found = [p for b in BLOCKS for p in problems(b)]
    assert not found, found
    assert any(b.lang == "python" and b.mode == "run" for b in BLOCKS)


def test_every_toml_and_json_block_has_a_model() -> None:
    unmapped = [
        b.where
        for b in BLOCKS
        if b.lang in ("toml", "json") and b.mode == "run" and (b.file, b.lang) not in LOADERS
    ]
    assert not unmapped, f"name the model these load through in LOADERS: {unmapped}"


@pytest.fixture(scope="module")
def router_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    with serve_local(tmp_path_factory.mktemp("serve") / "serve.log") as port:
        yield port


def _params(langs: tuple[str, ...], modes: tuple[str, ...]) -> list[Any]:
    return [
        pytest.param(b, id=b.where)
        for b in BLOCKS
        if b.lang in langs and b.mode in modes and (b.file != "README.md" or modes != ("run",))
    ]


@pytest.mark.e2e
@pytest.mark.parametrize("block", _params(("python", "bash"), ("run",)))
def test_snippet_runs(router_port: int, block: Block) -> None:
    run_block(block, router_port)


@pytest.mark.parametrize("block", _params(("toml", "json"), ("run",)))
def test_config_example_loads(block: Block, tmp_path: Path) -> None:
    LOADERS[(block.file, block.lang)](block, tmp_path)


def _command(argv: list[str]) -> tuple[Any, Any, list[str]]:
    """(the click command ``agentkv argv`` names, its parent context, the rest of argv)."""
    from agentkv.cli import command

    cmd = command()
    ctx = cmd.context_class(cmd, info_name="agentkv")
    rest = list(argv)
    while hasattr(cmd, "commands"):
        assert rest, f"agentkv {' '.join(argv)}: names no subcommand"
        name = rest.pop(0)
        sub = cmd.get_command(ctx, name)
        assert sub is not None, f"agentkv {' '.join(argv)}: no command {name!r}"
        cmd, ctx = sub, sub.context_class(sub, info_name=name, parent=ctx)
    return cmd, ctx.parent, rest


@pytest.mark.parametrize("block", _params(("bash",), ("parse",)))
def test_commands_parse(block: Block) -> None:
    commands = agentkv_commands(block.code)
    assert commands, f"{block.where}: no agentkv command to parse"
    for argv in commands:
        cmd, parent, rest = _command(argv)
        try:
            cmd.make_context(cmd.name, rest, parent=parent)
        except Exception as exc:  # click's UsageError (typer vendors click)
            message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
            pytest.fail(f"{block.where}: agentkv {' '.join(argv)}: {message}")


@pytest.mark.parametrize("block", _params(("bash",), ("synopsis",)))
def test_synopsis_names_real_options(block: Block) -> None:
    commands = agentkv_commands(block.code.replace("[", " ").replace("]", " "))
    assert commands, f"{block.where}: no agentkv command"
    for argv in commands:
        words = [w for w in argv if not w.startswith("-")]
        path = []
        for w in words:  # the subcommands: the leading words that name one
            try:
                _command([*path, w])
            except AssertionError:
                break
            path.append(w)
        cmd, parent, _ = _command(path)
        ctx = cmd.context_class(cmd, parent=parent)
        known = {o for p in cmd.get_params(ctx) for o in (*p.opts, *p.secondary_opts)}
        flags = {w.split("=")[0] for w in argv if w.startswith("--")}
        assert flags <= known, f"{block.where}: agentkv {' '.join(path)}: {flags - known}"


def test_the_checks_can_fail() -> None:
    """The promise and command parsers find what they must (else the tests above are empty)."""
    assert promises("print(r)  # TurnReceipt(turn=2, decision='pull', ...)\nx = 1  # a=1") == [
        ("turn", "2"),
        ("decision", "'pull'"),
    ]
    code = "X=1 agentkv sim --port 8100 &\nagentkv router \\\n  --config r.toml  # c\npip x"
    assert agentkv_commands(code) == [["sim", "--port", "8100"], ["router", "--config", "r.toml"]]
    with pytest.raises(pytest.fail.Exception, match="No such option: --bogus"):
        test_commands_parse(Block("x.md", 1, "bash", "agentkv sim --bogus 1\n", "parse", "why"))
    with pytest.raises(AssertionError, match="--nope"):
        test_synopsis_names_real_options(
            Block("x.md", 1, "bash", "agentkv plan T [--nope N]\n", "synopsis", "why")
        )


def _forbidden(source: str) -> set[str]:
    """pyproject.toml's import-linter contract for ``source``: the modules it forbids."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ]
    (contract,) = [c for c in contracts if source in c["source_modules"]]
    return set(contract["forbidden_modules"])


@pytest.mark.parametrize("layer", ["agentkv.router", "agentkv.sim"])
def test_the_layer_table_names_what_the_contracts_forbid(layer: str) -> None:
    """docs/architecture.md's "never" column for the router and the simulator is exactly what
    their import-linter contracts forbid (what it says the contract does not name, it does not)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    (row,) = [line for line in text.splitlines() if line.startswith(f"| `{layer}` |")]
    never = row.split(" | ")[2]
    named, _, unnamed = never.partition(" (its contract does not name ")

    def modules(words: str) -> set[str]:
        out = set()
        for word in re.findall(r"`?([\w.]+)`?", words.replace("the SDK's", "")):
            if word in ("the", "or", "SDK", "s", "other", "modules", "chat", "procs"):
                if word in ("chat", "procs"):
                    out.add(f"agentkv.{word}")
                continue
            outside = word.startswith("agentkv.") or word in ("openai", "httpx")
            out.add(word if outside else f"agentkv.{word}")
        return out

    forbidden = _forbidden(layer)
    assert modules(named) == forbidden, modules(named) ^ forbidden
    assert not modules(unnamed) & forbidden
