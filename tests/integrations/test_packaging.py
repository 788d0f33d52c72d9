"""The integration packages stay installable on their own, under their ecosystems' names, and
never with PyPI's unrelated ``agentkv`` (agentkv is ``vllm-agentkv``; it brings the shared pool)."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
import textwrap
import venv
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from agentkv._toml import tomllib
from tests._support.integration import ROOT, run_process


@dataclass(frozen=True)
class Adapter:
    folder: str  # = the distribution name
    module: str
    cls: str
    framework: str
    source: str  # the folder sys.path needs, relative to the project folder
    alias: str | None = None  # the deprecated import name of 0.1.0
    alias_submodule: tuple[str, str] | None = None  # (old submodule, module it now is)


ADAPTERS = {
    a.folder: a
    for a in (
        Adapter(
            "langchain-agentkv",
            "langchain_agentkv",
            "ChatAgentKV",
            "langchain-core",
            "src",
            "agentkv_langchain",
            ("chat_models", "langchain_agentkv.chat_models"),
        ),
        Adapter(
            "llama-index-llms-agentkv",
            "llama_index.llms.agentkv",
            "AgentKV",
            "llama-index-core",
            ".",
            "agentkv_llamaindex",
            ("llms", "llama_index.llms.agentkv.base"),
        ),
        Adapter(
            "agentkv-openai-agents",
            "agentkv_openai_agents",
            "AgentKVModelProvider",
            "openai-agents",
            "src",
        ),
    )
}
BARE_AGENTKV = re.compile(r"^agentkv\s*($|[\[<>=!~;(@ ])")  # PyPI's project, not ours


def _module_dir(adapter: Adapter) -> Path:
    return (
        ROOT / "integrations" / adapter.folder / adapter.source / adapter.module.replace(".", "/")
    )


def test_the_adapter_folders_are_these() -> None:
    found = {p.parent.name for p in (ROOT / "integrations").glob("*/pyproject.toml")}
    assert found == set(ADAPTERS)


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_package_metadata_and_public_name(name: str) -> None:
    adapter = ADAPTERS[name]
    folder = ROOT / "integrations" / name
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    assert project["name"] == name
    deps = project["dependencies"]
    assert any(d.startswith("vllm-agentkv>=") for d in deps), deps  # agentkv.pool lives there
    assert not [d for d in deps if BARE_AGENTKV.match(d)], deps
    pinned = [d for d in deps if d.startswith(adapter.framework)]
    assert pinned and ">=" in pinned[0] and "<" in pinned[0], deps  # a tested range
    assert (folder / "README.md").is_file()
    assert (_module_dir(adapter) / "py.typed").is_file()
    imported = importlib.import_module(adapter.module)
    assert adapter.cls in imported.__all__
    assert imported.__version__ == project["version"]


def _floor_pins() -> dict[str, str]:
    """``.ci/lower-bounds.txt``: the frameworks' floors, ``name==version`` a line."""
    pins = {}
    for line in (ROOT / ".ci" / "lower-bounds.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_lower_bounds_file_pins_every_declared_floor() -> None:
    """Each framework requirement in pyproject.toml's extras and the adapters' pyproject.toml has
    a ``>=`` floor, the same everywhere, and ``.ci/lower-bounds.txt`` pins exactly those floors
    (.ci/run installs and tests them): neither can move without the other."""
    pins = _floor_pins()
    main = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [
        r
        for extra in ("langchain", "llamaindex", "openai-agents")
        for r in main["optional-dependencies"][extra]
    ]
    for name in sorted(ADAPTERS):
        project = tomllib.loads((ROOT / "integrations" / name / "pyproject.toml").read_text())[
            "project"
        ]
        declared += project["dependencies"]
        declared += [
            r for extra in project.get("optional-dependencies", {}).values() for r in extra
        ]
    framework_names = set(pins) | {canonicalize_name(a.framework) for a in ADAPTERS.values()}
    dev = [Requirement(r) for r in main["optional-dependencies"]["dev"]]
    floors: dict[str, set[str]] = {}
    for req in [Requirement(r) for r in declared] + dev:
        name = canonicalize_name(req.name)
        if name not in framework_names:
            continue
        lower = [s.version for s in req.specifier if s.operator == ">="]
        assert len(lower) == 1, f"{req}: one >= floor"
        floors.setdefault(name, set()).add(lower[0])
    assert {n: sorted(v) for n, v in floors.items()} == {n: [v] for n, v in pins.items()}


def test_llama_index_namespace_layout() -> None:
    """Like llama-index-llms-openai: ``llama_index`` and ``llama_index.llms`` are namespace
    packages shared with llama-index-core, so the adapter ships no ``__init__.py`` in them."""
    root = ROOT / "integrations" / "llama-index-llms-agentkv"
    assert not (root / "llama_index" / "__init__.py").exists()
    assert not (root / "llama_index" / "llms" / "__init__.py").exists()
    wheel = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["hatch"]["build"]
    assert "llama_index/" in wheel["targets"]["wheel"]["include"]
    import llama_index.core
    import llama_index.llms.agentkv

    assert len(llama_index.__path__) >= 2  # type: ignore[attr-defined]  # core's and ours
    assert llama_index.core.__file__ and llama_index.llms.agentkv.__file__


def _imported(nodes: list[ast.stmt]) -> list[str]:
    """The modules ``nodes`` import, in order (nested blocks included)."""
    found: list[str] = []
    for node in ast.walk(ast.Module(body=nodes, type_ignores=[])):
        if isinstance(node, ast.ImportFrom):
            found.append(node.module or "")
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_adapter_runs_the_shared_install_check_first(name: str) -> None:
    """One check, ``vllm_agentkv.py`` (vllm-agentkv ships it beside ``agentkv``): every adapter
    calls it with its own name before anything imports ``agentkv``, and keeps no copy of it."""
    module_dir = _module_dir(ADAPTERS[name])
    assert not (module_dir / "_install.py").exists()
    body = ast.parse((module_dir / "__init__.py").read_text(encoding="utf-8")).body
    calls = [
        i
        for i, node in enumerate(body)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "require_vllm_agentkv"
        and [ast.literal_eval(a) for a in node.value.args] == [name]
    ]
    assert len(calls) == 1, f"{name}: require_vllm_agentkv({name!r}) once"
    before = _imported(body[: calls[0]])
    assert before == ["__future__", "vllm_agentkv"], before
    assert "agentkv" in {m.split(".")[0] for m in _imported(body[calls[0] :])}


def test_the_install_check_ships_with_vllm_agentkv() -> None:
    """A top-level module of the vllm-agentkv distribution (not of ``agentkv``: importing that
    runs whatever ``agentkv/__init__.py`` is installed), in its wheel and its sdist."""
    assert _imported(ast.parse((ROOT / "vllm_agentkv.py").read_text()).body) == [
        "__future__",
        "base64",
        "hashlib",
        "importlib.metadata",
        "importlib.util",
        "json",
        "re",
        "pathlib",
        "urllib.parse",
    ]  # the standard library only
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]
    wheel = build["targets"]["wheel"]
    assert wheel["force-include"]["vllm_agentkv.py"] == "vllm_agentkv.py"
    assert "/vllm_agentkv.py" in build["targets"]["sdist"]["include"]


@pytest.mark.parametrize("name", [n for n, a in sorted(ADAPTERS.items()) if a.alias])
def test_old_import_name_is_a_deprecated_alias(name: str) -> None:
    adapter = ADAPTERS[name]
    assert adapter.alias and adapter.alias_submodule
    new = importlib.import_module(adapter.module)
    for key in [k for k in sys.modules if k == adapter.alias or k.startswith(adapter.alias + ".")]:
        del sys.modules[key]
    with pytest.warns(DeprecationWarning, match=re.escape(f"import {adapter.module} instead")):
        old = importlib.import_module(adapter.alias)
    assert getattr(old, adapter.cls) is getattr(new, adapter.cls)
    assert old.__all__ == new.__all__ and old.__version__ == new.__version__
    submodule, now = adapter.alias_submodule
    assert importlib.import_module(f"{adapter.alias}.{submodule}") is importlib.import_module(now)


def _fake_foreign_agentkv(where: Path, *, package: bool) -> None:
    """PyPI's ``agentkv`` 0.9.1 as pip would leave it: its dist-info, and (``package``) its
    import package ``agentkv`` (a stand-in ``__init__``: no third-party code runs here)."""
    info = where / "agentkv-0.9.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: agentkv\nVersion: 0.9.1\n"
        "Summary: The SQLite of agent memory — embeddable vector + graph store for AI agents\n",
        encoding="utf-8",
    )
    (info / "INSTALLER").write_text("pip\n")
    record = [f"{info.name}/{n},," for n in ("METADATA", "INSTALLER", "RECORD")]
    if package:
        (where / "agentkv").mkdir()
        (where / "agentkv" / "__init__.py").write_text('"""Agent memory."""\n')
        record.append("agentkv/__init__.py,,")
    (info / "RECORD").write_text("\n".join(record) + "\n")


def _python(
    code: str, path: list[Path], cwd: Path, *flags: str
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    return run_process([sys.executable, *flags, "-c", code], env=env, cwd=cwd, timeout=60)


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_adapter_refuses_the_other_agentkv(name: str, tmp_path: Path) -> None:
    """``agentkv`` resolving to PyPI's other project: the adapter says so before importing it."""
    adapter = ADAPTERS[name]
    _fake_foreign_agentkv(tmp_path, package=True)
    source = ROOT / "integrations" / name / adapter.source
    # ROOT: this checkout's vllm_agentkv.py (whichever checkout vllm-agentkv is installed from)
    done = _python(f"import {adapter.module}", [tmp_path, ROOT, source], tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: "), done.stderr
    assert f"{name} needs vllm-agentkv" in last
    assert f"'import agentkv' finds {(tmp_path / 'agentkv' / '__init__.py').resolve()}" in last
    assert "agentkv 0.9.1 is installed" in last
    # vllm-agentkv is installed too (this checkout, editable): both go, then ours alone
    assert last.endswith("Fix: pip uninstall agentkv vllm-agentkv && pip install vllm-agentkv")


def test_adapter_without_vllm_agentkv_names_the_fix(tmp_path: Path) -> None:
    """Only PyPI's ``agentkv`` installed (no site-packages at all: ``-S``), and the check's module
    on the path (a checkout of vllm-agentkv on ``PYTHONPATH``, not installed)."""
    _fake_foreign_agentkv(tmp_path, package=True)
    source = ROOT / "integrations" / "langchain-agentkv" / "src"
    done = _python("import langchain_agentkv", [tmp_path, ROOT, source], tmp_path, "-S")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and last.startswith("ImportError: "), done.stderr
    assert "the distribution vllm-agentkv is not installed, and agentkv 0.9.1 is installed" in last
    assert last.endswith("Fix: pip uninstall agentkv && pip install vllm-agentkv")


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_adapter_without_the_install_check_names_the_fix(name: str, tmp_path: Path) -> None:
    """vllm-agentkv not installed, so neither is its ``vllm_agentkv`` module: the adapter names
    the install, whatever ``agentkv`` there is (PyPI's here)."""
    adapter = ADAPTERS[name]
    _fake_foreign_agentkv(tmp_path, package=True)
    source = ROOT / "integrations" / name / adapter.source
    done = _python(f"import {adapter.module}", [tmp_path, source], tmp_path, "-S")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0, done.stderr
    assert last == f"ImportError: {name} needs `pip install vllm-agentkv`", done.stderr
    assert "No module named 'vllm_agentkv'" in done.stderr  # the cause, chained


def test_agentkv_warns_about_a_coinstalled_agentkv_distribution(tmp_path: Path) -> None:
    _fake_foreign_agentkv(tmp_path, package=False)  # its metadata only: ours is imported
    done = _python("import agentkv", [tmp_path], tmp_path, "-W", "always")
    assert done.returncode == 0, done.stderr
    assert "ForeignDistributionWarning" in done.stderr
    assert (
        "the distribution agentkv 0.9.1, an unrelated project (The SQLite of agent memory — "
        "embeddable vector + graph store for AI agents), is installed next to vllm-agentkv"
    ) in done.stderr
    assert "Fix: pip uninstall agentkv vllm-agentkv && pip install vllm-agentkv" in done.stderr
    strict = _python("import agentkv", [tmp_path], tmp_path, "-W", "error")
    assert strict.returncode != 0 and "ForeignDistributionWarning" in strict.stderr


def test_agentkv_names_its_own_former_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import agentkv._installed

    assert agentkv._installed.foreign_distributions() == []  # this environment is clean
    info = tmp_path / "agentkv-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: agentkv\nVersion: 0.1.0\nSummary: Fast, verified "
        "multi-turn KV reuse for AI agents on self-hosted vLLM\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    found = agentkv._installed.foreign_distributions()
    assert found == ["agentkv 0.1.0, this project under its former name"]
    with pytest.warns(agentkv._installed.ForeignDistributionWarning, match="former name"):
        agentkv._installed.warn()


CHECK_VENV = textwrap.dedent(
    """
    import importlib, importlib.metadata as md, warnings
    warnings.simplefilter("error")  # our own foreign-distribution warning included
    assert list(md.distributions(name="agentkv")) == [], "a distribution named agentkv"
    names = {d.metadata["Name"] for d in md.distributions()}
    assert {"vllm-agentkv", *ADAPTERS} <= names, names
    import agentkv, agentkv.pool
    assert agentkv.__file__.startswith(SITE), agentkv.__file__  # the wheel, not the checkout
    # the adapters' install check: a top-level module of the wheel, beside agentkv/
    import vllm_agentkv
    assert vllm_agentkv.__file__ == f"{SITE}/vllm_agentkv.py", vllm_agentkv.__file__
    assert "vllm_agentkv.py" in {f.as_posix() for f in md.files("vllm-agentkv")}
    for module in MODULES:
        importlib.import_module(module)
    for alias in ALIASES:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            importlib.import_module(alias)
        assert [w.category for w in seen] == [DeprecationWarning], seen
    # the extras were not installed: a missing one is named, not a bare ModuleNotFoundError
    import importlib.util
    assert importlib.util.find_spec("tokenizers") is None  # no adapter needs it
    try:
        import agentkv.chat
    except ModuleNotFoundError as exc:
        assert 'pip install "vllm-agentkv[tokenizers]"' in str(exc), exc
    else:
        raise AssertionError("agentkv.chat imported without tokenizers")
    print("ok", md.version("vllm-agentkv"))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fresh_venv_installs_vllm_agentkv_and_the_adapters(tmp_path: Path) -> None:
    """pip's resolver, a fresh venv, the checkout and every adapter (dependencies from the package
    index): no distribution named ``agentkv`` comes in, and every adapter imports."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = run_process([python, *args], env=env, cwd=tmp_path, timeout=timeout)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    projects = [str(ROOT), *(str(ROOT / "integrations" / n) for n in sorted(ADAPTERS))]
    run("-m", "pip", "install", "-q", "--disable-pip-version-check", *projects, timeout=840)
    site = run("-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    code = (
        f"ADAPTERS = {sorted(ADAPTERS)!r}\nSITE = {site!r}\n"
        f"MODULES = {[a.module for a in ADAPTERS.values()]!r}\n"
        f"ALIASES = {[a.alias for a in ADAPTERS.values() if a.alias]!r}\n{CHECK_VENV}"
    )
    assert run("-c", code).stdout.startswith("ok ")
    run("-m", "pip", "check")
    sim = run_process(
        [str(env_dir / "bin" / "agentkv"), "sim", "--port", "1"], env=env, cwd=tmp_path
    )
    assert sim.returncode == 1, sim.stdout + sim.stderr
    lines = sim.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentkv: the Python package "), sim.stderr
    assert 'pip install "vllm-agentkv[' in lines[0]

    # PyPI's agentkv installed on top, as pip leaves it: its dist-info, and (pip overwrites
    # files two distributions share) its agentkv/__init__.py in place of ours
    site_dir = Path(site)
    _fake_foreign_agentkv(site_dir, package=False)
    strict = run_process([python, "-W", "error", "-c", "import agentkv"], env=env, cwd=tmp_path)
    assert strict.returncode != 0 and "ForeignDistributionWarning" in strict.stderr, strict.stderr
    init = site_dir / "agentkv" / "__init__.py"
    init.write_text('"""Agent memory."""\n')
    record = site_dir / "agentkv-0.9.1.dist-info" / "RECORD"
    record.write_text(record.read_text() + "agentkv/__init__.py,,\n")
    for adapter in ADAPTERS.values():
        refused = run_process([python, "-c", f"import {adapter.module}"], env=env, cwd=tmp_path)
        last = refused.stderr.strip().splitlines()[-1]
        assert refused.returncode != 0 and last.startswith("ImportError: "), refused.stderr
        assert f"finds {init.resolve()}, overwritten since vllm-agentkv" in last, last
        assert "and agentkv 0.9.1 is installed" in last, last
        fix = "pip uninstall agentkv vllm-agentkv && pip install vllm-agentkv"
        assert last.endswith(fix), last
    # the fix it names (vllm-agentkv from this checkout: it is not on PyPI yet) works
    run("-m", "pip", "uninstall", "-y", "-q", "agentkv", "vllm-agentkv")
    run("-m", "pip", "install", "-q", "--disable-pip-version-check", str(ROOT), timeout=600)
    assert run("-c", code).stdout.startswith("ok ")
