"""The engine index's state and the primitives every part of it shares: the sources, the
``(instance, adapter)`` holder tables, holding and releasing a block's keys in a source's slot,
the slot bounds, and a source's migrated blocks (:mod:`kvcm.engines.compacted`) taken back into
its dict when they change.

A source holds at most :data:`MAX_SLOTS` (medium, group) slots per adapter and :data:`MAX_GROUPS`
groups, with media and adapter names of at most :data:`MAX_LABEL` characters: a slot is a bit of
every holder mask of its table, so slots unbounded would make every mask, not just the source,
grow. Stores past these are refused and counted.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING

from kvcm.backends.metastore.base import MetaStore, WriteTxn
from kvcm.engines.entries import Candidates, EngineBlock, NullTxn, SourceState
from kvcm.engines.hybrid import FULL
from kvcm.engines.scoring import Fragment
from kvcm.engines.sources import SubscriberSettings
from kvcm.engines.table import MAIN_KINDS, HolderTable, Slot
from kvcm.proto.requests.engines import MAX_LABEL  # the request schema bounds what the index keys by

if TYPE_CHECKING:
    from kvcm.engines.keytable import KeyTable

#: (medium, group) slots one source may hold in one adapter namespace (engines use a handful).
MAX_SLOTS = 64
#: KV-cache groups one source may name (vLLM's hybrid models have a few).
MAX_GROUPS = 64
#: One run of a match: the sources holding exactly the same number of the query's keys, in
#: source id order, as fragments, as their joined ``sources`` and ``pods`` entries, and how many.
Run = tuple[list[Fragment], bytes, bytes, int]
#: Runs by ``(length, running AND of the holder masks before it, after it)``: the slots in the
#: first and not in the second hold exactly ``length`` keys of the query.
RunMemo = dict[tuple[int, int, int], Run]


class IndexState:
    """What :class:`~kvcm.engines.index.EngineIndex` keeps in memory, and its shared primitives."""

    def __init__(
        self,
        store: MetaStore | None,
        block_size_of: Callable[[str], int],
        max_blocks_per_source: int = SubscriberSettings.max_blocks_per_source,
        max_blocks: int = SubscriberSettings.max_blocks,
        compact: bool = True,
    ) -> None:
        """``compact``: at each flush, move each source's common blocks out of its dict into
        compact maps (:mod:`kvcm.engines.compacted`)."""
        self._compact_blocks = compact
        self._store = store
        self._block_size_of = block_size_of
        self.max_per_source = max_blocks_per_source
        self.max_total = max_blocks
        self._total = 0  # the sizes of every source (SourceState.size), kept as they change
        self._lock = threading.RLock()
        self._sources: dict[str, SourceState] = {}
        self._tables: dict[tuple[str, str], HolderTable] = {}
        self._generation = 0
        self._dirty: set[str] = set()
        self._sizes: dict[str, int | None] = {}
        self._pods_distinct: dict[str, tuple[int, bool]] = {}  # instance -> (source generation, answer)
        # match_engines' encoded runs per table: (table, block size, source generation, its slots,
        # {(length, running AND before, after): run}, whether its slots weigh the same)
        self._runs: dict[tuple[str, str], tuple[HolderTable, int, int, list[Slot | None], RunMemo, bool]] = {}


    def clear_source(self, source_id: str, generation: int | None = None) -> bool:
        """Drop every block of the source (``AllBlocksCleared`` or a publisher restart)."""
        with self._lock:
            state = self._sources.get(source_id)
            if state is None or (generation is not None and state.generation != generation):
                return False
            self._clear_memory(state)
            state.cleared = True
            self._dirty.add(source_id)
            return True


    def _clear_memory(self, state: SourceState) -> None:
        source_id = state.spec.source_id
        slots = {}  # lora -> (table, the source's slots in it)
        for key in [k for k in self._tables if k[0] == state.spec.instance_id]:
            sids = self._tables[key].source_slots(source_id)
            if sids:
                slots[key[1]] = (self._tables[key], sids)
        held: dict[str, list[int]] = {}  # the tables know no slot's keys: the source's blocks do
        migrated = [] if state.compact is None else state.compact.items(self._key_table(state))
        for blk in chain(state.blocks.values(), map(itemgetter(1), migrated)):
            if blk.keys and blk.lora in slots:
                held.setdefault(blk.lora, []).extend(blk.keys)
        for lora, (table, sids) in slots.items():
            table.forget(sum(1 << sid for sid in sids), held.get(lora, ()))
            for sid in sids:
                table.drop_slot(sid)
            if table.empty:
                del self._tables[(state.spec.instance_id, lora)]
        state.blocks.clear()
        state.compact = None
        state.dirty.clear()
        state.fresh.clear()
        self._grown(state, -state.size)


    def _settle_tables(self) -> None:
        """Apply every table's deferred holds and releases (:meth:`HolderTable.settle`) and
        forget the tables left without slots."""
        for key, table in list(self._tables.items()):
            table.settle()
            if table.empty:
                del self._tables[key]


    def _hold(self, state: SourceState, blk: EngineBlock, medium: str, group: int) -> bool:
        """One more holding of ``blk`` on ``medium``; False (nothing held) when that would be a
        slot past :data:`MAX_SLOTS`."""
        count = blk.refs.get(medium, 0)
        if count and state.spec.report_mode == FULL:
            return True  # a re-report: the block is held once however often it is reported
        if count == 0 and blk.keys and self._refused(state, blk.lora, medium, group) is not None:
            return False
        blk.refs = {**blk.refs, medium: count + 1}
        if count == 0 and blk.keys:
            table = self._table(state.spec.instance_id, blk.lora)
            table.hold(self._slot(table, state, medium, group), blk.keys)
        return True

    def _slot(self, table: HolderTable, state: SourceState, medium: str, group: int) -> int:
        """The source's slot of ``(medium, group)``: counted by the default walk only for a
        source that ever sent one group, of a main kind (a hybrid source is matched by
        :mod:`kvcm.engines.hybrid`)."""
        groups = state.groups
        hybrid = len(groups) > 1
        info = groups.get(group)
        main = not hybrid and (info is None or info.kind in MAIN_KINDS)
        return table.slot(state.spec.source_id, medium, group, main, state.spec.dp_rank, hybrid)


    def _refused(self, state: SourceState, lora: str, medium: str, group: int) -> str | None:
        """Why the source may not hold blocks of adapter ``lora`` on ``(medium, group)`` (the
        error kind), or None: names past :data:`MAX_LABEL`, a group past :data:`MAX_GROUPS`, a
        new slot past :data:`MAX_SLOTS` (module docstring). The usual answer is two lookups."""
        if len(medium) > MAX_LABEL or len(lora) > MAX_LABEL:
            return "bad_label"
        if group not in state.groups and len(state.groups) >= MAX_GROUPS:
            return "too_many_groups"
        table = self._tables.get((state.spec.instance_id, lora))
        source_id = state.spec.source_id
        if table is None or (source_id, medium, group) in table.slot_ids:
            return None
        if len(table.source_slots(source_id)) < MAX_SLOTS:
            return None
        table.settle()  # a release may have emptied a slot not dropped yet
        return "too_many_slots" if len(table.source_slots(source_id)) >= MAX_SLOTS else None

    def _grown(self, state: SourceState, n: int) -> None:
        """The source's size changed by ``n`` (blocks came or went)."""
        state.size += n
        self._total += n


    def _key_table(self, state: SourceState) -> KeyTable | None:
        table = self._tables.get((state.spec.instance_id, ""))
        return None if table is None else table.key_table

    def _lookup(self, state: SourceState, bid: int) -> EngineBlock | None:
        """The block, from the dict or (a copy) from the migrated ones."""
        blk = state.blocks.get(bid)
        if blk is None and state.compact is not None:
            blk = state.compact.get(self._key_table(state), bid)
        return blk

    def _promote(self, state: SourceState, bid: int) -> EngineBlock | None:
        """The block, from the dict; a migrated one is taken back into it first (it is about to
        change)."""
        blk = state.blocks.get(bid)
        if blk is None and state.compact is not None:
            blk = state.compact.take(self._key_table(state), bid)
            if blk is not None:
                state.blocks[bid] = blk
        return blk

    def _migrate(self, state: SourceState, candidates: Candidates) -> None:
        """After a flush persisted them: the source's common blocks among ``candidates`` leave
        its dict for compact maps."""
        dirty, fresh = candidates
        if not self._compact_blocks or not (dirty or fresh):
            return
        table = self._tables.get((state.spec.instance_id, ""))
        if table is None:
            return
        if state.compact is None:
            from kvcm.engines.compacted import CompactBlocks  # numba: with the first table (table.py)

            first = fresh[0][1][0] if fresh else next(filter(None, map(state.blocks.get, dirty)), None)
            if first is None:
                return
            state.compact = CompactBlocks(next(iter(first.refs)) if len(first.refs) == 1 else "GPU")
        table.settle()
        moved = state.compact.migrate(table.key_table, state.blocks, dirty, fresh)
        blocks = state.blocks
        deque(map(blocks.__delitem__, moved), maxlen=0)
        if moved and len(blocks) < len(moved) // 4:
            state.blocks = dict(blocks)  # a dict never shrinks by deleting: the buffer's peak goes

    def _release(self, state: SourceState, blk: EngineBlock, medium: str, group: int) -> None:
        count = blk.refs[medium]
        if count > 1:
            blk.refs = {**blk.refs, medium: count - 1}
            return
        blk.refs = {m: n for m, n in blk.refs.items() if m != medium}
        if blk.keys:
            self._release_keys(state, blk.lora, medium, group, blk.keys)

    def _release_keys(self, state: SourceState, lora: str, medium: str, group: int, keys: Sequence[int]) -> None:
        """One holding less of each key in the source's slot; the slot (and its table) go once empty."""
        table = self._tables.get((state.spec.instance_id, lora))
        if table is None:
            return
        sid = table.slot_ids.get((state.spec.source_id, medium, group))
        if sid is not None:
            table.release(sid, keys)  # applied, and an emptied slot dropped, by _settle_tables

    def _table(self, instance_id: str, lora: str) -> HolderTable:
        table = self._tables.get((instance_id, lora))
        if table is None:
            table = self._tables[(instance_id, lora)] = HolderTable()
        return table


    def _txn(self) -> AbstractContextManager[WriteTxn | None]:
        return self._store.write() if self._store is not None else NullTxn()
