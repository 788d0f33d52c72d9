"""The integration packages stay installable on their own (agentkv brings the shared pool)."""

from __future__ import annotations

import importlib

import pytest
from integration_support import ROOT

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

PACKAGES = {
    "agentkv-langchain": ("agentkv_langchain", "ChatAgentKV", "langchain-core"),
    "agentkv-llamaindex": ("agentkv_llamaindex", "AgentKV", "llama-index-core"),
    "agentkv-openai-agents": ("agentkv_openai_agents", "AgentKVModelProvider", "openai-agents"),
}


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_package_metadata_and_public_name(name: str) -> None:
    module, cls, framework = PACKAGES[name]
    folder = ROOT / "integrations" / name
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    assert project["name"] == name
    deps = project["dependencies"]
    assert any(d.startswith("agentkv>=") for d in deps), deps  # the pool lives in agentkv.pool
    pinned = [d for d in deps if d.startswith(framework)]
    assert pinned and ">=" in pinned[0] and "<" in pinned[0], deps  # a tested range
    assert (folder / "README.md").is_file()
    assert (folder / "src" / module / "py.typed").is_file()
    imported = importlib.import_module(module)
    assert cls in imported.__all__
    assert imported.__version__ == project["version"]
