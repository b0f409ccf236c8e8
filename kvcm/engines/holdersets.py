"""HolderSets: interned sets of holder slots, reference counted, and the compiled batch holds and
releases that move keys between them through a generation-stamped transition cache."""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np

from kvcm.engines.flat import I64, NIL, U32, U64, Cell, grown, home, jit

# --- HolderSets kernels: the transition cache and batch holds/releases ------------------------------
# A transition is "set ``src`` with slot ``s`` added (or removed)" -> set ``dst``, keyed
# ``src << 21 | s << 1 | removed``. Each entry carries the generation of both ids when it was
# made: freeing an id bumps its generation, so every cached transition to or from it stops
# matching at once, without finding and deleting them (a stale entry is overwritten in place
# by the next miss on its key, or dropped when the cache is rebuilt).

_TR_SHIFT: np.uint64 = np.uint64(21)
_ONE: np.uint64 = np.uint64(1)
_MISS: np.int64 = np.int64(-1)
#: A batch kernel (:func:`_hs_hold`, :func:`_hs_release`): its arguments as ``HolderSets._batch``
#: passes them; returns where it stopped.
BatchKernel = Callable[[U32, I64, I64, I64, I64, U64, U32, U32, U32, np.uint64, int, I64, I64, I64], int]


@jit
def _tr_get(tkeys: U64, tvals: U32, tgens: U32, gen: U32, cells: np.uint64, src: Cell, code: np.uint64) -> np.int64:
    """The cached target of ``src`` stepped by ``code``, or -1 (absent or stale)."""
    key = (np.uint64(src) << _TR_SHIFT) | code
    n = tkeys.shape[0]
    c = home(key, cells)
    while True:
        k = tkeys[c]
        if k == NIL:
            return _MISS
        if k == key:
            t = tvals[c]
            if tgens[c, 0] == gen[src] and tgens[c, 1] == gen[t]:
                found: np.int64 = np.int64(t)
                return found
            return _MISS
        c += 1
        if c == n:
            c = 0


@jit
def _tr_put(tkeys: U64, tvals: U32, tgens: U32, gen: U32, cells: np.uint64, src: int, code: np.uint64, dst: int) -> int:
    """Cache ``src`` stepped by ``code`` -> ``dst`` at both ids' current generations; returns 1
    when a new cell was taken (0: an entry for the key was overwritten)."""
    key = (np.uint64(src) << _TR_SHIFT) | code
    n = tkeys.shape[0]
    c = home(key, cells)
    while tkeys[c] != NIL and tkeys[c] != key:
        c += 1
        if c == n:
            c = 0
    new = 1 if tkeys[c] == NIL else 0
    tkeys[c] = key
    tvals[c] = dst
    tgens[c, 0] = gen[src]
    tgens[c, 1] = gen[dst]
    return new


@jit
def _tr_rebuild(
    tkeys: U64, tvals: U32, tgens: U32, gen: U32, nkeys: U64, nvals: U32, ngens: U32, cells: np.uint64
) -> int:
    """The live (not stale) entries into the empty new arrays; returns how many."""
    kept = 0
    for c in range(tkeys.shape[0]):
        k = tkeys[c]
        if k == NIL:
            continue
        src = np.int64(k >> _TR_SHIFT)
        t = tvals[c]
        if tgens[c, 0] != gen[src] or tgens[c, 1] != gen[t]:
            continue
        d = home(k, cells)
        while nkeys[d] != NIL:
            d += 1
            if d == nkeys.shape[0]:
                d = 0
        nkeys[d] = k
        nvals[d] = t
        ngens[d, 0] = tgens[c, 0]
        ngens[d, 1] = tgens[c, 1]
        kept += 1
    return kept


@jit
def _hs_hold(
    col: U32, rows: I64, slots: I64, refs: I64, counts: I64, tkeys: U64, tvals: U32, tgens: U32,
    gen: U32, cells: np.uint64, start: int, dups: I64, zeros: I64, meta: I64,
) -> int:  # fmt: skip
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
    return len(rows)


@jit
def _hs_release(
    col: U32, rows: I64, slots: I64, refs: I64, counts: I64, tkeys: U64, tvals: U32, tgens: U32,
    gen: U32, cells: np.uint64, start: int, gone: I64, zeros: I64, meta: I64,
) -> int:  # fmt: skip
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
    return len(rows)


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
        self._tkeys: U64 = np.full(cells, NIL, dtype=np.uint64)
        self._tvals: U32 = np.zeros(cells, dtype=np.uint32)
        self._tgens: U32 = np.zeros((cells, 2), dtype=np.uint32)
        self._tcells = np.uint64(cells)
        self._tused = 0

    def __len__(self) -> int:
        """Live sets, the empty one included."""
        return len(self._ids)

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
                self.refs = grown(self.refs, sid, 2 * sid)
                self.refs[sid:] = 0
                self._gen = grown(self._gen, sid, 2 * sid)
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

    def _batch(self, kernel: BatchKernel, removed: bool, col: U32, rows: I64, slots: I64, counts: I64) -> I64:
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


