"""A source's common blocks, moved out of its dict of ``EngineBlock`` s into compact maps.

A source's dict (``SourceState.blocks``) is the write buffer: every store, remove and re-report
works on ``EngineBlock`` s there, as it always did. At a flush, once the blocks are persisted,
its *common* blocks move here (:meth:`CompactBlocks.migrate`): one kvcm key whose chain state is
the key itself, the namespace's default adapter, held once on the source's primary medium. Here
such a block costs a :class:`~kvcm.engines.sourcemap.SourceMap` entry (its engine hash and the row
of its key in the namespace's :class:`~kvcm.engines.keytable.KeyTable`, where the key's position
lives) instead of a struct, a tuple, a dict entry and three ints.

Reading one back builds the ``EngineBlock`` it was (:meth:`CompactBlocks.get`); a block about to
change is *taken* back into the dict first (:meth:`CompactBlocks.take`), so every change keeps
working on structs. Everything here is older than everything in the dict, so eviction takes the
oldest from here first (:meth:`CompactBlocks.oldest`).

An entry is one holding of its key by the source's ``(primary medium, group)`` slot: the key's
``KeyTable`` row lives as long as that holding, which is released only together with the entry
(taken back, removed, evicted or cleared)."""

from __future__ import annotations

from itertools import compress, repeat
from operator import and_, attrgetter, eq, is_

import numpy as np
import numpy.typing as npt

from kvcm.engines.entries import M64, EngineBlock, Fresh
from kvcm.engines.flat import U32, to_signed_list
from kvcm.engines.keytable import KeyTable
from kvcm.engines.sourcemap import SourceMap

#: Positions above this do not fit a KeyTable's position column: such blocks stay in the dict.
_MAX_POS = (1 << 32) - 2
_END, _POS, _KEYS, _LORA, _REFS = (attrgetter(name) for name in ("end", "pos", "keys", "lora", "refs"))


class CompactBlocks:
    """A source's migrated blocks, one :class:`SourceMap` per group."""

    def __init__(self, primary: str) -> None:
        self.primary = primary  # the medium every migrated block is held on, once
        self.maps: dict[int, SourceMap] = {}

    def __len__(self) -> int:
        return sum(map(len, self.maps.values()))

    @staticmethod
    def common(blk: EngineBlock, primary: str) -> bool:
        """Whether ``blk`` can be kept here (module docstring)."""
        return (
            not blk.lora
            and len(blk.keys) == 1
            and blk.keys[0] == blk.end
            and blk.refs == {primary: 1}
            and 0 <= blk.pos <= _MAX_POS
        )

    def migrate(self, table: KeyTable, blocks: dict[int, EngineBlock], dirty: list[int], fresh: Fresh) -> list[int]:
        """Move the common ones of the blocks a flush persisted (their holdings settled in
        ``table``) here, oldest first; returns the ids moved (the caller drops them from its
        dict). ``dirty`` names changed blocks (looked up, tested one by one); ``fresh`` gives
        stores as made, still as made unless a holding was added (their ``refs`` is no longer
        the shared ``{medium: 1}`` then), so a whole store is tested by identity. A block whose
        key has another position in ``table`` stays out. The tests and the copy run at C level
        (map, compress, numpy): a flush migrates every block its wake-up stored."""
        bids: list[int] = []
        made: list[EngineBlock] = []
        seen = set(dirty) if dirty and fresh else None
        for ids, group in fresh:
            if seen is not None and not seen.isdisjoint(ids):
                dirty = dirty + ids  # changed since made as well: looked up with the changed ones
                continue
            once = group[0].refs
            if group[0].lora or once != {self.primary: 1}:
                continue
            same = list(map(is_, map(_REFS, group), repeat(once)))
            whole = all(same)  # the usual: nothing was held again since the store
            bids += ids if whole else compress(ids, same)
            made += group if whole else compress(group, same)
        if dirty:
            ids = list(dict.fromkeys(compress(dirty, map(blocks.__contains__, dirty))))
            found = list(map(blocks.__getitem__, ids))
            ends = list(map(_END, found))
            common = list(
                map(
                    and_,
                    map(and_, map(eq, map(_LORA, found), repeat("")), map(eq, map(_KEYS, found), zip(ends))),
                    map(eq, map(_REFS, found), repeat({self.primary: 1})),
                )
            )
            bids += compress(ids, common)
            made += compress(found, common)
        if not bids:
            return []
        keys = np.fromiter(map(_END, made), dtype=np.int64, count=len(made))
        pos = np.fromiter(map(_POS, made), dtype=np.int64, count=len(made))
        return self._insert(table, bids, keys, pos)

    def _insert(
        self, table: KeyTable, bids: list[int], keys: npt.NDArray[np.int64], pos: npt.NDArray[np.int64]
    ) -> list[int]:
        fits = (pos >= 0) & (pos <= _MAX_POS)
        rows = table.locate_many(keys, insert=False)
        ok = fits & (rows >= 0)  # a key not held cannot be here: refused rather than guessed
        mismatch = table.set_pos(rows[ok], pos[ok])
        ok[np.flatnonzero(ok)[mismatch]] = False  # another position: stays in the dict
        moved = bids if ok.all() else list(compress(bids, ok.tolist()))
        if not moved:
            return []
        kept_rows = rows[ok]
        if max(moved) <= M64:  # group 0 only (the usual): the ids are the hashes
            self._map(0).insert_many(moved, kept_rows)
            return moved
        groups = np.array([bid >> 64 for bid in moved], dtype=np.int64)
        hashes = [bid & M64 for bid in moved]
        for group in np.unique(groups).tolist():
            at = np.flatnonzero(groups == group)
            self._map(group).insert_many([hashes[i] for i in at.tolist()], kept_rows[at])
        return moved

    def _map(self, group: int) -> SourceMap:
        smap = self.maps.get(group)
        if smap is None:
            smap = self.maps[group] = SourceMap()
        return smap

    def get(self, table: KeyTable | None, bid: int) -> EngineBlock | None:
        """The block ``bid`` as it was migrated (a new struct: changing it changes nothing here)."""
        return self._one(table, bid, remove=False)

    def take(self, table: KeyTable | None, bid: int) -> EngineBlock | None:
        """The block ``bid``, removed from here (the caller puts it back in its dict)."""
        return self._one(table, bid, remove=True)

    def _one(self, table: KeyTable | None, bid: int, remove: bool) -> EngineBlock | None:
        smap = self.maps.get(bid >> 64)
        if smap is None or table is None:
            return None
        found, rows = smap.remove_many([bid & M64]) if remove else smap.get_many([bid & M64])
        if not found[0]:
            return None
        return self._block(table, rows)[0]

    def holds_any(self, group: int, hashes: list[int]) -> bool:
        """Whether any of the engine block ``hashes`` of ``group`` is here."""
        smap = self.maps.get(group)
        return smap is not None and smap.any_of(hashes)

    def oldest(self, table: KeyTable | None, n: int) -> list[tuple[int, int, int]]:
        """Remove up to ``n`` of the oldest entries (spread over the groups by size): their
        ``(block id, group, kvcm key)``."""
        out: list[tuple[int, int, int]] = []
        total = len(self)
        if table is None or not total or n <= 0:
            return out
        for group, smap in self.maps.items():
            share = min(len(smap), -(-n * len(smap) // total))  # ceil: never short of n in all
            if share <= 0:
                continue
            hashes, rows = smap.oldest(min(share, n - len(out)))
            keys = to_signed_list(table.keys[rows.astype(np.int64)])
            out += [(group << 64 | h, group, k) for h, k in zip(hashes.tolist(), keys)]
            if len(out) >= n:
                break
        return out

    def items(self, table: KeyTable | None) -> list[tuple[int, EngineBlock]]:
        """Every block here with its id, oldest first per group (a rewrite, a clear)."""
        out: list[tuple[int, EngineBlock]] = []
        if table is None:
            return out
        for group, smap in self.maps.items():
            hashes, rows = smap.items()
            out += zip([group << 64 | h for h in hashes.tolist()], self._block(table, rows))
        return out

    def clear(self) -> None:
        self.maps.clear()

    def _block(self, table: KeyTable, rows: U32) -> list[EngineBlock]:
        r = rows.astype(np.int64)
        keys = to_signed_list(table.keys[r])
        pos = table.pos_of(r).tolist()
        held = {self.primary: 1}
        return [EngineBlock("", k, p, (k,), held) for k, p in zip(keys, pos)]

    def nbytes(self) -> int:
        return sum(m.nbytes() for m in self.maps.values())


__all__ = ["CompactBlocks"]
