"""Asynchronous deletes: locations marked ``deleting`` are freed on their storage, then dropped.

A delete is *scheduled* in the same transaction that marks the location ``deleting``: one entry
in the ``deletes`` database keyed ``u64(due_ms) + u64(seq)``, so entries come out in due order
and a crash can never lose one (deletes pending at a crash finish after the restart).

The deleter (a :class:`~kvcm.threads.LoopThread`) takes due entries in chunks. For each chunk,
inside one write transaction: the block records are updated (location removed if it is still
``deleting`` — a compare-and-delete, Tair's CAD), usage is decreased, the entries are removed,
then the storage frees the data, then the transaction commits. Freeing inside the transaction
means a freed slot cannot be handed out again before its metadata is gone (allocation happens
in write transactions too); a crash after the free and before the commit only repeats the free
after restart, where the metadata still reserves the slot.

An entry is ``[group, instance, key, location id, bytes, storage type]``: the last two let the
"being freed" counter (:class:`kvcm.cache.usage.BeingFreed`) be rebuilt from this database
alone at start-up (:func:`pending_bytes`). Entries written before those two fields existed
(four fields) are looked up in their block record instead.

Thread ownership: :meth:`Deleter.run_once` on the deleter thread; :func:`schedule` on whichever
thread owns the write transaction.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from itertools import takewhile
from typing import Any

import msgpack

from kvcm.cache.blocks import Location, Record, Status, decode
from kvcm.cache.meta_index import DB as BLOCKS
from kvcm.cache.meta_index import KEEP, MetaIndex, namespace
from kvcm.cache.usage import BeingFreed, FreeKey
from kvcm.store.base import MetaStore, ReadTxn, WriteTxn, i64, u64

log = logging.getLogger("kvcm.cache.deleter")

DB = "deletes"
_seq = itertools.count(int(time.time() * 1e6))


def schedule(txn: WriteTxn, due: float, group: str, instance: str, key: int, loc: Location) -> None:
    """Queue the free of one location just marked ``deleting`` at wall time ``due``.

    The caller counts ``loc``'s bytes as being freed (:class:`~kvcm.cache.usage.BeingFreed`)."""
    schedule_many(txn, due, group, instance, [(key, loc)])


def schedule_many(txn: WriteTxn, due: float, group: str, instance: str, marked: list[tuple[int, Location]]) -> None:
    """:func:`schedule` for several ``(key, location)`` of one instance, in one ``put_many``."""
    if not marked:
        return
    due_ms, pack = u64(max(0, int(due * 1000))), msgpack.Packer().pack
    txn.put_many(DB, [(due_ms + u64(next(_seq) & 0xFFFFFFFFFFFFFFFF),
                       pack([group, instance, key, loc.id, loc.nbytes, loc.type])) for key, loc in marked])


def pending_bytes(view: ReadTxn) -> dict[FreeKey, int]:
    """Bytes being freed per (group, type), from the pending entries (start-up).

    A four-field entry (written before entries named their bytes) takes them from its block
    record: the location is there, still ``deleting``, until the deleter drops it together with
    the entry; with no such location the entry frees nothing and counts 0. That is exact, as the
    deleter uncounts only what it drops."""
    out: dict[FreeKey, int] = defaultdict(int)
    for _, value in view.scan(DB):
        fields = msgpack.unpackb(value)
        group, instance, key, loc_id = fields[:4]
        if len(fields) >= 6:
            out[(group, fields[5])] += int(fields[4])
            continue
        raw = view.get(BLOCKS, namespace(instance) + i64(key))
        loc = None if raw is None else next((x for x in decode(raw).locs if x.id == loc_id), None)
        if loc is not None and loc.status == Status.DELETING:
            out[(group, loc.type)] += loc.nbytes
    return {k: v for k, v in out.items() if v}


class Deleter:
    """Frees due deletes. ``storage(name)`` returns the opened backend or None."""

    def __init__(
        self,
        store: MetaStore,
        index: MetaIndex,
        usage_add: Callable[[WriteTxn, dict[tuple[str, str, str], list[int]]], None],
        storage: Callable[[str], Any],
        clock: Callable[[], float] = time.time,
        chunk: int = 256,
        being_freed: BeingFreed | None = None,
    ) -> None:
        self.store = store
        self.index = index
        self.usage_add = usage_add
        self.storage = storage
        self.clock = clock
        self.chunk = chunk
        self.being_freed = being_freed if being_freed is not None else BeingFreed()
        self.freed = 0  # locations freed since start (metrics, tests)
        self.external_tasks: list[str] = []  # URIs an external owner must delete (last chunk)

    def pending(self) -> int:
        with self.store.read() as view:
            return view.count(DB)

    def run_once(self, now: float | None = None) -> int:
        """Free every entry due at ``now``; returns how many locations were freed."""
        limit = u64(int((self.clock() if now is None else now) * 1000) + 1)
        total = 0
        while True:
            with self.store.read() as view:
                # Entries come out in due order: stop at the first one not due (the rest of a
                # chunk is the deletes still in their grace period, read again at every poll).
                due = list(takewhile(lambda item: item[0][:8] < limit, view.scan(DB, limit=self.chunk)))
            if not due:
                return total
            total += self._free_chunk(due)
            if len(due) < self.chunk:
                return total

    def _free_chunk(self, entries: list[tuple[bytes, bytes]]) -> int:
        by_instance: dict[tuple[str, str], dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
        for _, value in entries:
            group, instance, key, loc_id = msgpack.unpackb(value)[:4]
            by_instance[(group, instance)][key].add(loc_id)
        with self.store.write() as txn:
            doomed: dict[str, list[str]] = defaultdict(list)  # storage -> uris
            deltas: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
            for (group, instance), wanted in by_instance.items():
                self._drop(txn, group, instance, wanted, doomed, deltas)
            txn.delete_many(DB, [k for k, _ in entries])
            self.usage_add(txn, dict(deltas))
            # Every dropped location was deleting: its bytes leave the being-freed count too.
            freeing: dict[FreeKey, int] = defaultdict(int)
            for (group, _, kind), d in deltas.items():
                freeing[(group, kind)] += d[0]
            self.being_freed.add(txn, freeing)
            freed = sum(len(uris) for uris in doomed.values())
            for name, uris in doomed.items():
                self._free_storage(name, uris)  # last: a failure rolls the whole chunk back
        self.freed += sum(-d[1] for d in deltas.values())
        return freed

    def _drop(self, txn: WriteTxn, group: str, instance: str, wanted: dict[int, set[str]],
              doomed: dict[str, list[str]], deltas: dict[tuple[str, str, str], list[int]]) -> None:
        def modify(_: int, key: int, record: Record | None) -> Any:
            if record is None:
                return KEEP
            keep: list[Location] = []
            gone: list[Location] = []
            for loc in record.locs:
                # Compare-and-delete: a location that is no longer "deleting" is not ours to free.
                (gone if loc.id in wanted[key] and loc.status == Status.DELETING else keep).append(loc)
            if not gone:
                return KEEP
            for loc in gone:
                doomed[loc.storage].extend(loc.uris())
                delta = deltas[(group, instance, loc.type)]
                delta[0] -= loc.nbytes
                delta[1] -= 1
            if not keep:
                return None
            record.locs = keep
            return record

        self.index.read_modify_write(txn, namespace(instance), list(wanted), modify)

    def _free_storage(self, name: str, uris: list[str]) -> None:
        backend = self.storage(name)
        if backend is None:
            # The storage was removed or never opened: nothing of ours to free there any more.
            log.warning("dropping %d location(s) of storage %r without freeing: storage not open", len(uris), name)
            return
        tasks = backend.delete(uris)
        if tasks:
            self.external_tasks = list(tasks)
            log.info("storage %r: %d deletion task(s) for the external owner", name, len(tasks))
