"""Token ids as the identity ledger keeps them: about 2 bytes per id instead of 4.

A vocabulary's ids fit in 17-18 bits and most of a conversation's in 16, so the ids are kept as
two planes of their int32 little-endian bytes: the low 16 bits of every id, as they are (2 bytes
per id), and the upper 16 bits zlib-compressed (a plane of zeros with a few ones and twos: a
few hundred bytes for 32k ids of a 150k vocabulary, nothing at all when every id is below
65,536). Both ways are C slicing of one buffer and one zlib call: no Python code runs per id.
The ids come back exactly as they went in (:meth:`PackedIds.le`).
"""

from __future__ import annotations

import sys
import zlib
from array import array
from collections.abc import Sequence
from typing import Final

__all__ = ["PackedIds", "le_ints"]

_LEVEL: Final = 1
"""zlib's fastest level: the upper plane is almost all zeros, any level shrinks it as much."""


def _int32_le(ids: Sequence[int]) -> bytes:
    packed = array("i")
    if isinstance(ids, array) and ids.typecode == "i":
        packed = ids
    elif isinstance(ids, list):
        packed.fromlist(ids)
    else:
        packed.extend(ids)
    if sys.byteorder == "big":
        packed = array("i", packed)
        packed.byteswap()
    return packed.tobytes()


def le_ints(data: bytes) -> list[int]:
    """int32 little-endian bytes as a list of ids."""
    out = array("i")
    out.frombytes(data)
    if sys.byteorder == "big":
        out.byteswap()
    return out.tolist()


class PackedIds:
    """A sequence of token ids (int32), kept compact. Immutable; equal when the ids are."""

    __slots__ = ("_high", "_low")

    def __init__(self, low: bytes, high: bytes) -> None:
        self._low = low
        """The low 16 bits of every id, little-endian."""
        self._high = high
        """The upper 16 bits of every id, little-endian, zlib-compressed (empty: all zero)."""

    @classmethod
    def from_le(cls, data: bytes) -> PackedIds:
        """Ids given as int32 little-endian bytes."""
        n = len(data) // 4
        low = bytearray(2 * n)
        low[0::2], low[1::2] = data[0::4], data[1::4]
        upper = bytearray(2 * n)
        upper[0::2], upper[1::2] = data[2::4], data[3::4]
        high = b"" if upper.count(0) == len(upper) else zlib.compress(upper, _LEVEL)
        return cls(bytes(low), high)

    @classmethod
    def of(cls, ids: Sequence[int]) -> PackedIds:
        """Ids given as a list or an array (``OverflowError`` past int32)."""
        return cls.from_le(_int32_le(ids))

    def le(self) -> bytes:
        """The ids as int32 little-endian bytes."""
        low = self._low
        out = bytearray(2 * len(low))
        out[0::4], out[1::4] = low[0::2], low[1::2]
        if self._high:
            upper = zlib.decompress(self._high)
            out[2::4], out[3::4] = upper[0::2], upper[1::2]
        return bytes(out)

    def tolist(self) -> list[int]:
        return le_ints(self.le())

    @property
    def nbytes(self) -> int:
        """What the ids take (the two planes' bytes)."""
        return len(self._low) + len(self._high)

    def __len__(self) -> int:
        return len(self._low) // 2

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedIds):
            return NotImplemented
        return self._low == other._low and self.le() == other.le()

    def __hash__(self) -> int:
        return hash(self._low)

    def __repr__(self) -> str:
        return f"PackedIds({len(self)} ids, {self.nbytes} bytes)"
