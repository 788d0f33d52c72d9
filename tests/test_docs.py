"""The configuration reference stays true: every option is documented."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from agentkv.cli import app
from agentkv.router.config import Backend, RouterConfig, Tenant
from agentkv.router.config_legacy import FLAT_KEYS

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_every_router_option_is_in_the_reference():
    text = (DOCS / "configuration.md").read_text()
    for group, info in RouterConfig.model_fields.items():
        for name in info.annotation.model_fields:  # type: ignore[union-attr]
            assert f"| `{group}.{name}` |" in text, (group, name)
    for model in (Backend, Tenant):
        for name in model.model_fields:
            assert f"| `{name}` |" in text, name


def test_every_deprecated_flat_key_is_in_the_mapping_table():
    text = (DOCS / "configuration.md").read_text()
    table = text[text.index("| old key | new key |") :].split("\n\n")[0]
    for old in FLAT_KEYS:
        assert f"`{old}`" in table, old


def test_every_sim_flag_is_in_the_simulator_doc():
    text = (DOCS / "simulator.md").read_text()
    help_text = CliRunner().invoke(app, ["sim", "--help"], terminal_width=300).output
    flags = {
        w.strip(",.)")
        for w in help_text.split()
        if w.startswith("--") and w.strip(",.)") not in ("--help", "--host")
    }
    missing = [f for f in flags if f not in text]
    assert not missing, missing


def test_every_router_metric_is_in_the_metrics_table():
    from agentkv.router import create_app

    config = RouterConfig.model_validate(
        {
            "upstream": {
                "prefill": [{"url": "http://127.0.0.1:1"}],
                "decode": [{"url": "http://127.0.0.1:2"}],
            }
        }
    )
    registry = create_app(config).state.router.metrics.registry
    text = (DOCS / "router.md").read_text()
    rows = {line.split("`")[1] for line in text.splitlines() if line.startswith("| `agentkv_")}
    exported = {
        f"{family.name}_total" if family.type == "counter" else family.name
        for family in registry.collect()
    }
    assert exported == rows, (exported - rows, rows - exported)


def test_every_module_is_in_the_architecture_map():
    """docs/architecture.md's module map names every module of agentkv, and only those."""
    text = (DOCS / "architecture.md").read_text()
    _, _, section = text.partition("\n## Every module, one line each\n")
    listed: set[str] = set()
    package = ""
    for line in section.splitlines():
        if line.startswith("**`agentkv"):
            package = line.strip("*`")
        elif line.startswith("| `") and package:
            listed.add(package + line.split("`")[1])
    root = DOCS.parent
    modules = {
        p.relative_to(root).as_posix()
        for p in (root / "agentkv").rglob("*.py")
        if p.name not in ("__main__.py", "__version__.py")
    }
    assert modules - listed == set(), "modules missing from docs/architecture.md's map"
    assert listed - modules == set(), "rows of docs/architecture.md's map that are no module"
