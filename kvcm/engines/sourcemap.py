"""SourceMap: engine block hash -> the key's KeyTable row, per (source, group), in store order
(eviction takes the oldest from the front; :mod:`kvcm.engines.flat` has the layout)."""

from __future__ import annotations

import numpy as np

from kvcm.engines.flat import (
    AUX,
    EMPTY,
    I64,
    MAX_ROWS,
    SHRINK_LEVELS,
    SIZE,
    U32,
    U64,
    USED,
    Bools,
    Indexed,
    Ints,
    as_u64,
    cells_at,
    delete_cell,
    find,
    grown,
    jit,
    level_for,
    new_index,
    place,
    reindex_cells,
)

# --- SourceMap kernels ---------------------------------------------------------------------------


@jit
def _sm_insert(
    index: U32, hashes: U64, vals: U32, meta: I64, shift: np.uint64, limit: int,
    qh: U64, qv: U32, had: Bools, old: U32, start: int,
) -> int:  # fmt: skip
    """Append ``(qh[i], qv[i])`` from ``start`` on, in order; a hash already present has its
    row abandoned (``had``, its value in ``old``) and the new row takes its cell: it becomes the
    newest. Stops early (returns where) when rows or the index are full."""
    for i in range(start, qh.shape[0]):
        c = find(index, hashes, qh[i], shift)
        if meta[USED] >= hashes.shape[0] or (c < 0 and meta[SIZE] >= limit):
            return i
        r = meta[USED]
        meta[USED] += 1
        hashes[r] = qh[i]
        vals[r] = qv[i]
        if c >= 0:
            had[i] = True
            old[i] = vals[index[c]]
            index[c] = r
        else:
            had[i] = False
            index[-c - 1] = r
            meta[SIZE] += 1
    return len(qh)


@jit
def _sm_get(index: U32, hashes: U64, vals: U32, shift: np.uint64, qh: U64, found: Bools, out: U32) -> None:
    for i in range(qh.shape[0]):
        c = find(index, hashes, qh[i], shift)
        found[i] = c >= 0
        if c >= 0:  # two statements: a conditional expression of uint64 and int would be a float
            out[i] = vals[index[c]]
        else:
            out[i] = 0


@jit
def _sm_any(index: U32, hashes: U64, shift: np.uint64, qh: U64) -> bool:
    for i in range(qh.shape[0]):  # noqa: SIM110 (numba compiles no generator into any())
        if find(index, hashes, qh[i], shift) >= 0:
            return True
    return False


@jit
def _sm_remove(index: U32, hashes: U64, vals: U32, meta: I64, shift: np.uint64, qh: U64, found: Bools, out: U32) -> None:
    """Remove ``qh`` (in order: a hash named twice is found once); its row is abandoned."""
    for i in range(qh.shape[0]):
        c = find(index, hashes, qh[i], shift)
        if c < 0:
            found[i] = False
            out[i] = 0
            continue
        found[i] = True
        out[i] = vals[index[c]]
        delete_cell(index, hashes, c, shift)
        meta[SIZE] -= 1


@jit
def _sm_oldest(index: U32, hashes: U64, vals: U32, meta: I64, shift: np.uint64, n: int, out_h: U64, out_v: U32) -> int:
    """Remove up to ``n`` live rows from the eviction head on, oldest first; returns how many. A
    row is live when its hash's cell points back at it (an abandoned row's hash leads elsewhere
    or nowhere), so liveness costs no memory."""
    p = meta[AUX]
    k = 0
    while k < n and p < meta[USED]:
        c = find(index, hashes, hashes[p], shift)
        if c >= 0 and index[c] == p:
            out_h[k] = hashes[p]
            out_v[k] = vals[p]
            delete_cell(index, hashes, c, shift)
            meta[SIZE] -= 1
            k += 1
        p += 1
    meta[AUX] = p
    return k


@jit
def _sm_live(index: U32, used: int) -> Bools:
    live = np.zeros(used, dtype=np.bool_)
    for c in range(index.shape[0]):
        r = index[c]
        if r != EMPTY:
            live[r] = True
    return live


@jit
def _sm_pack(live: Bools, hashes: U64, vals: U32, new_hashes: U64, new_vals: U32, new_index: U32, shift: np.uint64) -> int:
    """Copy the live rows, in order, to the front of the new arrays (which may be the old ones:
    rows only move down) and index them; returns how many."""
    w = 0
    for p in range(live.shape[0]):
        if live[p]:
            new_hashes[w] = hashes[p]
            new_vals[w] = vals[p]
            place(new_index, new_hashes, w, shift)
            w += 1
    return w


# --- SourceMap ------------------------------------------------------------------------------------------


class SourceMap(Indexed):
    """Engine block hash (``uint64``) -> :class:`KeyTable` row (``uint32``), for one (source,
    group), in insertion order: rows are appended (``hashes``, ``rows``), so the oldest live
    entries are the first ones and eviction walks from the front (no sequence column: 4 bytes a
    holding saved, and :meth:`oldest` is ``O(n)``, not a partition of the whole map). A removed
    or re-inserted hash abandons its map row; abandoned rows are packed away once they pass a
    quarter of the live ones (amortised ``O(1)`` per change).

    The value is the block's key's row in its namespace's :class:`KeyTable` (4 bytes, not the
    8-byte key; the key and its position are read there). KeyTable rows are stable while the
    key lives, and an entry here is one holding of the key by this map's slot, so the row stays
    the key's as long as the entry exists, provided the caller releases the holding only with
    the entry (:meth:`remove_many`, :meth:`oldest`, a re-insert's previous value)."""

    def __init__(self, capacity: int = 8) -> None:
        self.meta = np.array([0, 0, 0], dtype=np.int64)  # size, rows used, eviction head
        self._set_index(level_for(capacity))
        self.index = new_index(self.bits)
        self.hashes: U64 = np.empty(max(8, capacity), dtype=np.uint64)
        self.rows: U32 = np.empty(max(8, capacity), dtype=np.uint32)

    def insert_many(
        self, hashes: Ints, rows: Ints
    ) -> tuple[Bools, U32]:
        """Map each hash to its KeyTable row, in order, each becoming the newest (a hash present
        already is updated and moved to the end, as a full re-report makes a block the newest).
        Returns per hash whether it was present, and its previous row (0 where it was not)."""
        qh, qr = as_u64(hashes, unsigned=True), _as_rows(rows)
        if len(qh) != len(qr):
            raise ValueError("hashes and rows differ in length")
        had = np.zeros(len(qh), dtype=np.bool_)
        old = np.zeros(len(qh), dtype=np.uint32)
        at = 0
        while True:
            at = _sm_insert(self.index, self.hashes, self.rows, self.meta, self.shift, self.limit, qh, qr, had, old, at)
            if at >= len(qh):
                break
            if int(self.meta[USED]) >= len(self.hashes):
                self._make_rows(len(qh) - at)
            else:
                self._reindex(self.bits + 1)
        self._maybe_compact()
        return had, old

    def get_many(self, hashes: Ints) -> tuple[Bools, U32]:
        """Per hash: whether present, and its row (0 where not)."""
        qh = as_u64(hashes, unsigned=True)
        found = np.empty(len(qh), dtype=np.bool_)
        out = np.empty(len(qh), dtype=np.uint32)
        _sm_get(self.index, self.hashes, self.rows, self.shift, qh, found, out)
        return found, out

    def any_of(self, hashes: Ints) -> bool:
        """Whether any of ``hashes`` is present."""
        return bool(len(self)) and bool(_sm_any(self.index, self.hashes, self.shift, as_u64(hashes, unsigned=True)))

    def remove_many(self, hashes: Ints) -> tuple[Bools, U32]:
        """Remove the hashes; per hash whether it was present, and its row (0 where not)."""
        qh = as_u64(hashes, unsigned=True)
        found = np.empty(len(qh), dtype=np.bool_)
        out = np.empty(len(qh), dtype=np.uint32)
        _sm_remove(self.index, self.hashes, self.rows, self.meta, self.shift, qh, found, out)
        self._maybe_compact()
        return found, out

    def oldest(self, n: int) -> tuple[U64, U32]:
        """Remove the ``n`` oldest entries (fewer if it holds fewer); their hashes and rows,
        oldest first."""
        n = max(0, min(n, len(self)))
        out_h = np.empty(n, dtype=np.uint64)
        out_r = np.empty(n, dtype=np.uint32)
        got = _sm_oldest(self.index, self.hashes, self.rows, self.meta, self.shift, n, out_h, out_r)
        self._maybe_compact()
        return out_h[:got], out_r[:got]

    def items(self) -> tuple[U64, U32]:
        """Every hash and its row, oldest first."""
        used = int(self.meta[USED])
        live = _sm_live(self.index, used)
        return self.hashes[:used][live], self.rows[:used][live]

    def _reindex(self, bits: int) -> None:
        new = new_index(bits)
        reindex_cells(self.index, self.hashes, new, np.uint64(cells_at(bits)))
        self.index = new
        self._set_index(bits)

    def _make_rows(self, wanted: int) -> None:
        """Room for more rows: pack the abandoned ones away when they are a quarter of the rows,
        else grow the row arrays by a quarter (at least ``wanted`` rows)."""
        used, size = int(self.meta[USED]), len(self)
        if used - size >= max(wanted, used // 4):
            self._pack(len(self.hashes))
        else:  # x1.25: a map's arrays come from the malloc heap, where the unwritten tail of a
            # new array may be pages an earlier freed array touched (resident though unused)
            cap = len(self.hashes) + max(wanted, len(self.hashes) // 4, 8)
            self.hashes, self.rows = grown(self.hashes, used, cap), grown(self.rows, used, cap)

    def _maybe_compact(self) -> None:
        used, size = int(self.meta[USED]), len(self)
        if used - size > 64 + size // 4:
            cap = len(self.hashes)
            self._pack(max(8, 2 * size) if cap > 4 * max(size, 8) else cap)

    def _pack(self, capacity: int) -> None:
        """Live rows to the front, in order, into arrays of ``capacity`` rows (the same arrays if
        their size), and a fresh index (smaller when the map shrank)."""
        used, size = int(self.meta[USED]), len(self)
        live = _sm_live(self.index, used)
        bits = self.bits
        needed = level_for(size)
        if needed + SHRINK_LEVELS <= bits:
            bits = needed + 3
        index = new_index(bits)
        if capacity == len(self.hashes):
            hashes, rows = self.hashes, self.rows
        else:
            hashes, rows = np.empty(capacity, dtype=np.uint64), np.empty(capacity, dtype=np.uint32)
        _sm_pack(live, self.hashes, self.rows, hashes, rows, index, np.uint64(cells_at(bits)))
        self.hashes, self.rows, self.index = hashes, rows, index
        self._set_index(bits)
        self.meta[USED], self.meta[AUX] = size, 0

    def nbytes(self) -> int:
        """Bytes of its arrays as allocated (see :meth:`used_bytes`)."""
        return int(self.index.nbytes + self.hashes.nbytes + self.rows.nbytes + self.meta.nbytes)

    def used_bytes(self) -> int:
        """Bytes of its index and of the rows written so far (what can be resident)."""
        return int(self.index.nbytes + int(self.meta[USED]) * (8 + 4))


def _as_rows(rows: Ints) -> U32:
    """KeyTable rows as ``uint32``; a negative row (not found) is refused."""
    arr = np.asarray(rows)
    if arr.dtype == np.uint32:
        return arr
    if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= MAX_ROWS):
        raise ValueError("a row outside 0 .. 2**32 - 2 (a key not found?)")
    return arr.astype(np.uint32)
