"""The README's SDK snippet, as printed, on ``agentkv serve cpu-tiny`` (real vLLM 0.33 on CPU)
and on the simulator in the same shape: it finds the model the server lists (``tiny``) and its
second turn is a ``pull`` (the snippet's comment promises ``turn=2`` and ``decision='pull'``;
``snippets_support.run_block`` holds it to that)."""

from __future__ import annotations

import pytest

from tests._support.snippets import ROOT, blocks, run_block
from tests._support.vllm_scenarios import Stack

pytestmark = pytest.mark.vllm_cpu


@pytest.mark.parametrize("backend", ["real", "sim"])
def test_the_readme_sdk_snippet_pulls(backend: str, request: pytest.FixtureRequest) -> None:
    stack: Stack = request.getfixturevalue(backend)
    (block,) = [b for b in blocks(ROOT / "README.md") if b.lang == "python" and b.mode == "run"]
    assert "turn=2" in block.code and "decision='pull'" in block.code
    run_block(block, int(stack.router.rsplit(":", 1)[1]))
