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

An entry is ``[group, instance, key, location id, bytes, storage type, storage, address, value,
copies]``. Bytes and type let the "being freed" counter (:class:`kvcm.cache.usage.BeingFreed`) be
rebuilt from this database alone at start-up (:func:`pending_bytes`). The rest lets the deleter
drop a dead record without decoding it: when one marking made *every* copy of a record
``deleting``, each of its entries carries ``value``, the record's stored bytes right after that
marking, and ``copies``, how many copies it has. When the deleter holds all ``copies`` entries
of a record and the stored bytes are still ``value`` (no write touched the record since, so
every copy is still the one marked), it deletes the key and frees the URIs the entries'
addresses name (:meth:`~kvcm.cache.meta_index.MetaIndex.delete_unchanged`). Otherwise —
``value`` nil (a copy marked alone), the record changed, the entries split across chunks — the
record is decoded and each named copy dropped if it is still ``deleting``, as before.
Entries written before those fields existed (six fields, or four, without bytes and type: those
are looked up in their block record) take that path.

A storage *waiting* to be opened again (its lock held by another process for now, see
:mod:`kvcm.cache.storage_pool`) cannot free anything: its entries stay, and are freed once it
is back. Only a storage that is gone from the registry has its locations dropped unfreed.

Thread ownership: :meth:`Deleter.run_once` on the deleter thread; :func:`schedule` on whichever
thread owns the write transaction.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable
from itertools import takewhile
from typing import Any

import msgpack

from kvcm.backends.metastore.base import MetaStore, ReadTxn, WriteTxn, i64, u64
from kvcm.cache.locations import uris as location_uris
from kvcm.cache.meta_index import DB as BLOCKS
from kvcm.cache.meta_index import KEEP, MetaIndex, namespace
from kvcm.cache.record_codec import Location, Record, Status, decode
from kvcm.cache.usage import BeingFreed, FreeKey

log = logging.getLogger("kvcm.cache.deleter")

DB = "deletes"
_seq = itertools.count(int(time.time() * 1e6))


def schedule(txn: WriteTxn, due: float, group: str, instance: str, key: int, loc: Location) -> None:
    """Queue the free of one location just marked ``deleting`` at wall time ``due``.

    The caller counts ``loc``'s bytes as being freed (:class:`~kvcm.cache.usage.BeingFreed`)."""
    schedule_many(txn, due, group, instance, [(key, loc)])


Whole = dict[int, tuple[bytes, int]]  # key -> (stored value after the marking, copies in it)


def schedule_many(txn: WriteTxn, due: float, group: str, instance: str, marked: list[tuple[int, Location]],
                  whole: Whole | None = None) -> None:
    """:func:`schedule` for several ``(key, location)`` of one instance, in one ``put_many``.

    ``whole``: the keys whose every copy this marking made ``deleting``, with the record's
    stored value and copy count (module docstring: the deleter then needs no decode)."""
    if not marked:
        return
    due_ms, pack, seq = u64(max(0, int(due * 1000))), msgpack.Packer().pack, _seq
    dead = whole or {}
    txn.put_many(DB, [(due_ms + u64(next(seq) & 0xFFFFFFFFFFFFFFFF),
                       pack([group, instance, key, loc.id, loc.nbytes, loc.type, loc.storage, loc.addr,
                             *dead.get(key, (None, 0))]))
                      for key, loc in marked])


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
        # The storages waiting to be opened again (the pool's ``waiting``): their frees wait too.
        self.waiting: Callable[[], frozenset[str]] = _nothing_waits
        # Copies whose records a committed transaction dropped (in-line eviction without a grace
        # delay): freed at the deleter's next wake-up, off the request path, in one batch.
        self._queued: deque[tuple[str, list[bytes]]] = deque()

    def pending(self) -> int:
        """Deletes not done yet: the entries in the store and the queued frees."""
        with self.store.read() as view:
            return view.count(DB) + len(self._queued)

    def free_later(self, storage: str, addrs: list[bytes]) -> None:
        """Free the copies at ``addrs`` (location addresses) on ``storage`` at the next
        :meth:`free_queued`; their records are gone already (committed)."""
        self._queued.append((storage, addrs))

    def free_queued(self) -> int:
        """Free every queued copy, grouped by storage; returns how many. Any thread may call it
        (the deleter's wake-up, an allocation that found its storage full, a stop)."""
        by_storage: dict[str, list[str]] = defaultdict(list)
        count = 0
        pop = self._queued.popleft
        while self._queued:
            try:
                storage, addrs = pop()
            except IndexError:  # another thread took the last one
                break
            for addr in addrs:
                by_storage[storage].extend(location_uris(addr))
            count += len(addrs)
        for name, uris in by_storage.items():
            try:
                self.free_storage(name, uris)
            except Exception:  # the metadata is gone already: the slots stay taken until a restart
                log.exception("storage %r: freeing %d evicted location(s) failed", name, len(uris))
        self.freed += count
        return count

    def run_once(self, now: float | None = None) -> int:
        """Free the queued copies, then every entry due at ``now``; returns how many locations
        were freed."""
        limit = u64(int((self.clock() if now is None else now) * 1000) + 1)
        total = self.free_queued() if self._queued else 0
        start = b""  # past the entries read so far: those left were a waiting storage's
        while True:
            with self.store.read() as view:
                # Entries come out in due order: stop at the first one not due (the rest of a
                # chunk is the deletes still in their grace period, read again at every poll).
                due = list(takewhile(lambda item: item[0][:8] < limit, view.scan(DB, start=start, limit=self.chunk)))
            if not due:
                return total
            ready = self._not_waiting(due)
            if ready:
                total += self._free_chunk(ready)
            if len(due) < self.chunk:
                return total
            start = due[-1][0] + b"\0"

    def _not_waiting(self, entries: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The entries whose storage can free now (entries older than the storage field are
        sorted out per location, inside the transaction)."""
        waiting = self.waiting()
        if not waiting:
            return entries
        return [e for e in entries if _storage_of(e[1]) not in waiting]

    def _free_chunk(self, entries: list[tuple[bytes, bytes]]) -> int:
        slow: dict[tuple[str, str], dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
        fast: dict[tuple[str, str], dict[int, list[list[Any]]]] = defaultdict(lambda: defaultdict(list))
        ids: dict[bytes, tuple[str, int, str]] = {}  # entry -> (instance, key, location id)
        for entry, value in entries:
            fields = msgpack.unpackb(value)
            group, instance, key, loc_id = fields[:4]
            ids[entry] = (instance, key, loc_id)
            if len(fields) >= 10 and fields[8] is not None:
                fast[(group, instance)][key].append(fields)
            else:
                slow[(group, instance)][key].add(loc_id)
        with self.store.write() as txn:
            doomed: dict[str, list[str]] = defaultdict(list)  # storage -> uris
            deltas: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
            held: set[tuple[str, int, str]] = set()  # locations of waiting storages: entries stay
            for (group, instance), by_key in fast.items():
                self._drop_whole(txn, group, instance, by_key, doomed, deltas, slow[(group, instance)])
            for (group, instance), wanted in slow.items():
                if wanted:
                    self._drop(txn, group, instance, wanted, doomed, deltas, held)
            txn.delete_many(DB, [k for k, _ in entries if ids[k] not in held])
            self.usage_add(txn, dict(deltas))
            # Every dropped location was deleting: its bytes leave the being-freed count too.
            freeing: dict[FreeKey, int] = defaultdict(int)
            for (group, _, kind), d in deltas.items():
                freeing[(group, kind)] += d[0]
            self.being_freed.add(txn, freeing)
            freed = sum(len(uris) for uris in doomed.values())
            for name, uris in doomed.items():
                self.free_storage(name, uris)  # last: a failure rolls the whole chunk back
        self.freed += sum(-d[1] for d in deltas.values())
        return freed

    def _drop_whole(self, txn: WriteTxn, group: str, instance: str, by_key: dict[int, list[list[Any]]],
                    doomed: dict[str, list[str]], deltas: dict[tuple[str, str, str], list[int]],
                    slow: dict[int, set[str]]) -> None:
        """Records every copy of which one marking made ``deleting``: deleted by a byte
        compare when this chunk holds all their entries (module docstring); the others, and
        those whose record changed since, go to ``slow`` (decoded, compare-and-delete)."""
        ready: list[tuple[int, bytes]] = []
        for key, group_entries in by_key.items():
            value, copies = group_entries[0][8:10]
            if (len(group_entries) == copies == len({f[3] for f in group_entries})
                    and all(f[8] == value for f in group_entries)):
                ready.append((key, value))
            else:
                slow[key].update(f[3] for f in group_entries)
        deleted = self.index.delete_unchanged(txn, namespace(instance), ready) if ready else []
        for (key, _), gone in zip(ready, deleted):
            if not gone:
                slow[key].update(f[3] for f in by_key[key])
                continue
            for f in by_key[key]:
                doomed[f[6]].extend(location_uris(f[7]))
                delta = deltas[(group, instance, f[5])]
                delta[0] -= int(f[4])
                delta[1] -= 1

    def _drop(self, txn: WriteTxn, group: str, instance: str, wanted: dict[int, set[str]],
              doomed: dict[str, list[str]], deltas: dict[tuple[str, str, str], list[int]],
              held: set[tuple[str, int, str]]) -> None:
        waiting = self.waiting()

        def modify(_: int, key: int, record: Record | None) -> Any:
            if record is None:
                return KEEP
            keep: list[Location] = []
            gone: list[Location] = []
            for loc in record.locs:
                if loc.id in wanted[key] and loc.storage in waiting:
                    held.add((instance, key, loc.id))  # freed once its storage is back
                    keep.append(loc)
                    continue
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

    def free_storage(self, name: str, uris: list[str]) -> None:
        """Free ``uris`` on storage ``name``, whose metadata no longer names them."""
        backend = self.storage(name)
        if backend is None:
            if name in self.waiting():
                # Only queued copies, whose records are gone (entries wait, see run_once): the
                # storage reserves what the metadata names when it opens, so these come back free.
                log.info("storage %r: %d location(s) freed when it opens again", name, len(uris))
                return
            # The storage was removed or never opened: nothing of ours to free there any more.
            log.warning("dropping %d location(s) of storage %r without freeing: storage not open", len(uris), name)
            return
        tasks = backend.delete(uris)
        if tasks:
            self.external_tasks = list(tasks)
            log.info("storage %r: %d deletion task(s) for the external owner", name, len(tasks))


def _nothing_waits() -> frozenset[str]:
    return frozenset()


def _storage_of(value: bytes) -> str | None:
    """The storage an entry names (None for an entry older than that field)."""
    fields = msgpack.unpackb(value)
    return str(fields[6]) if len(fields) > 6 else None
