"""Framework adapters over real HTTP: simulator P and D processes behind an agentkv router.

The adapters (``integrations/*/src``, and ``integrations/llama-index-llms-agentkv`` with its
``llama_index/llms/agentkv`` namespace layout), the examples' simulator helper
(``examples/_sim.py``) and the router tests' process stack (``tests/_support/stack.py``) are
imported from the checkout, so these tests need no extra install step beyond the frameworks
themselves (the ``dev`` extra).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._support.integration import ADAPTER_SOURCES

_ROOT = Path(__file__).resolve().parents[2]
for _path in [
    *ADAPTER_SOURCES,
    _ROOT / "examples",
]:
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _sim import Scripts, clients  # noqa: E402

import agentkv  # noqa: E402
from tests._support.integration import Recorder  # noqa: E402
from tests._support.stack import NO_P_CACHE, Stack, stack  # noqa: E402


@pytest.fixture(scope="session")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with stack(tmp_path_factory.mktemp("integrations"), p_args=NO_P_CACHE) as s:
        yield s


@pytest.fixture
def base_url(pd: Stack) -> str:
    return f"{pd.router.url}/v1"


@pytest.fixture
def scripts() -> Scripts:
    return Scripts()


@pytest.fixture
def sdk_clients(
    base_url: str, scripts: Scripts
) -> Iterator[tuple[agentkv.Client, agentkv.AsyncClient]]:
    """agentkv clients whose chat requests carry the next script of ``scripts``."""
    sync, asynchronous = clients(base_url, scripts)
    yield sync, asynchronous
    sync.close()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()
