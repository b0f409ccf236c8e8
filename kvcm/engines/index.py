"""The engine index: which engine (source, DP rank, medium, group) holds which kvcm block.

Engine events name blocks by the engine's own hashes; kvcm re-hashes their ``token_ids`` with the
instance's block hash (:mod:`kvcm.cache.keys`), chained through the parent block, so engine blocks
and storage-tier blocks share one key space and ``match_engines`` takes the same ``token_ids`` as
``get_cache_location``. Per source the index keeps ``(group, engine hash) -> EngineBlock``: the
block's kvcm keys, the running hash state and token position at its end (the parent seed of its
children) and a holding count per medium (vLLM can store and remove one hash twice).

Its parts: :mod:`~kvcm.engines.indexstate` (the state and shared primitives),
:mod:`~kvcm.engines.applying` (events), :mod:`~kvcm.engines.bounds` (evictions),
:mod:`~kvcm.engines.queries` (``match_engines``, locations) and :mod:`~kvcm.engines.persistence`.

Thread ownership: the subscriber thread applies and flushes; the RPC thread adds/removes sources
and queries. One re-entrant lock guards all in-memory state; a write transaction, when needed,
is always opened *before* taking the lock (the store's documented lock order).
"""

from __future__ import annotations

import threading
from collections import Counter

from kvcm.engines.applying import KEYED, EventApplier
from kvcm.engines.entries import SOURCES_DB, EngineBlock, SourceState, delete_blocks
from kvcm.engines.indexstate import MAX_GROUPS, MAX_SLOTS, Run, RunMemo
from kvcm.engines.persistence import IndexPersistence
from kvcm.engines.queries import IndexQueries
from kvcm.engines.sources import SourceSpec
from kvcm.errors import Conflict, NotFound
from kvcm.proto.requests.engines import MAX_LABEL

__all__ = ["KEYED", "MAX_GROUPS", "MAX_LABEL", "MAX_SLOTS", "EngineIndex", "Run", "RunMemo"]


class EngineIndex(EventApplier, IndexQueries, IndexPersistence):
    """Engine blocks of every source, mapped into kvcm keys (see the module docstring)."""

    def add_source(self, spec: SourceSpec) -> SourceState:
        """Register a source (idempotent for an identical spec); persisted at once."""
        with self._txn() as txn, self._lock:
            old = self._sources.get(spec.source_id)
            if old is not None:
                if old.spec == spec:
                    return old
                raise Conflict(f"event source {spec.source_id!r} exists with another spec")
            self._generation += 1
            numbers = {s.number for s in self._sources.values()}
            number = next(i for i in range(1, len(numbers) + 2) if i not in numbers)
            state = SourceState(spec, number, self._generation)
            self._sources[spec.source_id] = state
            if txn is not None:
                txn.put(SOURCES_DB, spec.source_id.encode(), state.record())
            return state

    def remove_source(self, source_id: str) -> SourceState:
        """Forget a source and exactly its blocks; persisted at once."""
        with self._txn() as txn, self._lock:
            state = self._sources.pop(source_id, None)
            if state is None:
                raise NotFound(f"no event source {source_id[:200]!r}")
            self._clear_memory(state)
            self._dirty.discard(source_id)
            if txn is not None:
                txn.delete(SOURCES_DB, source_id.encode())
                delete_blocks(txn, state.number)
            return state

    def get(self, source_id: str) -> SourceState | None:
        return self._sources.get(source_id)

    @property
    def lock(self) -> threading.RLock:
        """The index's lock, for callers that must change it together with their own state
        (push sources: :mod:`kvcm.engines.push`). Never open a transaction while holding it."""
        return self._lock

    def sources(self) -> list[SourceState]:
        with self._lock:
            return list(self._sources.values())

    def hybrid_slots(self, instance_id: str, lora_name: str | None = None) -> int:
        """Slots of hybrid sources in the ``(instance, adapter)`` table: what a default query's
        hybrid answer costs per key grows with them (:mod:`kvcm.api.costs`)."""
        table = self._tables.get((instance_id, lora_name or ""))
        return 0 if table is None else table.hybrid_slots

    def blocks_held(self, source_id: str) -> dict[str, int]:
        """Distinct kvcm keys the source holds, per medium."""
        with self._lock:
            out: Counter[str] = Counter()
            state = self._sources.get(source_id)
            if state is None:
                return {}
            for (inst, _), table in self._tables.items():
                if inst != state.spec.instance_id:
                    continue
                for sid in table.source_slots(source_id):
                    slot = table.slots[sid]
                    if slot is not None:
                        out[slot.medium] += table.count(sid)
            return dict(out)

    def blocks_of(self, source_id: str) -> dict[int, EngineBlock]:
        """Every block of the source by id, the migrated ones (copies) first (tests, tools)."""
        with self._lock:
            state = self._sources.get(source_id)
            if state is None:
                return {}
            migrated = [] if state.compact is None else state.compact.items(self._key_table(state))
            return {**dict(migrated), **state.blocks}


    def set_position(self, source_id: str, generation: int, last_seq: int) -> None:
        """Move a source's ``last_seq`` (a restart resets it to -1)."""
        with self._lock:
            state = self._sources.get(source_id)
            if state is not None and state.generation == generation:
                state.last_seq = last_seq
                self._dirty.add(source_id)
