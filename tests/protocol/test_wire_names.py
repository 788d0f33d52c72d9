"""The handle's field names are spelled in ``agentkv/protocol/`` only.

Everything else reads and edits ``kv_transfer_params`` through :mod:`agentkv.protocol.kv_transfer`
(the model for what crosses a trust boundary, plain functions over the dict on the hot paths), so
a field vLLM renames or adds is one edit. Prose may name a field; code may not: a string constant,
a name, an attribute or a keyword equal to a field name fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

from agentkv.protocol import KVTransferParams

ROOT = Path(__file__).resolve().parents[2] / "agentkv"
HANDLE_FIELDS = frozenset(KVTransferParams.model_fields) - {"prompt_token_ids"} | {
    "_remote_blocks_processed"
}
"""``prompt_token_ids`` is a body field too (``protocol.names.BODY_PROMPT_TOKEN_IDS``)."""


def _spellings(tree: ast.AST) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        word: str | None = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
            value = node.value.decode() if isinstance(node.value, bytes) else node.value
            word = value.strip('"')
        elif isinstance(node, ast.Attribute):
            word = node.attr
        elif isinstance(node, ast.Name):
            word = node.id
        elif isinstance(node, ast.keyword):
            word = node.arg
        if word in HANDLE_FIELDS:
            out.append((getattr(node, "lineno", 0), word))
    return out


def test_the_fields_are_known() -> None:
    assert {"remote_num_tokens", "remote_block_ids", "do_remote_decode", "do_remote_prefill"} <= (
        HANDLE_FIELDS
    )


def test_handle_fields_are_spelled_in_protocol_only() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if (ROOT / "protocol") in path.parents:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        found += [
            f"{path.relative_to(ROOT.parent)}:{line}: {word}" for line, word in _spellings(tree)
        ]
    assert not found, "handle fields outside agentkv/protocol/:\n" + "\n".join(found)


def test_every_router_metric_is_named_in_protocol() -> None:
    """The router's metric names live in ``protocol.names.RouterMetric``, one per family."""
    from agentkv.protocol.names import RouterMetric
    from agentkv.router import create_app
    from agentkv.router.config import RouterConfig

    config = RouterConfig.model_validate(
        {
            "upstream": {
                "prefill": [{"url": "http://127.0.0.1:1"}],
                "decode": [{"url": "http://127.0.0.1:2"}],
            }
        }
    )
    registry = create_app(config).state.router.metrics.registry
    exported = {family.name for family in registry.collect()}
    named = {v for k, v in vars(RouterMetric).items() if k.isupper()}
    assert exported == named, (exported - named, named - exported)
