"""The flat hash tables under the compact engine index (``docs/compact-index.md``): their layout,
probing kernels and helpers, shared by :mod:`kvcm.engines.keytable` and
:mod:`kvcm.engines.sourcemap`.

Layout: a *dense* entry store (parallel arrays, one row per entry) plus a sparse *index* of
``uint32`` row numbers, open addressing with linear probing, at most :data:`MAX_LOAD` full,
grown by :data:`GROWTH` (homes by range reduction, so any size works), deletion by backward
shift (no tombstones: a long-lived table under churn keeps its probe lengths). The index is what
has to be mostly empty; keeping the 8-byte keys out of it costs 4 bytes per cell instead of
12-20, and rows of the dense store that were never written cost no resident memory (numpy
allocates large arrays with ``mmap``). The empty index cell is ``0xFFFFFFFF``, which no row
number reaches, so every ``uint64`` key (0 and 2**64 - 1 included) is a valid key.

kvcm keys are signed 64-bit ints in Python; here they are their ``uint64`` bit patterns
(:func:`as_u64`, :func:`to_signed_list`). Kernels are compiled on first use and cached on disk
beside their module where it is writable, as :mod:`kvcm.cache.hash_kernel` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import numba
import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
#: Keys, hashes or positions as callers give them: Python ints or an integer array.
Ints = Sequence[int] | U64 | I64 | U32
#: A cell or row number as the kernels compute it: a Python int, or numpy's (numba's) int64.
Cell = int | np.int64
_S = TypeVar("_S", bound=np.generic)

#: Index fill at most (live entries / cells); past it the index doubles. Linear probing's
#: expected probes grow as 1/(1-load)^2 for a miss: 0.8 keeps a miss around 13 cells.
MAX_LOAD = 0.8
#: Index growth per size level: 1.25, not 2, so an index is never much emptier than
#: MAX_LOAD / GROWTH (0.64) — at doubling it drops to 0.4 full, 4 bytes a cell wasted per key.
GROWTH = 1.25
#: Levels between the size an index needs and one it shrinks from (1.25**7: about 4.8x).
SHRINK_LEVELS = 7
EMPTY = np.uint32(0xFFFFFFFF)  # an empty index cell (no row number reaches it)
NIL = np.uint64(0xFFFFFFFFFFFFFFFF)  # end of KeyTable's free-row chain
NO_POS = np.uint32(0xFFFFFFFF)  # a KeyTable row whose key's position is not known (yet)
#: Positions are token counts stored as ``uint32``: 0 .. MAX_POS (2**32 - 1 means unknown).
MAX_POS = 0xFFFFFFFE
#: KeyTable rows and SourceMap values are ``uint32`` (and 2**32 - 1 is the empty index cell).
MAX_ROWS = 0xFFFFFFFF
_C1: np.uint64 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finaliser: keys need not be well mixed
_C2: np.uint64 = np.uint64(0x94D049BB133111EB)  # (Tair reporters name blocks by key; tests by counting)
_S30: np.uint64 = np.uint64(30)
_S27: np.uint64 = np.uint64(27)
_S31: np.uint64 = np.uint64(31)
_S32: np.uint64 = np.uint64(32)
# meta[] fields shared with the kernels (a small int64 array they update in place)
SIZE, USED, AUX = 0, 1, 2  # live entries, rows written (high-water mark), free head / eviction head

_F = TypeVar("_F", bound=Callable[..., object])


def jit(fn: _F) -> _F:
    """numba-compile ``fn``, cached beside this file (compiled at each start when read-only)."""
    try:
        return cast(_F, numba.njit(cache=True, nogil=True)(fn))
    except RuntimeError:
        return cast(_F, numba.njit(nogil=True)(fn))


# --- kernels: probing, backward-shift deletion, rebuilding ----------------------------------------


@jit
def home(key: np.uint64, cells: np.uint64) -> Cell:
    """The key's home cell: its mix's top 32 bits scaled to the index's ``cells`` (any count:
    the index grows by :data:`GROWTH`, not by doubling)."""
    z = key
    z = (z ^ (z >> _S30)) * _C1
    z = (z ^ (z >> _S27)) * _C2
    z = z ^ (z >> _S31)
    cell: np.int64 = np.int64(((z >> _S32) * cells) >> _S32)
    return cell


@jit
def find(index: U32, rows: U64, key: np.uint64, shift: np.uint64) -> Cell:
    """The cell whose row holds ``key``, or ``-(empty cell) - 1`` where it would go."""
    n = index.shape[0]
    i = home(key, shift)
    while True:
        r = index[i]
        if r == EMPTY:
            return -i - 1
        if rows[r] == key:
            return i
        i += 1
        if i == n:
            i = 0


@jit
def delete_cell(index: U32, rows: U64, i: Cell, shift: np.uint64) -> None:
    """Empty cell ``i`` by backward shift: each later cell of the probe run whose home is not in
    ``(i, j]`` (cyclically) moves back into the hole, so every remaining key stays reachable
    from its home without tombstones."""
    n = index.shape[0]
    j = i
    while True:
        j += 1
        if j == n:
            j = 0
        r = index[j]
        if r == EMPTY:
            break
        h = home(rows[r], shift)
        if (j - h) % n >= (j - i) % n:  # its home is at or before the hole
            index[i] = r
            i = j
    index[i] = EMPTY


@jit
def place(index: U32, rows: U64, r: Cell, shift: np.uint64) -> None:
    """Put row ``r`` (a key not in the index) into its first free cell from home."""
    n = index.shape[0]
    i = home(rows[r], shift)
    while index[i] != EMPTY:
        i += 1
        if i == n:
            i = 0
    index[i] = r


@jit
def reindex_cells(old: U32, rows: U64, new: U32, shift: np.uint64) -> None:
    """Every row of index ``old`` into the (empty) index ``new``."""
    for c in range(old.shape[0]):
        r = old[c]
        if r != EMPTY:
            place(new, rows, r, shift)


# --- helpers ---------------------------------------------------------------------------------------


def as_u64(keys: Ints, unsigned: bool = False) -> U64:
    """kvcm keys (signed 64-bit ints, or any ints mod 2**64) as a ``uint64`` array; tried first
    as ``unsigned`` says they are (engine block hashes are; kvcm keys are signed): a failed
    conversion costs as much as a good one."""
    if isinstance(keys, np.ndarray):
        if keys.dtype == np.uint64:
            return keys.view(np.uint64)
        if keys.dtype == np.int64:
            return keys.view(np.uint64)
        return keys.astype(np.uint64)
    for dtype in (np.uint64, np.int64) if unsigned else (np.int64, np.uint64):
        try:
            return np.fromiter(keys, dtype=dtype, count=len(keys)).view(np.uint64)
        except OverflowError:
            continue
    return np.array([k & 0xFFFFFFFFFFFFFFFF for k in keys], dtype=np.uint64)  # both signs among them


def to_signed_list(keys: U64) -> list[int]:
    """``uint64`` keys back as Python ints in kvcm's signed form."""
    out: list[int] = keys.view(np.int64).tolist()
    return out


def cells_at(level: int) -> int:
    """Index cells at size ``level``: 8, then :data:`GROWTH` times more each level."""
    return max(8, int(8 * GROWTH**level))


def level_for(n: int) -> int:
    """The smallest index size level holding ``n`` live entries within :data:`MAX_LOAD`."""
    level = 0
    while n > MAX_LOAD * cells_at(level):
        level += 1
    return level


def new_index(level: int) -> U32:
    return np.full(cells_at(level), EMPTY, dtype=np.uint32)


def grown(arr: npt.NDArray[_S], used: int, capacity: int) -> npt.NDArray[_S]:
    """``arr``'s first ``used`` rows in a new array of ``capacity`` rows; the rest is left
    unwritten (untouched pages of a large array are not resident)."""
    out = np.empty(capacity, dtype=arr.dtype)
    out[:used] = arr[:used]
    return out


class Indexed:
    """The index half shared by :class:`KeyTable` and :class:`SourceMap`."""

    index: U32
    meta: I64

    def _set_index(self, bits: int) -> None:
        self.bits = bits  # the index's size level (:func:`cells_at`)
        self.shift = np.uint64(cells_at(bits))  # what the kernels scale a mix by (their ``shift``)
        self.limit = int(MAX_LOAD * cells_at(bits))

    def __len__(self) -> int:
        return int(self.meta[SIZE])

    @property
    def capacity(self) -> int:
        """Index cells."""
        return cells_at(self.bits)


