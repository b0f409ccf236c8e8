"""CompactTable: a namespace's keys and their holders in flat arrays, with the holding semantics
of :class:`~kvcm.engines.table.HolderTable` (which keeps its slots and defers to it).

The tables under it: :class:`~kvcm.engines.keytable.KeyTable` (key -> holder-set id and
position), :class:`~kvcm.engines.holdersets.HolderSets` (the interned sets and the compiled
batch holds and releases); per source, :class:`~kvcm.engines.sourcemap.SourceMap`
(:mod:`kvcm.engines.compacted`); their shared layout and kernels, :mod:`kvcm.engines.flat`.
Why and how: ``docs/compact-index.md``. Importing this module imports numba (about half a
second); the engine index imports it with its first table. Thread ownership: none; the engine
index's lock guards every call.
"""

from __future__ import annotations

import sys

import numpy as np

from kvcm.engines.flat import I64, U32, Bools, Ints, as_u64, to_signed_list
from kvcm.engines.holdersets import MAX_SLOTS, HolderSets
from kvcm.engines.keytable import KeyTable

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
        self, slot: int, keys: Ints, pos: Ints | None = None
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

    def hold_many(self, slots: I64, keys: Ints) -> I64:
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

    def release(self, slot: int, keys: Ints) -> None:
        """One holding less of each key by ``slot``; releases beyond its holdings do nothing."""
        q = as_u64(keys)
        if len(q):
            self._release_rows(np.full(len(q), slot, dtype=np.int64), self.keys.locate_many(q, insert=False))

    def release_many(self, slots: I64, keys: Ints) -> None:
        """One holding less of ``keys[i]`` by ``slots[i]`` each (beyond its holdings: nothing)."""
        q = as_u64(keys)
        if len(q):
            self._release_rows(np.asarray(slots, dtype=np.int64), self.keys.locate_many(q, insert=False))

    def release_rows(self, slot: int, rows: U32 | I64) -> None:
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

    def forget(self, slot: int, keys: Ints) -> None:
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

    def masks(self, keys: Ints) -> list[int]:
        """Each key's holder mask (0: nobody), as ``HolderTable.holders[key]``."""
        masks = self.sets.masks
        return [masks[i] for i in self.keys.lookup_many(keys).tolist()]

    def holders(self) -> dict[int, int]:
        """Every key (signed) and its holder mask: ``HolderTable.holders`` as a plain dict."""
        keys, ids = self.keys.items()
        masks = self.sets.masks
        return dict(zip(to_signed_list(keys), [masks[i] for i in ids.tolist()]))

    def runs(self, keys: Ints, allowed: int) -> list[tuple[int, int, int]]:
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


