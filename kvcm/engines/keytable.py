"""KeyTable: kvcm key -> holder-set id and token position, per namespace, in rows that stay a key's
while it lives (:mod:`kvcm.engines.flat` has the layout)."""

from __future__ import annotations

import numpy as np

from kvcm.engines.flat import (
    AUX,
    EMPTY,
    I64,
    MAX_POS,
    MAX_ROWS,
    NIL,
    NO_POS,
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
    reindex_cells,
)

# --- KeyTable kernels ---------------------------------------------------------------------------


@jit
def _kt_lookup(index: U32, keys: U64, sets: U32, shift: np.uint64, query: U64, out: U32) -> None:
    for i in range(query.shape[0]):
        c = find(index, keys, query[i], shift)
        if c >= 0:
            out[i] = sets[index[c]]
        else:
            out[i] = 0


@jit
def _kt_stretches(index: U32, keys: U64, sets: U32, shift: np.uint64, query: U64, starts: I64, ids: U32) -> int:
    """The query's keys' set ids as stretches of one id: ``starts[j]`` is where stretch ``j``
    begins and ``ids[j]`` its id (0 for keys not held); returns how many stretches."""
    n = 0
    last = np.uint32(0)
    for i in range(query.shape[0]):
        c = find(index, keys, query[i], shift)
        sid = sets[index[c]] if c >= 0 else np.uint32(0)
        if i == 0 or sid != last:
            starts[n] = i
            ids[n] = sid
            n += 1
            last = sid
    return n


@jit
def _kt_locate(
    index: U32, keys: U64, sets: U32, pos: U32, meta: I64, shift: np.uint64, limit: int,
    query: U64, out: I64, start: int, insert: bool,
) -> int:  # fmt: skip
    """Rows of ``query[start:]`` into ``out`` (-1 when absent and not ``insert``); a new key
    gets a row (free chain first) with set 0 and no position. Returns where it stopped:
    ``query.shape[0]``, or earlier when the index is full (``limit`` live entries) or rows ran
    out (the caller grows)."""
    for i in range(start, query.shape[0]):
        key = query[i]
        c = find(index, keys, key, shift)
        if c >= 0:
            out[i] = index[c]
            continue
        if not insert:
            out[i] = -1
            continue
        if meta[SIZE] >= limit or (meta[AUX] < 0 and meta[USED] >= keys.shape[0]):
            return i
        if meta[AUX] >= 0:
            r = meta[AUX]
            nxt = keys[r]
            if nxt == NIL:
                meta[AUX] = -1
            else:
                meta[AUX] = np.int64(nxt)
        else:
            r = meta[USED]
            meta[USED] += 1
        keys[r] = key
        sets[r] = 0
        pos[r] = NO_POS
        index[-c - 1] = r
        meta[SIZE] += 1
        out[i] = r
    return len(query)


@jit
def _kt_drop(index: U32, keys: U64, sets: U32, meta: I64, shift: np.uint64, rows: I64) -> int:
    """Delete the rows in ``rows`` whose set is 0 (nobody holds their key); a freed row joins the
    free chain (its key cell holds the next free row). A row named twice is freed once: the
    second time its (chain) value does not lead back to it. Returns the rows freed."""
    freed = 0
    for k in range(rows.shape[0]):
        r = rows[k]
        if r < 0 or sets[r] != 0:
            continue
        c = find(index, keys, keys[r], shift)
        if c < 0 or index[c] != r:
            continue
        delete_cell(index, keys, c, shift)
        if meta[AUX] < 0:
            keys[r] = NIL
        else:
            keys[r] = np.uint64(meta[AUX])
        meta[AUX] = r
        meta[SIZE] -= 1
        freed += 1
    return freed


@jit
def _kt_setpos(pos: U32, rows: I64, qpos: U32, mismatch: Bools) -> None:
    """Keep-first positions, in order: a row without a position takes ``qpos[i]``; a row with
    another position keeps it and ``mismatch[i]`` is set (a row named twice in one batch with
    two positions: the first wins)."""
    for i in range(rows.shape[0]):
        r = rows[i]
        p = pos[r]
        if p == NO_POS:
            pos[r] = qpos[i]
            mismatch[i] = False
        else:
            mismatch[i] = p != qpos[i]


# --- KeyTable ---------------------------------------------------------------------------------------


class KeyTable(Indexed):
    """kvcm key (``uint64``) -> holder-set id (``uint32``) and token position (``uint32``), for
    one ``(instance_id, lora)`` namespace. A row per key (``keys``, ``sets``, ``pos``).

    **Row numbers are stable for a key's lifetime**: a key keeps its row from insertion until it
    is deleted, whatever the table does meanwhile (index growth or shrinking, other keys'
    insertions and deletions). Rows of deleted keys are reused through a free chain threaded
    through their key cells; live rows are never renumbered, so a :class:`SourceMap` may store a
    ``uint32`` row instead of the 8-byte key, as long as it refers only to keys that live (in
    :class:`CompactTable`: keys that the map's slot holds). The cost: the row arrays never
    shrink while any key lives (freed rows wait for new keys); only the index shrinks, and a
    table that empties entirely starts over with small arrays.

    **Positions are per key, not per holding.** A kvcm key is, in the common case, the chained
    hash of every token id from the root, so one key has one position: the token count at its
    block's end (``EngineBlock.pos``). The first position given for a key is kept; another one
    given later (or later in the same batch) is refused and flagged (:meth:`insert_many`,
    :meth:`set_pos`), so the caller can count it and keep that block out of the compact
    structures. A key inserted without a position has none (:meth:`pos_of` gives -1) until one
    is set. A deleted and re-inserted key starts again without a position."""

    def __init__(self, capacity: int = 8) -> None:
        self.meta = np.array([0, 0, -1], dtype=np.int64)  # size, rows used, free chain head
        self._set_index(level_for(capacity))
        self.index = new_index(self.bits)
        self._new_rows(max(8, capacity))

    def _new_rows(self, capacity: int) -> None:
        self.keys: U64 = np.empty(capacity, dtype=np.uint64)
        self.sets: U32 = np.empty(capacity, dtype=np.uint32)
        self.pos: U32 = np.empty(capacity, dtype=np.uint32)

    def lookup_many(self, keys: Ints) -> U32:
        """The holder-set id of each key; 0 (the empty set) for a key nobody holds."""
        q = as_u64(keys)
        out = np.empty(len(q), dtype=np.uint32)
        _kt_lookup(self.index, self.keys, self.sets, self.shift, q, out)
        return out

    def stretches(self, keys: Ints) -> tuple[list[int], list[int]]:
        """The keys' set ids as stretches of one id: where each begins, and its id."""
        q = as_u64(keys)
        starts, ids = np.empty(len(q), dtype=np.int64), np.empty(len(q), dtype=np.uint32)
        n = _kt_stretches(self.index, self.keys, self.sets, self.shift, q, starts, ids)
        return starts[:n].tolist(), ids[:n].tolist()

    def locate_many(self, keys: Ints, insert: bool) -> I64:
        """The row of each key; a missing key gets a new row with set 0 and no position when
        ``insert``, else -1. A key named twice gets the same row twice."""
        q = as_u64(keys)
        out = np.empty(len(q), dtype=np.int64)
        at = 0
        while True:
            at = _kt_locate(
                self.index, self.keys, self.sets, self.pos, self.meta, self.shift, self.limit, q, out, at, insert
            )
            if at >= len(q):
                return out
            if len(self) >= self.limit:
                self._reindex(self.bits + 1)
            else:  # no free row left: the row arrays double (rows keep their numbers)
                used = int(self.meta[USED])
                cap = min(2 * len(self.keys), MAX_ROWS)
                if cap <= used:
                    raise OverflowError(f"more than {MAX_ROWS:,} keys in one KeyTable")
                self.keys = grown(self.keys, used, cap)
                self.sets = grown(self.sets, used, cap)
                self.pos = grown(self.pos, used, cap)

    def insert_many(
        self, keys: Ints, pos: Ints
    ) -> tuple[I64, Bools]:
        """:meth:`locate_many` with ``insert`` and each key's position (:meth:`set_pos`): the
        rows, and per key whether it already had another position (kept)."""
        rows = self.locate_many(keys, insert=True)
        return rows, self.set_pos(rows, pos)

    def set_pos(self, rows: I64, pos: Ints) -> Bools:
        """Give the keys of ``rows`` (live rows) their positions, keeping the first: a row that
        has another position keeps it and is flagged (returned ``True``)."""
        q = _as_pos(pos)
        if len(q) != len(rows):
            raise ValueError("rows and positions differ in length")
        mismatch = np.empty(len(rows), dtype=np.bool_)
        _kt_setpos(self.pos, rows, q, mismatch)
        return mismatch

    def pos_of(self, rows: I64) -> I64:
        """The position of the key of each (live) row; -1 where it has none."""
        out: I64 = self.pos[rows].astype(np.int64)
        out[out == int(NO_POS)] = -1
        return out

    def pos_many(self, keys: Ints) -> I64:
        """The position of each key; -1 for a key absent or without a position."""
        rows = self.locate_many(keys, insert=False)
        out = np.full(len(rows), -1, dtype=np.int64)
        found = rows >= 0
        out[found] = self.pos_of(rows[found])
        return out

    def drop_empty(self, rows: I64) -> int:
        """Delete the keys of ``rows`` whose set is 0; returns how many went."""
        freed = int(_kt_drop(self.index, self.keys, self.sets, self.meta, self.shift, rows))
        if freed:
            self._maybe_shrink()
        return freed

    def remove_many(self, keys: Ints) -> int:
        """Delete ``keys`` whatever their set (the caller releases their set references)."""
        rows = self.locate_many(keys, insert=False)
        rows = rows[rows >= 0]
        self.sets[rows] = 0
        return self.drop_empty(rows)

    def rows(self) -> I64:
        """Every live row (index order)."""
        rows: I64 = self.index[self.index != EMPTY].astype(np.int64)
        return rows

    def items(self) -> tuple[U64, U32]:
        """Every key and its set id (index order)."""
        rows = self.index[self.index != EMPTY]
        return self.keys[rows], self.sets[rows]

    def _reindex(self, bits: int) -> None:
        new = new_index(bits)
        reindex_cells(self.index, self.keys, new, np.uint64(cells_at(bits)))
        self.index = new
        self._set_index(bits)

    def _maybe_shrink(self) -> None:
        """After deletions: an index 4x larger than needed is halved to twice needed; the row
        arrays are kept (live rows keep their numbers) unless the table is empty."""
        size = len(self)
        if not size and int(self.meta[USED]) > 64:  # no live row: nobody refers to any
            self._new_rows(8)
            self.meta[USED], self.meta[AUX] = 0, -1
        bits = level_for(size)
        if bits + SHRINK_LEVELS <= self.bits:
            self._reindex(bits + 3)

    def nbytes(self) -> int:
        """Bytes of its arrays as allocated (rows never written are not resident: see
        :meth:`used_bytes`)."""
        return int(self.index.nbytes + self.keys.nbytes + self.sets.nbytes + self.pos.nbytes + self.meta.nbytes)

    def used_bytes(self) -> int:
        """Bytes of its index and of the rows written so far (what can be resident)."""
        return int(self.index.nbytes + int(self.meta[USED]) * (8 + 4 + 4))


def _as_pos(pos: Ints) -> U32:
    """Positions as ``uint32``; outside ``0 .. MAX_POS`` is refused."""
    arr = np.asarray(pos)
    if arr.dtype == np.uint32:
        if len(arr) and int(arr.max()) > MAX_POS:
            raise ValueError(f"a position above {MAX_POS}")
        return arr
    if len(arr) and (int(arr.min()) < 0 or int(arr.max()) > MAX_POS):
        raise ValueError(f"positions must be within 0 .. {MAX_POS}")
    return arr.astype(np.uint32)


