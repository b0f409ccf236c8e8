"""Compact building blocks for the engine index: numpy tables with numba batch kernels.

The engine index (:mod:`kvcm.engines.index`) keeps, per source, a dict of ``EngineBlock``
structs and, per ``(instance_id, lora)`` namespace, a dict of holder masks
(:class:`~kvcm.engines.table.HolderTable`): about 300 bytes of RssAnon per (source, block)
holding (``scripts/bench_events --memory``). Python objects cannot go much lower (a dict slot
and a boxed int alone are ~100 bytes), so these structures hold the common case in flat arrays:

* :class:`KeyTable`, per namespace: kvcm key -> holder-set id (``uint32``) and the key's token
  position (``uint32``), in rows whose numbers stay the key's while it lives;
* :class:`HolderSets`, per namespace: holder-set id <-> set of holder slots (an int bit mask,
  as :class:`~kvcm.engines.table.HolderTable` uses), reference counted, with a transition cache
  so that holding or releasing one slot over a whole batch of keys is a vectorised map;
* :class:`SourceMap`, per (source, group): engine block hash -> the block's key's
  :class:`KeyTable` row (``uint32``), in insertion order (eviction takes the oldest);
* :class:`CompactTable` puts a namespace's :class:`KeyTable` and :class:`HolderSets` together
  with the per-slot counts and multiplicities of :class:`~kvcm.engines.table.HolderTable`: the
  drop-in shape the engine index will call (``docs/compact-index.md``).

Layout (both hash tables): a *dense* entry store (parallel arrays, one row per entry) plus a
sparse *index* of ``uint32`` row numbers, open addressing with linear probing, at most
:data:`MAX_LOAD` full, grown x2, deletion by backward shift (no tombstones: a long-lived table
under churn keeps its probe lengths). The index is what has to be mostly empty; keeping the
8-byte keys out of it costs 4 bytes per cell instead of 12-20, and rows of the dense store
that were never written are never touched, so they cost no resident memory (numpy allocates
large arrays with ``mmap``). The empty index cell is ``0xFFFFFFFF``, which no row number
reaches, so every ``uint64`` key (0 and 2**64 - 1 included) is a valid key.

kvcm keys are signed 64-bit ints in Python; here they are their ``uint64`` bit patterns
(:func:`as_u64`, :func:`to_signed_list`).

Importing this module imports numba (about half a second); the kernels are compiled on first
use and cached on disk beside this file where it is writable, as :mod:`kvcm.cache.hash_kernel`
does. Thread ownership: none; the engine index's lock guards every call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

import numba
import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]

#: Index fill at most (live entries / cells); past it the index doubles. Linear probing's
#: expected probes grow as 1/(1-load)^2 for a miss: 0.8 keeps a miss around 13 cells.
MAX_LOAD = 0.8
#: Index growth per size level: 1.25, not 2, so an index is never much emptier than
#: MAX_LOAD / GROWTH (0.64) — at doubling it drops to 0.4 full, 4 bytes a cell wasted per key.
GROWTH = 1.25
#: Levels between the size an index needs and one it shrinks from (1.25**7: about 4.8x).
_SHRINK_LEVELS = 7
_EMPTY = np.uint32(0xFFFFFFFF)  # an empty index cell (no row number reaches it)
_NIL = np.uint64(0xFFFFFFFFFFFFFFFF)  # end of KeyTable's free-row chain
_NO_POS = np.uint32(0xFFFFFFFF)  # a KeyTable row whose key's position is not known (yet)
#: Positions are token counts stored as ``uint32``: 0 .. MAX_POS (2**32 - 1 means unknown).
MAX_POS = 0xFFFFFFFE
#: KeyTable rows and SourceMap values are ``uint32`` (and 2**32 - 1 is the empty index cell).
MAX_ROWS = 0xFFFFFFFF
_C1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finaliser: keys need not be well mixed
_C2 = np.uint64(0x94D049BB133111EB)  # (Tair reporters name blocks by key; tests by counting)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
# meta[] fields shared with the kernels (a small int64 array they update in place)
_SIZE, _USED, _AUX = 0, 1, 2  # live entries, rows written (high-water mark), free head / eviction head

_F = TypeVar("_F", bound=Callable[..., Any])


def _jit(fn: _F) -> _F:
    """numba-compile ``fn``, cached beside this file (compiled at each start when read-only)."""
    try:
        return cast(_F, numba.njit(cache=True, nogil=True)(fn))
    except RuntimeError:
        return cast(_F, numba.njit(nogil=True)(fn))


# --- kernels: probing, backward-shift deletion, rebuilding ----------------------------------------


@_jit
def _home(key: Any, cells: Any) -> Any:
    """The key's home cell: its mix's top 32 bits scaled to the index's ``cells`` (any count:
    the index grows by :data:`GROWTH`, not by doubling)."""
    z = key
    z = (z ^ (z >> _S30)) * _C1
    z = (z ^ (z >> _S27)) * _C2
    z = z ^ (z >> _S31)
    return np.int64(((z >> _S32) * cells) >> _S32)


@_jit
def _find(index: Any, rows: Any, key: Any, shift: Any) -> Any:
    """The cell whose row holds ``key``, or ``-(empty cell) - 1`` where it would go."""
    n = index.shape[0]
    i = _home(key, shift)
    while True:
        r = index[i]
        if r == _EMPTY:
            return -i - 1
        if rows[r] == key:
            return i
        i += 1
        if i == n:
            i = 0


@_jit
def _delete_cell(index: Any, rows: Any, i: Any, shift: Any) -> None:
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
        if r == _EMPTY:
            break
        h = _home(rows[r], shift)
        if (j - h) % n >= (j - i) % n:  # its home is at or before the hole
            index[i] = r
            i = j
    index[i] = _EMPTY


@_jit
def _place(index: Any, rows: Any, r: Any, shift: Any) -> None:
    """Put row ``r`` (a key not in the index) into its first free cell from home."""
    n = index.shape[0]
    i = _home(rows[r], shift)
    while index[i] != _EMPTY:
        i += 1
        if i == n:
            i = 0
    index[i] = r


@_jit
def _reindex(old: Any, rows: Any, new: Any, shift: Any) -> None:
    """Every row of index ``old`` into the (empty) index ``new``."""
    for c in range(old.shape[0]):
        r = old[c]
        if r != _EMPTY:
            _place(new, rows, r, shift)


# --- KeyTable kernels ---------------------------------------------------------------------------


@_jit
def _kt_lookup(index: Any, keys: Any, sets: Any, shift: Any, query: Any, out: Any) -> None:
    for i in range(query.shape[0]):
        c = _find(index, keys, query[i], shift)
        if c >= 0:
            out[i] = sets[index[c]]
        else:
            out[i] = 0


@_jit
def _kt_stretches(index: Any, keys: Any, sets: Any, shift: Any, query: Any, starts: Any, ids: Any) -> Any:
    """The query's keys' set ids as stretches of one id: ``starts[j]`` is where stretch ``j``
    begins and ``ids[j]`` its id (0 for keys not held); returns how many stretches."""
    n = 0
    last = np.uint32(0)
    for i in range(query.shape[0]):
        c = _find(index, keys, query[i], shift)
        sid = sets[index[c]] if c >= 0 else np.uint32(0)
        if i == 0 or sid != last:
            starts[n] = i
            ids[n] = sid
            n += 1
            last = sid
    return n


@_jit
def _kt_locate(
    index: Any, keys: Any, sets: Any, pos: Any, meta: Any, shift: Any, limit: Any,
    query: Any, out: Any, start: Any, insert: Any,
) -> Any:  # fmt: skip
    """Rows of ``query[start:]`` into ``out`` (-1 when absent and not ``insert``); a new key
    gets a row (free chain first) with set 0 and no position. Returns where it stopped:
    ``query.shape[0]``, or earlier when the index is full (``limit`` live entries) or rows ran
    out (the caller grows)."""
    for i in range(start, query.shape[0]):
        key = query[i]
        c = _find(index, keys, key, shift)
        if c >= 0:
            out[i] = index[c]
            continue
        if not insert:
            out[i] = -1
            continue
        if meta[_SIZE] >= limit or (meta[_AUX] < 0 and meta[_USED] >= keys.shape[0]):
            return i
        if meta[_AUX] >= 0:
            r = meta[_AUX]
            nxt = keys[r]
            if nxt == _NIL:
                meta[_AUX] = -1
            else:
                meta[_AUX] = np.int64(nxt)
        else:
            r = meta[_USED]
            meta[_USED] += 1
        keys[r] = key
        sets[r] = 0
        pos[r] = _NO_POS
        index[-c - 1] = r
        meta[_SIZE] += 1
        out[i] = r
    return query.shape[0]


@_jit
def _kt_drop(index: Any, keys: Any, sets: Any, meta: Any, shift: Any, rows: Any) -> Any:
    """Delete the rows in ``rows`` whose set is 0 (nobody holds their key); a freed row joins the
    free chain (its key cell holds the next free row). A row named twice is freed once: the
    second time its (chain) value does not lead back to it. Returns the rows freed."""
    freed = 0
    for k in range(rows.shape[0]):
        r = rows[k]
        if r < 0 or sets[r] != 0:
            continue
        c = _find(index, keys, keys[r], shift)
        if c < 0 or index[c] != r:
            continue
        _delete_cell(index, keys, c, shift)
        if meta[_AUX] < 0:
            keys[r] = _NIL
        else:
            keys[r] = np.uint64(meta[_AUX])
        meta[_AUX] = r
        meta[_SIZE] -= 1
        freed += 1
    return freed


@_jit
def _kt_setpos(pos: Any, rows: Any, qpos: Any, mismatch: Any) -> None:
    """Keep-first positions, in order: a row without a position takes ``qpos[i]``; a row with
    another position keeps it and ``mismatch[i]`` is set (a row named twice in one batch with
    two positions: the first wins)."""
    for i in range(rows.shape[0]):
        r = rows[i]
        p = pos[r]
        if p == _NO_POS:
            pos[r] = qpos[i]
            mismatch[i] = False
        else:
            mismatch[i] = p != qpos[i]


# --- SourceMap kernels ---------------------------------------------------------------------------


@_jit
def _sm_insert(
    index: Any, hashes: Any, vals: Any, meta: Any, shift: Any, limit: Any,
    qh: Any, qv: Any, had: Any, old: Any, start: Any,
) -> Any:  # fmt: skip
    """Append ``(qh[i], qv[i])`` from ``start`` on, in order; a hash already present has its
    row abandoned (``had``, its value in ``old``) and the new row takes its cell: it becomes the
    newest. Stops early (returns where) when rows or the index are full."""
    for i in range(start, qh.shape[0]):
        c = _find(index, hashes, qh[i], shift)
        if meta[_USED] >= hashes.shape[0] or (c < 0 and meta[_SIZE] >= limit):
            return i
        r = meta[_USED]
        meta[_USED] += 1
        hashes[r] = qh[i]
        vals[r] = qv[i]
        if c >= 0:
            had[i] = True
            old[i] = vals[index[c]]
            index[c] = r
        else:
            had[i] = False
            index[-c - 1] = r
            meta[_SIZE] += 1
    return qh.shape[0]


@_jit
def _sm_get(index: Any, hashes: Any, vals: Any, shift: Any, qh: Any, found: Any, out: Any) -> None:
    for i in range(qh.shape[0]):
        c = _find(index, hashes, qh[i], shift)
        found[i] = c >= 0
        if c >= 0:  # two statements: a conditional expression of uint64 and int would be a float
            out[i] = vals[index[c]]
        else:
            out[i] = 0


@_jit
def _sm_any(index: Any, hashes: Any, shift: Any, qh: Any) -> Any:
    for i in range(qh.shape[0]):  # noqa: SIM110 (numba compiles no generator into any())
        if _find(index, hashes, qh[i], shift) >= 0:
            return True
    return False


@_jit
def _sm_remove(index: Any, hashes: Any, vals: Any, meta: Any, shift: Any, qh: Any, found: Any, out: Any) -> None:
    """Remove ``qh`` (in order: a hash named twice is found once); its row is abandoned."""
    for i in range(qh.shape[0]):
        c = _find(index, hashes, qh[i], shift)
        if c < 0:
            found[i] = False
            out[i] = 0
            continue
        found[i] = True
        out[i] = vals[index[c]]
        _delete_cell(index, hashes, c, shift)
        meta[_SIZE] -= 1


@_jit
def _sm_oldest(index: Any, hashes: Any, vals: Any, meta: Any, shift: Any, n: Any, out_h: Any, out_v: Any) -> Any:
    """Remove up to ``n`` live rows from the eviction head on, oldest first; returns how many. A
    row is live when its hash's cell points back at it (an abandoned row's hash leads elsewhere
    or nowhere), so liveness costs no memory."""
    p = meta[_AUX]
    k = 0
    while k < n and p < meta[_USED]:
        c = _find(index, hashes, hashes[p], shift)
        if c >= 0 and index[c] == p:
            out_h[k] = hashes[p]
            out_v[k] = vals[p]
            _delete_cell(index, hashes, c, shift)
            meta[_SIZE] -= 1
            k += 1
        p += 1
    meta[_AUX] = p
    return k


@_jit
def _sm_live(index: Any, used: Any) -> Any:
    live = np.zeros(used, dtype=np.bool_)
    for c in range(index.shape[0]):
        r = index[c]
        if r != _EMPTY:
            live[r] = True
    return live


@_jit
def _sm_pack(live: Any, hashes: Any, vals: Any, new_hashes: Any, new_vals: Any, new_index: Any, shift: Any) -> Any:
    """Copy the live rows, in order, to the front of the new arrays (which may be the old ones:
    rows only move down) and index them; returns how many."""
    w = 0
    for p in range(live.shape[0]):
        if live[p]:
            new_hashes[w] = hashes[p]
            new_vals[w] = vals[p]
            _place(new_index, new_hashes, w, shift)
            w += 1
    return w


# --- HolderSets kernels: the transition cache and batch holds/releases ------------------------------
# A transition is "set ``src`` with slot ``s`` added (or removed)" -> set ``dst``, keyed
# ``src << 21 | s << 1 | removed``. Each entry carries the generation of both ids when it was
# made: freeing an id bumps its generation, so every cached transition to or from it stops
# matching at once, without finding and deleting them (a stale entry is overwritten in place
# by the next miss on its key, or dropped when the cache is rebuilt).

_TR_SHIFT = np.uint64(21)
_ONE = np.uint64(1)
_MISS = np.int64(-1)


@_jit
def _tr_get(tkeys: Any, tvals: Any, tgens: Any, gen: Any, cells: Any, src: Any, code: Any) -> Any:
    """The cached target of ``src`` stepped by ``code``, or -1 (absent or stale)."""
    key = (np.uint64(src) << _TR_SHIFT) | code
    n = tkeys.shape[0]
    c = _home(key, cells)
    while True:
        k = tkeys[c]
        if k == _NIL:
            return _MISS
        if k == key:
            t = tvals[c]
            if tgens[c, 0] == gen[src] and tgens[c, 1] == gen[t]:
                return np.int64(t)
            return _MISS
        c += 1
        if c == n:
            c = 0


@_jit
def _tr_put(tkeys: Any, tvals: Any, tgens: Any, gen: Any, cells: Any, src: Any, code: Any, dst: Any) -> Any:
    """Cache ``src`` stepped by ``code`` -> ``dst`` at both ids' current generations; returns 1
    when a new cell was taken (0: an entry for the key was overwritten)."""
    key = (np.uint64(src) << _TR_SHIFT) | code
    n = tkeys.shape[0]
    c = _home(key, cells)
    while tkeys[c] != _NIL and tkeys[c] != key:
        c += 1
        if c == n:
            c = 0
    new = 1 if tkeys[c] == _NIL else 0
    tkeys[c] = key
    tvals[c] = dst
    tgens[c, 0] = gen[src]
    tgens[c, 1] = gen[dst]
    return new


@_jit
def _tr_rebuild(tkeys: Any, tvals: Any, tgens: Any, gen: Any, nkeys: Any, nvals: Any, ngens: Any, cells: Any) -> Any:
    """The live (not stale) entries into the empty new arrays; returns how many."""
    kept = 0
    for c in range(tkeys.shape[0]):
        k = tkeys[c]
        if k == _NIL:
            continue
        src = np.int64(k >> _TR_SHIFT)
        t = tvals[c]
        if tgens[c, 0] != gen[src] or tgens[c, 1] != gen[t]:
            continue
        d = _home(k, cells)
        while nkeys[d] != _NIL:
            d += 1
            if d == nkeys.shape[0]:
                d = 0
        nkeys[d] = k
        nvals[d] = t
        ngens[d, 0] = tgens[c, 0]
        ngens[d, 1] = tgens[c, 1]
        kept += 1
    return kept


@_jit
def _hs_hold(
    col: Any, rows: Any, slots: Any, refs: Any, counts: Any, tkeys: Any, tvals: Any, tgens: Any,
    gen: Any, cells: Any, start: Any, dups: Any, zeros: Any, meta: Any,
) -> Any:  # fmt: skip
    """One holding of key row ``rows[i]`` by slot ``slots[i]``, from ``start`` on, in order:
    the row's set id in ``col`` moves to the set with the slot added, references moving with
    it; a slot already in the set is a holding beyond the first (its index into ``dups``).
    Sets whose references reach 0 go to ``zeros`` (they may be taken again later in the batch:
    the caller frees those still at 0). Returns where a transition was not cached (the caller
    computes it and calls again from there), or ``len(rows)``. ``meta``: [dups, zeros] used."""
    for i in range(start, rows.shape[0]):
        r = rows[i]
        s = slots[i]
        cur = col[r]
        t = _tr_get(tkeys, tvals, tgens, gen, cells, cur, np.uint64(s) << _ONE)
        if t < 0:
            return i
        if t == cur:
            dups[meta[0]] = i
            meta[0] += 1
            continue
        col[r] = t
        refs[t] += 1
        if cur != 0:
            refs[cur] -= 1
            if refs[cur] == 0:
                zeros[meta[1]] = cur
                meta[1] += 1
        counts[s] += 1
    return rows.shape[0]


@_jit
def _hs_release(
    col: Any, rows: Any, slots: Any, refs: Any, counts: Any, tkeys: Any, tvals: Any, tgens: Any,
    gen: Any, cells: Any, start: Any, gone: Any, zeros: Any, meta: Any,
) -> Any:  # fmt: skip
    """:func:`_hs_hold`'s reverse: slot ``slots[i]`` leaves the set of row ``rows[i]`` (negative
    rows and slots not in the set are skipped); a row left with the empty set goes to ``gone``.
    ``meta``: [gone, zeros] used."""
    for i in range(start, rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        s = slots[i]
        cur = col[r]
        t = _tr_get(tkeys, tvals, tgens, gen, cells, cur, (np.uint64(s) << _ONE) | _ONE)
        if t < 0:
            return i
        if t == cur:
            continue
        col[r] = t
        if t != 0:
            refs[t] += 1
        else:
            gone[meta[0]] = r
            meta[0] += 1
        refs[cur] -= 1
        if refs[cur] == 0:
            zeros[meta[1]] = cur
            meta[1] += 1
        counts[s] -= 1
    return rows.shape[0]


# --- helpers ---------------------------------------------------------------------------------------


def as_u64(keys: Sequence[int] | npt.NDArray[Any], unsigned: bool = False) -> U64:
    """kvcm keys (signed 64-bit ints, or any ints mod 2**64) as a ``uint64`` array; tried first
    as ``unsigned`` says they are (engine block hashes are; kvcm keys are signed): a failed
    conversion costs as much as a good one."""
    if isinstance(keys, np.ndarray):
        if keys.dtype == np.uint64:
            return keys
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


def _cells(level: int) -> int:
    """Index cells at size ``level``: 8, then :data:`GROWTH` times more each level."""
    return max(8, int(8 * GROWTH**level))


def _bits_for(n: int) -> int:
    """The smallest index size level holding ``n`` live entries within :data:`MAX_LOAD`."""
    level = 0
    while n > MAX_LOAD * _cells(level):
        level += 1
    return level


def _new_index(level: int) -> U32:
    return np.full(_cells(level), _EMPTY, dtype=np.uint32)


def _grown(arr: npt.NDArray[Any], used: int, capacity: int) -> npt.NDArray[Any]:
    """``arr``'s first ``used`` rows in a new array of ``capacity`` rows; the rest is left
    unwritten (untouched pages of a large array are not resident)."""
    out = np.empty(capacity, dtype=arr.dtype)
    out[:used] = arr[:used]
    return out


class _Indexed:
    """The index half shared by :class:`KeyTable` and :class:`SourceMap`."""

    index: U32
    meta: I64

    def _set_index(self, bits: int) -> None:
        self.bits = bits  # the index's size level (:func:`_cells`)
        self.shift = np.uint64(_cells(bits))  # what the kernels scale a mix by (their ``shift``)
        self.limit = int(MAX_LOAD * _cells(bits))

    def __len__(self) -> int:
        return int(self.meta[_SIZE])

    @property
    def capacity(self) -> int:
        """Index cells."""
        return _cells(self.bits)


# --- KeyTable ---------------------------------------------------------------------------------------


class KeyTable(_Indexed):
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
        self._set_index(_bits_for(capacity))
        self.index = _new_index(self.bits)
        self._new_rows(max(8, capacity))

    def _new_rows(self, capacity: int) -> None:
        self.keys: U64 = np.empty(capacity, dtype=np.uint64)
        self.sets: U32 = np.empty(capacity, dtype=np.uint32)
        self.pos: U32 = np.empty(capacity, dtype=np.uint32)

    def lookup_many(self, keys: Sequence[int] | npt.NDArray[Any]) -> U32:
        """The holder-set id of each key; 0 (the empty set) for a key nobody holds."""
        q = as_u64(keys)
        out = np.empty(len(q), dtype=np.uint32)
        _kt_lookup(self.index, self.keys, self.sets, self.shift, q, out)
        return out

    def stretches(self, keys: Sequence[int] | npt.NDArray[Any]) -> tuple[list[int], list[int]]:
        """The keys' set ids as stretches of one id: where each begins, and its id."""
        q = as_u64(keys)
        starts, ids = np.empty(len(q), dtype=np.int64), np.empty(len(q), dtype=np.uint32)
        n = _kt_stretches(self.index, self.keys, self.sets, self.shift, q, starts, ids)
        return starts[:n].tolist(), ids[:n].tolist()

    def locate_many(self, keys: Sequence[int] | npt.NDArray[Any], insert: bool) -> I64:
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
                used = int(self.meta[_USED])
                cap = min(2 * len(self.keys), MAX_ROWS)
                if cap <= used:
                    raise OverflowError(f"more than {MAX_ROWS:,} keys in one KeyTable")
                self.keys = _grown(self.keys, used, cap)
                self.sets = _grown(self.sets, used, cap)
                self.pos = _grown(self.pos, used, cap)

    def insert_many(
        self, keys: Sequence[int] | npt.NDArray[Any], pos: Sequence[int] | npt.NDArray[Any]
    ) -> tuple[I64, Bools]:
        """:meth:`locate_many` with ``insert`` and each key's position (:meth:`set_pos`): the
        rows, and per key whether it already had another position (kept)."""
        rows = self.locate_many(keys, insert=True)
        return rows, self.set_pos(rows, pos)

    def set_pos(self, rows: I64, pos: Sequence[int] | npt.NDArray[Any]) -> Bools:
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
        out[out == int(_NO_POS)] = -1
        return out

    def pos_many(self, keys: Sequence[int] | npt.NDArray[Any]) -> I64:
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

    def remove_many(self, keys: Sequence[int] | npt.NDArray[Any]) -> int:
        """Delete ``keys`` whatever their set (the caller releases their set references)."""
        rows = self.locate_many(keys, insert=False)
        rows = rows[rows >= 0]
        self.sets[rows] = 0
        return self.drop_empty(rows)

    def rows(self) -> I64:
        """Every live row (index order)."""
        rows: I64 = self.index[self.index != _EMPTY].astype(np.int64)
        return rows

    def items(self) -> tuple[U64, U32]:
        """Every key and its set id (index order)."""
        rows = self.index[self.index != _EMPTY]
        return self.keys[rows], self.sets[rows]

    def _reindex(self, bits: int) -> None:
        new = _new_index(bits)
        _reindex(self.index, self.keys, new, np.uint64(_cells(bits)))
        self.index = new
        self._set_index(bits)

    def _maybe_shrink(self) -> None:
        """After deletions: an index 4x larger than needed is halved to twice needed; the row
        arrays are kept (live rows keep their numbers) unless the table is empty."""
        size = len(self)
        if not size and int(self.meta[_USED]) > 64:  # no live row: nobody refers to any
            self._new_rows(8)
            self.meta[_USED], self.meta[_AUX] = 0, -1
        bits = _bits_for(size)
        if bits + _SHRINK_LEVELS <= self.bits:
            self._reindex(bits + 3)

    def nbytes(self) -> int:
        """Bytes of its arrays as allocated (rows never written are not resident: see
        :meth:`used_bytes`)."""
        return int(self.index.nbytes + self.keys.nbytes + self.sets.nbytes + self.pos.nbytes + self.meta.nbytes)

    def used_bytes(self) -> int:
        """Bytes of its index and of the rows written so far (what can be resident)."""
        return int(self.index.nbytes + int(self.meta[_USED]) * (8 + 4 + 4))


def _as_pos(pos: Sequence[int] | npt.NDArray[Any]) -> U32:
    """Positions as ``uint32``; outside ``0 .. MAX_POS`` is refused."""
    arr = np.asarray(pos)
    if arr.dtype == np.uint32:
        if len(arr) and int(arr.max()) > MAX_POS:
            raise ValueError(f"a position above {MAX_POS}")
        return arr
    if len(arr) and (int(arr.min()) < 0 or int(arr.max()) > MAX_POS):
        raise ValueError(f"positions must be within 0 .. {MAX_POS}")
    return arr.astype(np.uint32)


# --- HolderSets -------------------------------------------------------------------------------------


#: Slot ids a holder set can name: a cached transition's key keeps 20 bits for the slot.
MAX_SLOTS = 1 << 20
_TR_MIN = 64  # transition cache cells at least


class HolderSets:
    """Interned sets of holder slots (:class:`~kvcm.engines.table.HolderTable` slot ids) <->
    ``uint32`` ids, for one namespace. Engines share prefixes, so millions of keys share a few
    thousand distinct holder sets: a key stores 4 bytes and the set's mask lives once.

    * id 0 is the empty set, always there, not counted;
    * ``refs[id]``: keys whose set it is; at 0 the id is freed (its generation bumped) and reused;
    * ``masks[id]``: the set as an int bit mask (bit ``s`` for slot ``s``), the form the
      existing query code (``runs``, ``longest_prefixes``, hybrid answers) works on;
    * a transition cache ``(id, +slot) -> id`` and ``(id, -slot) -> id`` the batch kernels read
      (:meth:`hold`, :meth:`release`): a miss is computed here (:meth:`step`), once per
      distinct (set, slot) pair, so a batch over many keys runs almost entirely compiled."""

    def __init__(self) -> None:
        self.masks: list[int] = [0]
        self.refs: I64 = np.zeros(8, dtype=np.int64)
        self._gen: U32 = np.zeros(8, dtype=np.uint32)
        self._ids: dict[int, int] = {0: 0}  # mask -> id
        self._free: list[int] = []
        self._new_cache(_TR_MIN)

    def _new_cache(self, cells: int) -> None:
        self._tkeys: U64 = np.full(cells, _NIL, dtype=np.uint64)
        self._tvals: U32 = np.zeros(cells, dtype=np.uint32)
        self._tgens: U32 = np.zeros((cells, 2), dtype=np.uint32)
        self._tcells = np.uint64(cells)
        self._tused = 0

    def __len__(self) -> int:
        """Live sets, the empty one included."""
        return len(self._ids)

    def id_of(self, mask: int) -> int | None:
        return self._ids.get(mask)

    def slots(self, sid: int) -> frozenset[int]:
        mask, out = self.masks[sid], []
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return frozenset(out)

    def step(self, sid: int, slot: int, removed: bool) -> int:
        """The id of set ``sid`` with ``slot`` added (or removed), interned (no reference yet)
        if new, and cached for the kernels."""
        if not 0 <= slot < MAX_SLOTS:
            raise ValueError(f"slot {slot} outside 0 .. {MAX_SLOTS - 1}")
        mask = self.masks[sid]
        target = self._intern(mask & ~(1 << slot) if removed else mask | (1 << slot))
        if 2 * (self._tused + 1) > len(self._tkeys):
            self._rebuild_cache()
        code = np.uint64(slot << 1 | removed)
        self._tused += _tr_put(self._tkeys, self._tvals, self._tgens, self._gen, self._tcells, sid, code, target)
        return target

    def _rebuild_cache(self) -> None:
        """Drop stale transitions; double the cache if over a quarter of it is still live."""
        old = self._tkeys, self._tvals, self._tgens
        for cells in (len(old[0]), 2 * len(old[0])):
            self._new_cache(cells)
            self._tused = _tr_rebuild(*old, self._gen, self._tkeys, self._tvals, self._tgens, self._tcells)
            if 4 * self._tused <= cells:
                return

    def _intern(self, mask: int) -> int:
        found = self._ids.get(mask)
        if found is not None:
            return found
        if self._free:
            sid = self._free.pop()
            self.masks[sid] = mask
        else:
            sid = len(self.masks)
            if sid > 0xFFFFFFFE:
                raise OverflowError("more than 2**32 - 1 holder sets")
            self.masks.append(mask)
            if sid >= len(self.refs):
                self.refs = _grown(self.refs, sid, 2 * sid)
                self.refs[sid:] = 0
                self._gen = _grown(self._gen, sid, 2 * sid)
                self._gen[sid:] = 0
        self._ids[mask] = sid
        return sid

    def _free_unreferenced(self, ids: I64) -> None:
        """Free the sets among ``ids`` left without a key (a set can reach 0 and be taken again
        within one batch, and be named more than once)."""
        refs, masks, live = self.refs, self.masks, self._ids
        for sid in set(ids.tolist()):
            if not refs[sid] and live.get(masks[sid]) == sid:
                del live[masks[sid]]
                masks[sid] = 0
                self._gen[sid] += 1  # every cached transition to or from it is stale now
                self._free.append(sid)

    def hold(self, col: U32, rows: I64, slots: I64, counts: I64) -> I64:
        """Slot ``slots[i]`` joins the set of row ``rows[i]`` (``col`` is the rows' set-id column,
        updated in place; ``counts`` per slot, updated). Returns the indices of holdings beyond
        the first (the slot was already in the set)."""
        return self._batch(_hs_hold, False, col, rows, slots, counts)

    def release(self, col: U32, rows: I64, slots: I64, counts: I64) -> I64:
        """Slot ``slots[i]`` leaves the set of row ``rows[i]`` (negative rows and slots not in the
        set: nothing). Returns the rows left with the empty set."""
        return self._batch(_hs_release, True, col, rows, slots, counts)

    def _batch(self, kernel: Callable[..., Any], removed: bool, col: U32, rows: I64, slots: I64, counts: I64) -> I64:
        """Run ``kernel`` over the batch, computing each transition it misses; the sets left
        without a key are freed at the end. Returns the kernel's first output."""
        n = len(rows)
        out, zeros, meta = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), np.zeros(2, dtype=np.int64)
        i = 0
        while True:
            i = kernel(col, rows, slots, self.refs, counts, self._tkeys, self._tvals, self._tgens,
                       self._gen, self._tcells, i, out, zeros, meta)  # fmt: skip
            if i == n:
                break
            self.step(int(col[rows[i]]), int(slots[i]), removed)
        self._free_unreferenced(zeros[: meta[1]])
        return out[: meta[0]]

    def nbytes(self) -> int:
        """Approximate bytes of its arrays and Python objects."""
        size = sys.getsizeof(self.masks) + sys.getsizeof(self._ids) + sys.getsizeof(self._free)
        size += sum(map(sys.getsizeof, self.masks)) + self.refs.nbytes + self._gen.nbytes
        return size + self._tkeys.nbytes + self._tvals.nbytes + self._tgens.nbytes


# --- CompactTable -------------------------------------------------------------------------------------


class CompactTable:
    """A namespace's keys and their holders: :class:`KeyTable` + :class:`HolderSets`, with
    :class:`~kvcm.engines.table.HolderTable`'s holding semantics (slot ids are allocated by
    whoever owns the slots, as ``HolderTable.slot`` does):

    * a slot's first holding of a key is its bit in the key's set; further holdings of the same
      key by the same slot are counted in ``extra[slot][key]`` (rare: duplicate stores);
    * :meth:`count`: distinct keys a slot holds;
    * a key whose set becomes empty leaves the :class:`KeyTable`;
    * holds return the keys' :class:`KeyTable` rows, which stay theirs while any slot holds
      them: a :class:`SourceMap` stores them, and :meth:`release_rows` releases by them;
    * positions (token count at a key's block end) are the key's, kept from the first hold
      that gives one (:meth:`KeyTable.set_pos`).

    Batches name a slot per key (:meth:`hold_many`, :meth:`release_many`), so one call covers
    every slot a wake-up touched."""

    def __init__(self, capacity: int = 8) -> None:
        self.keys = KeyTable(capacity)
        self.sets = HolderSets()
        self.extra: dict[int, dict[int, int]] = {}  # slot -> signed key -> holdings beyond the first
        self._counts: I64 = np.zeros(8, dtype=np.int64)  # slot -> distinct keys held

    @property
    def counts(self) -> dict[int, int]:
        """Slot -> distinct keys held, for the slots holding any."""
        held = np.flatnonzero(self._counts)
        return dict(zip(held.tolist(), self._counts[held].tolist()))

    def _fit(self, slots: I64) -> None:
        top = int(slots.max()) if len(slots) else 0
        if len(slots) and (top >= MAX_SLOTS or int(slots.min()) < 0):
            raise ValueError(f"slots must be within 0 .. {MAX_SLOTS - 1}")
        if top >= len(self._counts):
            grown = np.zeros(max(top + 1, 2 * len(self._counts)), dtype=np.int64)
            grown[: len(self._counts)] = self._counts
            self._counts = grown

    def hold(
        self, slot: int, keys: Sequence[int] | npt.NDArray[Any], pos: Sequence[int] | npt.NDArray[Any] | None = None
    ) -> tuple[I64, Bools]:
        """One more holding of each key (a key named twice is held twice) by ``slot``, each key
        given its position if ``pos`` (kept from the first). Returns each key's row (stable
        while the key is held by anyone) and whether it had another position (the caller counts
        those, and keeps such blocks out of the compact maps: their position is not the key's)."""
        q = as_u64(keys)
        if not len(q):
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.bool_)
        rows = self.keys.locate_many(q, insert=True)
        mismatch = np.zeros(len(q), dtype=np.bool_) if pos is None else self.keys.set_pos(rows, pos)
        self._hold_rows(np.full(len(q), slot, dtype=np.int64), rows)
        return rows, mismatch

    def hold_many(self, slots: I64, keys: Sequence[int] | npt.NDArray[Any]) -> I64:
        """One more holding of ``keys[i]`` by ``slots[i]`` each; returns the keys' rows."""
        q = as_u64(keys)
        rows = self.keys.locate_many(q, insert=True)
        if len(q):
            self._hold_rows(np.asarray(slots, dtype=np.int64), rows)
        return rows

    def _hold_rows(self, slots: I64, rows: I64) -> None:
        self._fit(slots)
        dups = self.sets.hold(self.keys.sets, rows, slots, self._counts)
        if len(dups):
            for slot, key in zip(slots[dups].tolist(), to_signed_list(self.keys.keys[rows[dups]])):
                extra = self.extra.setdefault(slot, {})
                extra[key] = extra.get(key, 0) + 1

    def release(self, slot: int, keys: Sequence[int] | npt.NDArray[Any]) -> None:
        """One holding less of each key by ``slot``; releases beyond its holdings do nothing."""
        q = as_u64(keys)
        if len(q):
            self._release_rows(np.full(len(q), slot, dtype=np.int64), self.keys.locate_many(q, insert=False))

    def release_many(self, slots: I64, keys: Sequence[int] | npt.NDArray[Any]) -> None:
        """One holding less of ``keys[i]`` by ``slots[i]`` each (beyond its holdings: nothing)."""
        q = as_u64(keys)
        if len(q):
            self._release_rows(np.asarray(slots, dtype=np.int64), self.keys.locate_many(q, insert=False))

    def release_rows(self, slot: int, rows: npt.NDArray[Any]) -> None:
        """:meth:`release` of the keys of ``rows`` (as :meth:`hold` returned them; negative
        rows are skipped). A row must name a key ``slot`` holds (or held: releases beyond its
        holdings do nothing); a row freed meanwhile and reused by another key would release
        that key, which the :class:`SourceMap` bookkeeping rules out (an entry is a holding)."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows):
            self._release_rows(np.full(len(rows), slot, dtype=np.int64), rows)

    def _release_rows(self, slots: I64, rows: I64) -> None:
        self._fit(slots)
        if self.extra:
            rows = self._take_extra(slots, rows)
        gone = self.sets.release(self.keys.sets, rows, slots, self._counts)
        if len(gone):
            self.keys.drop_empty(gone)

    def _take_extra(self, slots: I64, rows: I64) -> I64:
        """Releases a slot's holdings beyond the first absorb (in any order: the bit goes with
        the last holding whatever the order); the rest, with absorbed rows set to -1."""
        at = np.flatnonzero(np.isin(slots, list(self.extra)) & (rows >= 0))
        if not len(at):
            return rows
        rows = rows.copy()
        for i, slot, key in zip(at.tolist(), slots[at].tolist(), to_signed_list(self.keys.keys[rows[at]])):
            extra = self.extra.get(slot)
            more = extra.get(key) if extra else None
            if not more:
                continue
            rows[i] = -1
            if more > 1:
                extra[key] = more - 1  # type: ignore[index]
                continue
            del extra[key]  # type: ignore[union-attr]
            if not extra:
                del self.extra[slot]
        return rows

    def forget(self, slot: int, keys: Sequence[int] | npt.NDArray[Any]) -> None:
        """Every holding of ``keys`` by ``slot`` goes (its slot is about to be dropped)."""
        q = as_u64(keys)
        extra = self.extra.get(slot)
        if extra:
            for key in to_signed_list(q):
                extra.pop(key, None)
            if not extra:
                del self.extra[slot]
        if len(q):
            self._release_rows(np.full(len(q), slot, dtype=np.int64), self.keys.locate_many(q, insert=False))

    def count(self, slot: int) -> int:
        """Distinct keys the slot holds."""
        return int(self._counts[slot]) if 0 <= slot < len(self._counts) else 0

    def masks(self, keys: Sequence[int] | npt.NDArray[Any]) -> list[int]:
        """Each key's holder mask (0: nobody), as ``HolderTable.holders[key]``."""
        masks = self.sets.masks
        return [masks[i] for i in self.keys.lookup_many(keys).tolist()]

    def holders(self) -> dict[int, int]:
        """Every key (signed) and its holder mask: ``HolderTable.holders`` as a plain dict."""
        keys, ids = self.keys.items()
        masks = self.sets.masks
        return dict(zip(to_signed_list(keys), [masks[i] for i in ids.tolist()]))

    def runs(self, keys: Sequence[int] | npt.NDArray[Any], allowed: int) -> list[tuple[int, int, int]]:
        """:meth:`HolderTable.runs <kvcm.engines.table.HolderTable.runs>` on set ids: one kernel
        call looks the keys up and cuts them into stretches of one set id; Python then runs once
        per stretch (about one per slot when engines hold contiguous prefixes), each stretch's
        mask read once."""
        found: list[tuple[int, int, int]] = []
        if not allowed or not len(keys):
            return found
        starts, ids = self.keys.stretches(keys)
        masks = self.sets.masks
        running = masks[ids[0]] & allowed
        if not running:
            return found
        for start, sid in zip(starts[1:], ids[1:]):
            kept = running & masks[sid]
            if kept != running:
                found.append((start, running, kept))
                if not kept:
                    return found
                running = kept
        found.append((len(keys), running, 0))
        return found

    def nbytes(self) -> int:
        extra = sum(sys.getsizeof(d) for d in self.extra.values()) + sys.getsizeof(self.extra)
        return self.keys.nbytes() + self.sets.nbytes() + extra + self._counts.nbytes


# --- SourceMap ------------------------------------------------------------------------------------------


class SourceMap(_Indexed):
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
        self._set_index(_bits_for(capacity))
        self.index = _new_index(self.bits)
        self.hashes: U64 = np.empty(max(8, capacity), dtype=np.uint64)
        self.rows: U32 = np.empty(max(8, capacity), dtype=np.uint32)

    def insert_many(
        self, hashes: Sequence[int] | npt.NDArray[Any], rows: Sequence[int] | npt.NDArray[Any]
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
            if int(self.meta[_USED]) >= len(self.hashes):
                self._make_rows(len(qh) - at)
            else:
                self._reindex(self.bits + 1)
        self._maybe_compact()
        return had, old

    def get_many(self, hashes: Sequence[int] | npt.NDArray[Any]) -> tuple[Bools, U32]:
        """Per hash: whether present, and its row (0 where not)."""
        qh = as_u64(hashes, unsigned=True)
        found = np.empty(len(qh), dtype=np.bool_)
        out = np.empty(len(qh), dtype=np.uint32)
        _sm_get(self.index, self.hashes, self.rows, self.shift, qh, found, out)
        return found, out

    def any_of(self, hashes: Sequence[int] | npt.NDArray[Any]) -> bool:
        """Whether any of ``hashes`` is present."""
        return bool(len(self)) and bool(_sm_any(self.index, self.hashes, self.shift, as_u64(hashes, unsigned=True)))

    def remove_many(self, hashes: Sequence[int] | npt.NDArray[Any]) -> tuple[Bools, U32]:
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
        used = int(self.meta[_USED])
        live = _sm_live(self.index, used)
        return self.hashes[:used][live], self.rows[:used][live]

    def _reindex(self, bits: int) -> None:
        new = _new_index(bits)
        _reindex(self.index, self.hashes, new, np.uint64(_cells(bits)))
        self.index = new
        self._set_index(bits)

    def _make_rows(self, wanted: int) -> None:
        """Room for more rows: pack the abandoned ones away when they are a quarter of the rows,
        else grow the row arrays by a quarter (at least ``wanted`` rows)."""
        used, size = int(self.meta[_USED]), len(self)
        if used - size >= max(wanted, used // 4):
            self._pack(len(self.hashes))
        else:  # x1.25: a map's arrays come from the malloc heap, where the unwritten tail of a
            # new array may be pages an earlier freed array touched (resident though unused)
            cap = len(self.hashes) + max(wanted, len(self.hashes) // 4, 8)
            self.hashes, self.rows = _grown(self.hashes, used, cap), _grown(self.rows, used, cap)

    def _maybe_compact(self) -> None:
        used, size = int(self.meta[_USED]), len(self)
        if used - size > 64 + size // 4:
            cap = len(self.hashes)
            self._pack(max(8, 2 * size) if cap > 4 * max(size, 8) else cap)

    def _pack(self, capacity: int) -> None:
        """Live rows to the front, in order, into arrays of ``capacity`` rows (the same arrays if
        their size), and a fresh index (smaller when the map shrank)."""
        used, size = int(self.meta[_USED]), len(self)
        live = _sm_live(self.index, used)
        bits = self.bits
        needed = _bits_for(size)
        if needed + _SHRINK_LEVELS <= bits:
            bits = needed + 3
        index = _new_index(bits)
        if capacity == len(self.hashes):
            hashes, rows = self.hashes, self.rows
        else:
            hashes, rows = np.empty(capacity, dtype=np.uint64), np.empty(capacity, dtype=np.uint32)
        _sm_pack(live, self.hashes, self.rows, hashes, rows, index, np.uint64(_cells(bits)))
        self.hashes, self.rows, self.index = hashes, rows, index
        self._set_index(bits)
        self.meta[_USED], self.meta[_AUX] = size, 0

    def nbytes(self) -> int:
        """Bytes of its arrays as allocated (see :meth:`used_bytes`)."""
        return int(self.index.nbytes + self.hashes.nbytes + self.rows.nbytes + self.meta.nbytes)

    def used_bytes(self) -> int:
        """Bytes of its index and of the rows written so far (what can be resident)."""
        return int(self.index.nbytes + int(self.meta[_USED]) * (8 + 4))


def _as_rows(rows: Sequence[int] | npt.NDArray[Any]) -> U32:
    """KeyTable rows as ``uint32``; a negative row (not found) is refused."""
    arr = np.asarray(rows)
    if arr.dtype == np.uint32:
        return arr
    if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= MAX_ROWS):
        raise ValueError("a row outside 0 .. 2**32 - 2 (a key not found?)")
    return arr.astype(np.uint32)


def holdings_of(maps: Iterable[SourceMap]) -> int:
    """Entries of the maps together (the bench's holdings)."""
    return sum(map(len, maps))
