"""The README's SDK snippet, as printed, on real vLLM 0.33 on CPU (cpu-tiny's engines) and on
the simulator in the same shape, each behind a router with the default ``paths.mode``
(``choose``; the tier's own routers pin ``pull``): it finds the model the server lists
(``tiny``) and its second turn, a few new tokens, is decoded on D in place (the snippet's
comment promises ``turn=2`` and ``decision='decode'``; ``snippets_support.run_block`` holds it
to that)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._support.snippets import ROOT, blocks, run_block
from tests._support.vllm_scenarios import Stack, router_on

pytestmark = pytest.mark.vllm_cpu


@pytest.mark.parametrize("backend", ["real", "sim"])
def test_the_readme_sdk_snippet_decodes_in_place(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    stack: Stack = request.getfixturevalue(backend)
    (block,) = [b for b in blocks(ROOT / "README.md") if b.lang == "python" and b.mode == "run"]
    assert "turn=2" in block.code and "decision='decode'" in block.code
    engines = {
        "prefill": [{"url": stack.prefill, "bidirectional": True}],
        "decode": [{"url": stack.decode}],
    }
    for url in router_on(stack, tmp_path, upstream=engines, paths={"mode": "choose"}):
        run_block(block, int(url.rsplit(":", 1)[1]))
