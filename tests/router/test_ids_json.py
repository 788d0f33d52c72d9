"""The request body's ids parsed straight to int32 bytes (agentkv.router.ids_json) against orjson:
the same body and ids for what the router accepts, the general path (and so the same refusal)
for everything else."""

from __future__ import annotations

from typing import Any
from unittest import mock

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.protocol.errors import APIError
from agentkv.router.config import RouterConfig
from agentkv.router.ids_json import fast_body, tokenized
from agentkv.router.request import MAX_TOKEN_ID, ClientRequest, checked_ids, parse_request
from agentkv.router.token_ids import TokenIds

CFG = RouterConfig.model_validate(
    {"upstream": {"prefill": [{"url": "http://p:1"}], "decode": [{"url": "http://d:1"}]}}
)

ids_st = st.lists(st.integers(0, MAX_TOKEN_ID), min_size=1, max_size=300)
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
extra_st = st.dictionaries(
    st.sampled_from(["user", "metadata", "logit_bias", "tags", "x", "vllm_xargs"]),
    json_value,
    max_size=3,
)


def _chat(ids: Any, extra: dict[str, Any], params: dict[str, Any] | None = None) -> bytes:
    kv = {**(params or {}), "prompt_token_ids": ids}
    messages = [{"role": "user", "content": "hi [there], [[1]]"}]
    return orjson.dumps({"model": "m", "messages": messages, **extra, "kv_transfer_params": kv})


def _plain(body: dict[str, Any]) -> Any:
    """A body as orjson would make it: TokenIds as lists."""
    if isinstance(body, TokenIds):
        return body.tolist()
    if isinstance(body, dict):
        return {k: _plain(v) for k, v in body.items()}
    if isinstance(body, list):
        return [_plain(v) for v in body]
    return body


def _old(raw: bytes, chat: bool) -> ClientRequest | str:
    """The general path's outcome (orjson's parse): the request or its refusal's message."""
    with mock.patch("agentkv.router.request.fast_body", lambda raw, chat: None):
        return _new(raw, chat)


def _new(raw: bytes, chat: bool) -> ClientRequest | str:
    try:
        return parse_request(raw, {}, chat=chat, config=CFG)
    except APIError as exc:
        return exc.message


def _same(raw: bytes, chat: bool) -> None:
    old, new = _old(raw, chat), _new(raw, chat)
    if isinstance(old, str) or isinstance(new, str):
        assert old == new
        return
    assert new.prompt_ids == old.prompt_ids
    assert new.prompt_ids is None or new.prompt_ids.data == old.prompt_ids.data  # type: ignore[union-attr]
    assert orjson.dumps(new.body) == orjson.dumps(old.body)


@settings(max_examples=150, deadline=None)
@given(ids_st, extra_st)
def test_chat_ids_parse_as_orjson_does(ids: list[int], extra: dict[str, Any]) -> None:
    raw = _chat(ids, extra, {"do_remote_decode": False})
    fast = fast_body(raw, chat=True)
    assert fast is not None
    body, got = fast
    assert got is not None and got.tolist() == ids and got.data == TokenIds(ids).data
    assert orjson.dumps([got.wire]) == orjson.dumps([ids])
    assert _plain(body) == orjson.loads(raw)
    _same(raw, chat=True)


@settings(max_examples=100, deadline=None)
@given(ids_st, st.booleans(), extra_st)
def test_completion_ids_parse_as_orjson_does(
    ids: list[int], nested: bool, extra: dict[str, Any]
) -> None:
    raw = orjson.dumps({"model": "m", **extra, "prompt": [ids] if nested else ids})
    fast = fast_body(raw, chat=False)
    assert fast is not None
    assert _plain(fast[0]) == orjson.loads(raw)
    _same(raw, chat=False)


def _declined(ids: Any, chat: bool) -> None:
    """The fast path takes no ids from a body with these, and the router answers as before."""
    raw = _chat(ids, {}) if chat else orjson.dumps({"model": "m", "prompt": ids})
    fast = fast_body(raw, chat=chat)
    assert fast is None or fast[1] is None
    _same(raw, chat)


@settings(max_examples=150, deadline=None)
@given(extra_st, st.booleans())
def test_bodies_without_ids_parse_as_orjson_does(extra: dict[str, Any], chat: bool) -> None:
    body: dict[str, Any] = {"model": "m", **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    raw = orjson.dumps(body)
    fast = fast_body(raw, chat=chat)
    assert fast is not None and fast[1] is None
    assert orjson.dumps(fast[0]) == raw
    _same(raw, chat)


bad_element = st.one_of(
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(min_value=-(2**63), max_value=-1),
    st.integers(min_value=MAX_TOKEN_ID + 1, max_value=2**63 - 1),
    st.none(),
    st.text(max_size=3),
    st.lists(st.integers(0, 100), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2),
)


@settings(max_examples=200, deadline=None)
@given(ids_st, bad_element, st.integers(0, 300), st.booleans())
def test_bad_ids_take_the_general_path(ids: list[int], bad: Any, at: int, chat: bool) -> None:
    """Booleans, floats, negatives, ids past int32, nulls, strings, nested lists, objects: the
    fast path declines, and the router answers exactly what orjson's path answers."""
    ids.insert(min(at, len(ids)), bad)
    _declined(ids, chat)


@pytest.mark.parametrize(
    "ids",
    [[], [[1], [2]], [[], [1, 2]], [[1, 2], 3], [1, [2]], [True], [1.0], [-0.0], [2**63 - 1]],
)
@pytest.mark.parametrize("chat", [True, False])
def test_shapes_the_old_parser_refused(ids: Any, chat: bool) -> None:
    _declined(ids, chat)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": [1, 2], "prompt": [3]}',  # duplicate keys: orjson keeps the last
        b'{"prompt": [1, [2]], "x": "\\u005b"}',  # an escaped [ could hide a nested one
        b'{"prompt": [1, 2], "seed": 99999999999999999999}',  # a number past uint64
        b'{"prompt": [1, 2, 10000000000000000000000000000000000000000]}',  # BIGINT_ERROR
        b'{"prompt": [1, 2], "x": "\\ud800"}',  # a lone surrogate
        b'[{"prompt": [1]}]',
        b'{"prompt": [1, 2]',
    ],
)
def test_what_simdjson_reads_otherwise_takes_the_general_path(raw: bytes) -> None:
    assert fast_body(raw, chat=False) is None
    _same(raw, chat=False)


def test_a_body_nested_past_254_levels_is_refused() -> None:
    deep: Any = 1
    for _ in range(300):
        deep = [deep]
    raw = orjson.dumps({"model": "m", "prompt": [1, 2, 3], "x": 0}).replace(
        b'"x":0', b'"x":' + b"[" * 300 + b"1" + b"]" * 300
    )
    assert fast_body(raw, chat=False) is None  # orjson cannot re-encode it: the general path
    req = parse_request(raw, {}, chat=False, config=CFG)
    with pytest.raises(TypeError, match="Recursion limit reached"):
        orjson.dumps(req.body)  # forwarding it is the 400 of _client_fault, as before


def test_whitespace_and_large_ids() -> None:
    ids = [*range(0, 40_000, 3), MAX_TOKEN_ID]
    raw = b'{ "prompt" :\n [ ' + b" ,\n".join(str(i).encode() for i in ids) + b" ] }"
    fast = fast_body(raw, chat=False)
    assert fast is not None and fast[1] is not None and fast[1].tolist() == ids
    _same(raw, chat=False)


@settings(max_examples=60, deadline=None)
@given(ids_st, st.one_of(st.none(), bad_element), st.integers(0, 300))
def test_tokenize_answers_parse_as_checked_ids_does(ids: list[int], bad: Any, at: int) -> None:
    if bad is not None:
        ids.insert(min(at, len(ids)), bad)
    raw = orjson.dumps({"count": len(ids), "max_model_len": 4096, "tokens": ids})
    got = tokenized(raw)
    want = checked_ids(orjson.loads(raw)["tokens"])
    assert got is None if bad is not None else got == want
    assert got is None or got.data == want.data  # type: ignore[union-attr]


def test_escapes_in_the_rest_keep_the_fast_path() -> None:
    """Newlines, quotes and backslashes in the messages are escapes, not an escaped ``[``."""
    raw = _chat([5, 6, 7], {"user": 'a\n"b"\\u005c [c]\t'})
    fast = fast_body(raw, chat=True)
    assert fast is not None and fast[1] is not None and fast[1].tolist() == [5, 6, 7]
    _same(raw, chat=True)


def test_a_live_proxy_of_the_shared_parser_does_not_break_the_next_parse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agentkv.router import ids_json

    pinned = ids_json._PARSER.parse(b'{"a": [1]}')  # pins the shared parser's document
    raw = _chat([1, 2], {})
    fast = fast_body(raw, chat=True)
    assert fast is not None and fast[1] == [1, 2]
    del pinned
    monkeypatch.setattr(ids_json, "_SHARED_UP_TO", 10)  # a large body: a parser of its own
    fast = fast_body(raw, chat=True)
    assert fast is not None and fast[1] == [1, 2]
