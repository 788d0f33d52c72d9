"""Every snippet of README.md runs as written against a real ``agentkv serve local``.

The server runs on free ports (``agentkv serve local --port R --base-port B``), so the one
change made to a snippet is its ports (``tests/_support/snippets.py`` says how blocks are marked and
run; ``test_doc_snippets.py`` does the same for docs/*.md). A block that is not meant to run
(installs, the whole test suite) is marked by an HTML comment on the line before its fence::

    <!-- doc-test: skip (why) -->
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._support.snippets import ROOT, Block, blocks, problems, run_block, serve_local

pytestmark = pytest.mark.e2e

BLOCKS = blocks(ROOT / "README.md")


def test_the_readme_has_runnable_snippets() -> None:
    langs = [b.lang for b in BLOCKS if b.mode == "run"]
    assert "python" in langs and "bash" in langs
    assert not [p for b in BLOCKS for p in problems(b)]
    for b in BLOCKS:
        assert b.mode == "skip" or b.lang in ("python", "bash"), f"{b.where}: ```{b.lang}"


@pytest.fixture(scope="module")
def router_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    with serve_local(tmp_path_factory.mktemp("serve") / "serve.log") as port:
        yield port


@pytest.mark.parametrize("block", [pytest.param(b, id=b.where) for b in BLOCKS if b.mode == "run"])
def test_snippet_runs(router_port: int, block: Block) -> None:
    run_block(block, router_port)
