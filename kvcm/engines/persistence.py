"""Persisting the engine index and loading it at start-up.

Persistence (``engine_sources``, ``engine_log``; layout in :mod:`kvcm.engines.entries`):
:meth:`EngineIndex.flush` appends the blocks touched since the last flush (one log record per
source, tombstones for the removed) and writes each source's ``last_seq``, in one transaction,
so the persisted index is always consistent with the persisted ``last_seq`` and a restarted kvcm
resumes by replay from ``last_seq + 1``. A source whose log outgrew its live blocks, or that was
cleared, is rewritten as its live blocks in that same transaction; :meth:`EngineIndex.load`
replays the records in order.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import is_
from typing import Any

from kvcm.backends.metastore.base import ReadTxn, WriteTxn
from kvcm.engines.bounds import BoundedIndex
from kvcm.engines.entries import (
    BLOCK_KEY,
    BLOCKS_DB,
    CHUNK,
    DEC,
    LOG_DB,
    LOG_KEY,
    SID,
    SOURCES_DB,
    Candidates,
    EngineBlock,
    SourceState,
    block_id,
    decode_log,
    flush_source,
    weight,
)
from kvcm.engines.hybrid import group_from_record
from kvcm.engines.sources import SourceSpec
from kvcm.threads import gc_paused


class IndexPersistence(BoundedIndex):
    """Flushes to, and loads from, the metadata store."""

    def flush(self) -> int:
        """Persist what changed since the last flush in one transaction; returns records written.
        The tables' deferred holdings are applied here too, so an index fed but never asked
        holds no pending keys for long; then, with ``compact``, the common blocks just persisted
        leave their dicts (:meth:`_migrate`)."""
        with self._lock:
            self._settle_tables()
        if not self._dirty:
            return 0
        if self._store is None:
            with self._lock:
                for source_id in self._dirty:
                    state = self._sources.get(source_id)
                    if state is not None:
                        candidates = self._candidates(state)
                        state.dirty.clear()
                        state.fresh.clear()
                        state.cleared = False
                        self._migrate(state, candidates)
                self._dirty.clear()
            return 0
        with self._store.write() as txn, self._lock, gc_paused():
            written = 0
            flushed: list[tuple[SourceState, Candidates]] = []
            try:
                for source_id in self._dirty:
                    state = self._sources.get(source_id)
                    if state is not None:
                        flushed.append((state, self._candidates(state)))
                        written += self._flush_source(txn, state)
            except BaseException:
                self._mark_all_dirty()  # the transaction rolls back: rewrite everything next time
                raise
            self._dirty.clear()
        with self._lock:  # committed: what was persisted may leave the dicts
            for state, candidates in flushed:
                self._migrate(state, candidates)
        return written

    def _candidates(self, state: SourceState) -> Candidates:
        """The blocks a flush of ``state`` persists, which it may migrate: the changed ones'
        ids, and the fresh stores as made (taken before the flush clears them)."""
        if not self._compact_blocks:
            return [], []
        return list(state.dirty), list(state.fresh)

    def _flush_source(self, txn: WriteTxn, state: SourceState) -> int:
        compact = state.compact
        if compact is None or not len(compact):
            return flush_source(txn, state)
        return flush_source(txn, state, lambda: compact.items(self._key_table(state)), len(compact))

    def _mark_all_dirty(self) -> None:
        for state in self._sources.values():
            state.cleared = True
            state.dirty.extend(state.blocks)
            state.fresh.clear()
            self._dirty.add(state.spec.source_id)

    def load(self) -> list[SourceState]:
        """Rebuild the in-memory index from the store (at start-up, before any source runs):
        per source its per-block records of the older format, then its log replayed in order."""
        if self._store is None:
            return []
        with self._store.read() as txn, self._lock:
            for _, raw in list(txn.scan(SOURCES_DB)):
                state = self._load_source(DEC.decode(raw))
                self._load_blocks(txn, state)
                self._sources[state.spec.source_id] = state
        with self._lock:
            self._trim_loaded()
            for state in self._sources.values():
                for bid, blk in list(state.blocks.items()):
                    self._load_block(state, bid, blk)
            self._settle_tables()
            for state in self._sources.values():
                self._migrate(state, (list(state.blocks), []))
            return list(self._sources.values())

    def _load_blocks(self, txn: ReadTxn, state: SourceState) -> None:
        """A source's blocks: its per-block records of the older format, then its log replayed
        in order, never holding more than its bound (plus one record) on the way."""
        prefix = SID.pack(state.number)
        blocks = state.blocks
        for bkey, braw in txn.scan(BLOCKS_DB, prefix=prefix):
            _, group, h = BLOCK_KEY.unpack(bkey)
            blocks[block_id(group, h)] = EngineBlock.unpack(braw)
            state.logged += 1
            if len(blocks) > self.max_per_source + CHUNK:
                self._drop_loaded(state, len(blocks) - self.max_per_source, counted=False)
        for lkey, lraw in txn.scan(LOG_DB, prefix=prefix):
            self._replay(state, LOG_KEY.unpack(lkey)[1], lraw)
            if len(blocks) > self.max_per_source:  # each block weighs at least 1
                self._drop_loaded(state, len(blocks) - self.max_per_source, counted=False)
        self._grown(state, sum(map(weight, blocks.values())))
        if state.size > self.max_per_source:
            self._drop_loaded(state, state.size - self.max_per_source)


    @staticmethod
    def _replay(state: SourceState, serial: int, raw: bytes) -> None:
        """One log record over the source's blocks: later versions replace, tombstones delete
        (a block a bound dropped while loading may have one)."""
        record = decode_log(raw)
        ids, found = record.ids(), record.blocks
        state.blocks.update(zip(ids, found))  # type: ignore[arg-type]  # the tombstones go next
        if None in found:
            pop = state.blocks.pop
            for bid in compress(ids, map(is_, found, repeat(None))):
                pop(bid, None)
        state.logged += len(ids)
        state.serial = serial + 1

    def _load_source(self, rec: dict[str, Any]) -> SourceState:
        self._generation += 1
        state = SourceState(
            SourceSpec.from_dict(rec["spec"]), int(rec["number"]), self._generation,
            int(rec["last_seq"]), float(rec["last_ts"]),
        )  # fmt: skip
        state.groups = dict(map(group_from_record, rec.get("groups", [])))
        return state

    def _load_block(self, state: SourceState, bid: int, blk: EngineBlock) -> None:
        """Index a loaded block; one whose every holding is refused (slots past the bounds, in an
        index written before them) is dropped."""
        refs, blk.refs = blk.refs, {}
        for medium, count in refs.items():
            if self._hold(state, blk, medium, bid >> 64):
                blk.refs = {**blk.refs, medium: count}
        if not blk.refs:
            del state.blocks[bid]
            self._grown(state, -weight(blk))
            state.cleared = True
            self._dirty.add(state.spec.source_id)
