"""A request body whose token ids are parsed straight to int32 bytes, in C.

The body is parsed once, by simdjson; the ids array of a turn (``prompt`` of
``/v1/completions``, ``kv_transfer_params.prompt_token_ids`` of Chat Completions) is copied by
simdjson into an int64 buffer and checked by numpy (integers from 0 to ``MAX_TOKEN_ID``, at
least one): no Python ``int`` is made per id. The rest of the body becomes Python objects as
orjson would make them.

Only a body the fast path fully understands takes it: anything else (invalid JSON, duplicate
keys, ids that are empty, negative, past int32, not integers, nested, a number simdjson does
not take) returns None, and the caller parses the body as it always did (orjson), which
refuses or accepts it with the same messages as before.

simdjson flattens nested arrays into the buffer; a nested array would also add a ``[`` to the
body: the fast path proves there is none by counting, the ``[`` of the raw body against those
of the rest of the body re-encoded (a ``\\u005b`` escape anywhere: the general path).
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import orjson
import simdjson

from agentkv.router.token_ids import MAX_TOKEN_ID, TokenIds

__all__ = ["fast_body", "tokenized"]

_PARSER = simdjson.Parser()
"""Shared: a parser reuses its buffers (a fresh one per 1.5 MB body costs 3x the parse)."""
_SHARED_UP_TO: Final = 16 << 20
"""Bodies past this get a parser of their own (the shared one keeps its largest buffers)."""
_OPEN, _BACKSLASH, _U, _ZERO, _FIVE, _B = b"[\\u05b"


class _General(Exception):
    """The body is not for the fast path."""


def _python(value: Any) -> Any:
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    if isinstance(value, simdjson.Array):
        return value.as_list()
    return value


def _keys(obj: simdjson.Object) -> list[str]:
    keys = list(obj.keys())
    if len(set(keys)) != len(keys):
        raise _General  # orjson keeps the last of duplicate keys; simdjson's lookup the first
    return keys


def _ids(arr: simdjson.Array) -> TokenIds:
    n = len(arr)
    if not n:
        raise _General
    try:
        buf = arr.as_buffer(of_type="i")  # refuses booleans, floats, strings, null, objects
    except (TypeError, ValueError):
        raise _General from None
    wide = np.frombuffer(buf, dtype=np.int64)
    if wide.size != n or wide.min() < 0 or wide.max() > MAX_TOKEN_ID:
        raise _General
    return TokenIds.from_le(wide.astype("<i4").tobytes())


def _none(_: object) -> None:
    return None


def orjson_of_rest(body: dict[str, Any]) -> bytes:
    """The body as orjson writes it, the ids as null."""
    try:
        return orjson.dumps(body, default=_none)
    except TypeError:  # nested past orjson's limit: the general path says so
        raise _General from None


def _opening(view: np.ndarray[Any, np.dtype[np.uint8]]) -> int:
    """How many ``[`` (numpy: 4× ``bytes.count``'s speed)."""
    return int(np.count_nonzero(view == _OPEN))


def _flat(raw: bytes, rest: bytes) -> None:
    """Proof that no array is nested in the ids (simdjson would flatten it): every ``[`` of the
    raw body is one of the rest's, or the ids' own, and none of the rest's strings was written
    with an escaped ``[`` (``\\u005b``, which the count would take for a literal one).
    Counted by numpy: a scan of the body at memory speed."""
    view = np.frombuffer(raw, dtype=np.uint8)
    if _opening(view) != _opening(np.frombuffer(rest, dtype=np.uint8)) + 1:
        raise _General
    if raw.find(b"\\") < 0:  # no escape at all (memchr)
        return
    at = np.flatnonzero(view[:-5] == _BACKSLASH)
    if at.size and bool(
        (
            (view[at + 1] == _U)
            & (view[at + 2] == _ZERO)
            & (view[at + 3] == _ZERO)
            & (view[at + 4] == _FIVE)
            & ((view[at + 5] | 0x20) == _B)
        ).any()
    ):
        raise _General


_CHAT: Final = ("kv_transfer_params", "prompt_token_ids")
_COMPLETION: Final = ("prompt",)
_TOKENIZE: Final = ("tokens",)


def _convert(
    doc: Any, raw: bytes, where: tuple[str, ...]
) -> tuple[dict[str, Any], TokenIds | None]:
    """The object ``doc`` as orjson would make it, with the ids array at ``where`` (a key, or a
    key and the key of the object under it) as :class:`TokenIds`."""
    if not isinstance(doc, simdjson.Object):
        raise _General
    body: dict[str, Any] = {}
    ids: TokenIds | None = None
    for key in _keys(doc):
        value = doc[key]
        if key != where[0]:
            body[key] = _python(value)
        elif len(where) == 2 and isinstance(value, simdjson.Object):
            params: dict[str, Any] = {}
            for inner in _keys(value):
                item = value[inner]
                if inner == where[1] and isinstance(item, simdjson.Array):
                    ids = params[inner] = _ids(item)
                else:
                    params[inner] = _python(item)
            body[key] = params
        elif len(where) == 1 and isinstance(value, simdjson.Array) and len(value):
            # a completions prompt of ids may be a list of one list of ids
            nested = (
                where == _COMPLETION and len(value) == 1 and isinstance(value[0], simdjson.Array)
            )
            target: Any = value[0] if nested else value
            if len(target) and type(target[0]) is int:
                ids = _ids(target)
                body[key] = [ids] if nested else ids
            else:
                body[key] = _python(value)
        else:
            body[key] = _python(value)
    if ids is not None:
        _flat(raw, orjson_of_rest(body))
    return body, ids


def _document(raw: bytes) -> Any:
    """simdjson's parse of ``raw`` (``ValueError``, ``RuntimeError``: not JSON it reads)."""
    global _PARSER
    if len(raw) > _SHARED_UP_TO:  # a parser of its own, whose buffers go with it
        return simdjson.Parser().parse(raw)
    try:
        return _PARSER.parse(raw)
    except RuntimeError as exc:
        if not str(exc).startswith("Tried to re-use a parser"):
            raise  # BIGINT_ERROR (a number past 64 bits) and the like
        _PARSER = simdjson.Parser()  # a proxy of the last document is still alive somewhere
        return _PARSER.parse(raw)


def _parsed(raw: bytes, where: tuple[str, ...]) -> tuple[dict[str, Any], TokenIds | None] | None:
    try:
        return _convert(_document(raw), raw, where)
    except (_General, ValueError, RuntimeError):
        return None


def fast_body(raw: bytes, *, chat: bool) -> tuple[dict[str, Any], TokenIds | None] | None:
    """The body of a request and its ids (None: none), or None when the body takes the general
    path (see the module's doc)."""
    return _parsed(raw, _CHAT if chat else _COMPLETION)


def tokenized(raw: bytes) -> TokenIds | None:
    """The ``tokens`` of an engine's ``/tokenize`` answer, or None when the answer takes the
    general path (orjson and :func:`~agentkv.router.request.checked_ids`)."""
    parsed = _parsed(raw, _TOKENIZE)
    return None if parsed is None else parsed[1]
