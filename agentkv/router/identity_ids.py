"""Token ids as the identity ledger keeps them: about 2 bytes per id instead of 4.

A vocabulary's ids fit in 17-18 bits and most of a conversation's in 16, so the ids are kept as
planes of their int32 little-endian bytes: byte 0 of every id then byte 1 of every id, as they
are (2 bytes per id), and the planes of bytes 2 and 3 each zlib-compressed when not all zero
(byte 2 is a plane of zeros with a few ones and twos: a few KiB for 32k ids of a 150k
vocabulary; nothing at all is kept when every id is below 65,536, nor byte 3 below 2^24). Both
ways are C slicing of one buffer and a zlib call: no Python code runs per id.
The ids come back exactly as they went in (:meth:`PackedIds.le`).
"""

from __future__ import annotations

import sys
import zlib
from array import array
from collections.abc import Sequence
from typing import Final

from agentkv.router.token_ids import le_ints

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


def _plane(plane: bytes, n: int) -> bytes:
    """A plane of upper bytes as kept: nothing when all zero, else zlib-compressed."""
    return b"" if plane.count(0) == n else zlib.compress(plane, _LEVEL)


class PackedIds:
    """A sequence of token ids (int32), kept compact. Immutable; equal when the ids are."""

    __slots__ = ("_b2", "_b3", "_low")

    def __init__(self, low: bytes, b2: bytes, b3: bytes) -> None:
        self._low = low
        """Byte 0 of every id, then byte 1 of every id (the low 16 bits, little-endian)."""
        self._b2, self._b3 = b2, b3
        """Byte 2, byte 3 of every id, each plane zlib-compressed (empty: all zero)."""

    @classmethod
    def from_le(cls, data: bytes) -> PackedIds:
        """Ids given as int32 little-endian bytes."""
        n = len(data) // 4
        b2, b3 = data[2::4], data[3::4]
        return cls(data[0::4] + data[1::4], _plane(b2, n), _plane(b3, n))

    @classmethod
    def of(cls, ids: Sequence[int]) -> PackedIds:
        """Ids given as a list or an array (``OverflowError`` past int32)."""
        return cls.from_le(_int32_le(ids))

    def le(self) -> bytes:
        """The ids as int32 little-endian bytes."""
        low = self._low
        n = len(low) // 2
        out = bytearray(4 * n)
        out[0::4], out[1::4] = low[:n], low[n:]
        if self._b2:
            out[2::4] = zlib.decompress(self._b2)
        if self._b3:
            out[3::4] = zlib.decompress(self._b3)
        return bytes(out)

    def tolist(self) -> list[int]:
        return le_ints(self.le())

    @property
    def nbytes(self) -> int:
        """What the ids take (the two planes' bytes)."""
        return len(self._low) + len(self._b2) + len(self._b3)

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
