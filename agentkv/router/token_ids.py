"""A prompt's token ids as the router carries them: int32 little-endian bytes, from the parse of
the client's body to the bodies sent to P and D, with no Python ``int`` made per id on a turn's
path (issue 23). A list is made only where a cold path asks for one (:meth:`TokenIds.tolist`,
indexing, iteration)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np
import orjson

__all__ = ["MAX_TOKEN_ID", "TokenIds", "int32_le", "le_ints", "wire_ids"]

MAX_TOKEN_ID = (1 << 31) - 1
"""The largest token id the router accepts (vocabularies are far below 2^31)."""


def int32_le(ids: Iterable[int]) -> bytes:
    """Token ids as int32 little-endian bytes (``OverflowError``, ``TypeError`` for what is not
    an int32)."""
    if isinstance(ids, TokenIds):
        return ids.data
    packed = array("i")
    if isinstance(ids, list):
        packed.fromlist(ids)  # twice as fast as array("i", ids), whatever the list's class
    else:
        packed.extend(ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def le_ints(data: bytes) -> list[int]:
    """int32 little-endian bytes as a list of ids."""
    out = array("i")
    out.frombytes(data)
    if sys.byteorder == "big":
        out.byteswap()
    return out.tolist()


class TokenIds(Sequence[int]):
    """A prompt's token ids, checked once, with the two encodings a turn needs made once each:
    ``data`` (int32 little-endian, what :mod:`~agentkv.router.verify` hashes) and ``wire``
    (their JSON, spliced into P's and D's bodies by orjson without encoding them again).

    Made from ``data`` (:meth:`from_le`: the request's ids, parsed straight to int32 bytes by
    :mod:`~agentkv.router.ids_json`), or from a list (the tokenizer's answer). Equal to a list
    or another ``TokenIds`` of the same ids."""

    __slots__ = ("_data", "_json", "_list")

    def __init__(self, ids: Iterable[int] = (), *, data: bytes | None = None) -> None:
        self._data: bytes | None = data
        self._json: bytes | None = None
        self._list: list[int] | None
        if isinstance(ids, TokenIds):  # a copy keeps the encodings already made
            self._data = ids._data if data is None else data
            self._json, self._list = ids._json, ids._list
            if self._data is None:
                self._data = ids.data
        else:
            self._list = list(ids)

    @classmethod
    def from_le(cls, data: bytes, wire: bytes | None = None) -> TokenIds:
        """Ids given as int32 little-endian bytes (already checked), and their JSON if known."""
        out = cls.__new__(cls)
        out._data, out._json, out._list = data, wire, None
        return out

    @property
    def data(self) -> bytes:
        """The ids as int32 little-endian (``OverflowError`` past int32)."""
        if self._data is None:
            assert self._list is not None
            self._data = int32_le(self._list)
        return self._data

    def array(self) -> np.ndarray[Any, np.dtype[np.int32]]:
        """The ids as a read-only numpy int32 array over ``data`` (no copy on little-endian)."""
        return np.frombuffer(self.data, dtype="<i4").astype(np.int32, copy=False)

    @property
    def wire(self) -> orjson.Fragment:
        """The ids' JSON, for a body encoded by orjson."""
        if self._json is None:
            self._json = (
                orjson.dumps(self._list)
                if self._list is not None
                else orjson.dumps(self.array(), option=orjson.OPT_SERIALIZE_NUMPY)
            )
        return orjson.Fragment(self._json)

    def tolist(self) -> list[int]:
        """The ids as a list (made once: a cold path's)."""
        if self._list is None:
            self._list = le_ints(self.data)
        return self._list

    def __len__(self) -> int:
        return len(self._data) // 4 if self._data is not None else len(self.tolist())

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if self._list is not None:
            return self._list[index]
        n = len(self)
        if isinstance(index, slice):  # a run of ids: only its own bytes are decoded
            start, stop, step = index.indices(n)
            if step != 1:
                return self.tolist()[index]
            return le_ints(self.data[4 * start : 4 * max(start, stop)])
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError("TokenIds index out of range")
        return int.from_bytes(self.data[4 * i : 4 * i + 4], "little", signed=True)

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self.data == other.data
        if isinstance(other, list):
            return self.tolist() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, as a list

    def __repr__(self) -> str:
        return f"TokenIds({len(self)} ids)"


def wire_ids(ids: Sequence[int]) -> Any:
    """What to put in a body for ``ids``: their JSON encoded once (:class:`TokenIds`), or the
    list."""
    return ids.wire if isinstance(ids, TokenIds) else list(ids)
