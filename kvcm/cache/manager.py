"""CacheManager: the data plane's facade (Tair KVCM's cache RPCs, with its known weaknesses fixed).

The operations live one module each below it: :mod:`kvcm.cache.lookup` (reads),
:mod:`kvcm.cache.writes` (two-phase writes), :mod:`kvcm.cache.removal` (everything that marks
copies ``deleting``), :mod:`kvcm.cache.consistency` (invariants); they take the shared
:class:`~kvcm.cache.state.CacheState` this class extends and never call back into it. This module
adds recovery at start-up, session expiry, the deleter's loop body and the hooks the reclaimer uses.

Thread ownership: RPC operations and the session- and pin-expiry timers run on the RPC thread;
:meth:`CacheManager.background_once` (deletes, purges, lost-block scans) on the deleter thread;
:meth:`evict` / :meth:`serving_keys` / :meth:`usage` on the reclaimer thread; the room maker
(:meth:`set_room_maker`) is called on the RPC thread, inside the request's write transaction. Every thread
brings its own store transactions; in-memory state changes only in ``txn.on_commit`` callbacks
or under the GIL-atomic operations noted where they happen.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence

from kvcm.backends.storage.base import SlotStorage
from kvcm.cache import consistency, lookup, removal, writes
from kvcm.cache.deleter import pending_bytes
from kvcm.cache.listeners import CacheListener
from kvcm.cache.masks import BlockMask
from kvcm.cache.record_codec import Status, decode
from kvcm.cache.room import RoomMaker
from kvcm.cache.sessions import DB as SESSIONS
from kvcm.cache.sessions import decode_session
from kvcm.cache.state import CacheState, LostCounter
from kvcm.cache.usage import GroupUsage, Key, Usage
from kvcm.proto.wire import Encodable, Raw

__all__ = ["CacheManager", "LostCounter"]

log = logging.getLogger("kvcm.cache.manager")


class CacheManager(CacheState):
    """Block metadata of every instance; see the module docstring for thread ownership."""

    # -- start-up -------------------------------------------------------------------------------

    def start(self) -> None:
        """Recover: open storages, load counters and sessions, reserve every URI the metadata
        holds (the storages rebuild their free space from it), queue purges of instances that
        were removed while blocks remained."""
        self.pool.open_all()
        owner: dict[str, str] = {}
        registered_ids = [i.instance_id for i in self.registry.list_instances()]
        with self.store.read() as view:
            self.usage_book.load(view)
            self.being_freed.reset(pending_bytes(view))
            self.sessions.load(view, owner)
            orphans = self.pins.load(view, registered_ids)
        if orphans:  # pins of instances removed before their rows were cleaned up
            with self.store.write() as txn:
                dropped = self.pins.drop_namespaces(txn, orphans)
            log.info("dropped %d pin(s) of %d removed instance(s)", dropped, len(orphans))
        self._reserve_all(owner)
        for registered in self.registry.list_instances():
            self.known[registered.instance_id] = registered.instance_group
        for group, instance_id, _ in self.usage_book.snapshot():
            self.known.setdefault(instance_id, group)
            if not self.registered(instance_id) and instance_id not in self.purges:
                self.purges.append(instance_id)

    def _reserve_all(self, owner: dict[str, str]) -> None:
        """Reserve every recorded URI, sweep the rest, and count ``writing`` bytes per instance
        (``owner``: session id -> instance; a writing copy always names its live session)."""
        by_storage: dict[str, list[str]] = defaultdict(list)
        inflight = self.inflight.snapshot()
        for chunk in self.all_chunks():
            for _, value in chunk:
                for loc in decode(value).locs:
                    by_storage[loc.storage].extend(loc.uris())
                    if loc.status == Status.WRITING and loc.session in owner:
                        inflight.setdefault(owner[loc.session], [0, 0])[1] += loc.nbytes
        self.inflight.reset(inflight)
        for name in self.pool.names():
            backend = self.pool.get(name)
            if backend is None:
                continue
            try:
                backend.reserve(by_storage.get(name, []))
                if isinstance(backend, SlotStorage) and backend.damaged():
                    self.mark_lost(name, backend.lost, "startup")
                removed = backend.sweep()
                if removed:
                    log.info("storage %r: removed %d container(s) no block refers to", name, removed)
            except Exception:
                log.exception("recovering storage %r failed", name)

    # -- RPC operations -------------------------------------------------------------------------

    def get_cache_location(self, instance_id: str, query_type: str, block_keys: Sequence[int] | None,
                           token_ids: Sequence[int] | None, mask: BlockMask | None, sw_size: int = 0,
                           spec_names: Sequence[str] | None = None, compact: bool = False) -> Raw:
        return lookup.get_cache_location(self, instance_id, query_type, block_keys, token_ids, mask, sw_size,
                                         spec_names, compact=compact)[1]

    def get_cache_location_len(self, instance_id: str, query_type: str, block_keys: Sequence[int] | None,
                               token_ids: Sequence[int] | None, mask: BlockMask | None, sw_size: int = 0,
                               spec_names: Sequence[str] | None = None) -> int:
        return lookup.get_cache_location(self, instance_id, query_type, block_keys, token_ids, mask, sw_size,
                                         spec_names, reply=False)[0]

    def get_cache_meta(self, instance_id: str, block_keys: Sequence[int] | None, token_ids: Sequence[int] | None,
                       mask: BlockMask | None, detail_level: int = 0) -> dict[str, Encodable]:
        return lookup.get_cache_meta(self, instance_id, block_keys, token_ids, mask, detail_level)

    def start_write_cache(self, instance_id: str, block_keys: Sequence[int] | None, token_ids: Sequence[int] | None,
                          spec_group_names: Sequence[str] | None = None, timeout: float | None = None) -> Raw:
        return writes.start_write_cache(self, instance_id, block_keys, token_ids, spec_group_names, timeout)

    def finish_write_cache(self, instance_id: str, session_id: str, success: BlockMask | None) -> dict[str, Encodable]:
        return writes.finish_write_cache(self, instance_id, session_id, success)

    def remove_cache(self, instance_id: str, block_keys: Sequence[int] | None, token_ids: Sequence[int] | None,
                     mask: BlockMask | None) -> dict[str, Encodable]:
        return removal.remove_cache(self, instance_id, block_keys, token_ids, mask)

    def trim_cache(self, instance_id: str, strategy: str, begin_us: int = 0, end_us: int = 0) -> dict[str, Encodable]:
        return removal.trim_cache(self, instance_id, strategy, begin_us, end_us)

    def report_lost(self, instance_id: str, block_keys: Sequence[int] | None, token_ids: Sequence[int] | None,
                    mask: BlockMask | None) -> dict[str, Encodable]:
        return removal.report_lost(self, instance_id, block_keys, token_ids, mask)

    def pin_cache(self, instance_id: str, block_keys: Sequence[int], ttl_s: float) -> dict[str, Encodable]:
        """Pin ``block_keys`` for ``ttl_s`` seconds (:mod:`kvcm.cache.pins`); a key need not be stored."""
        self.instance(instance_id)
        keys = list(block_keys)
        with self.store.write() as txn:
            pinned, expires_at = self.pins.pin(txn, instance_id, keys, ttl_s, self.clock())
            if self.listeners:
                txn.on_commit(lambda: self.listeners.pinned(instance_id, keys, ttl_s, expires_at))
        return {"pinned": pinned, "expires_at": expires_at}

    def unpin_cache(self, instance_id: str, block_keys: Sequence[int]) -> dict[str, Encodable]:
        self.instance(instance_id)
        keys = list(block_keys)
        with self.store.write() as txn:
            unpinned = self.pins.unpin(txn, instance_id, keys, self.clock())
            if self.listeners:
                txn.on_commit(lambda: self.listeners.unpinned(instance_id, keys))
        return {"unpinned": unpinned}

    def expire_pins(self) -> int:
        """Timer body (RPC thread): drop lapsed pins and the pins of removed instances."""
        now = self.clock()
        if not self.pins.due(now):
            return 0
        with self.store.write() as txn:
            return self.pins.expire(txn, now)

    def expire_sessions(self) -> int:
        """Timer body (RPC thread): every due session counts as all-failed."""
        due = self.sessions.due()
        if not due:
            return 0
        expired = 0
        try:
            with self.store.write() as txn:
                for sid in due:
                    session = self.sessions.get(txn, sid)
                    if session is None:
                        continue
                    self.sessions.consume(txn, session, expired=True)
                    writes.settle(self, txn, session, [False] * len(session.keys))
                    expired += 1
        except Exception:
            self.sessions.requeue(due)
            raise
        return expired

    # -- lost blocks, purges (deleter thread) ---------------------------------------------------

    def mark_lost(self, storage: str, lost: Callable[[list[str]], set[str]], source: str) -> int:
        return removal.mark_lost(self, storage, lost, source)

    def scan_lost(self) -> int:
        return removal.scan_lost(self)

    def purge_instance(self, instance_id: str) -> int:
        return removal.purge_instance(self, instance_id)

    def background_once(self) -> int:
        """Deleter thread body: purge removed instances, look for lost blocks when due, then
        free due deletes."""
        if self.lost_scan_s > 0 and self.monotonic() >= self.next_lost_scan:
            self.next_lost_scan = self.monotonic() + self.lost_scan_s
            try:
                self.scan_lost()
            except Exception:
                log.exception("looking for lost blocks failed")
        while self.purges:
            instance_id = self.purges[0]
            self.purge_instance(instance_id)
            self.purges.pop(0)
        return self.deleter.run_once()

    # -- hooks for the reclaimer and the event publisher ----------------------------------------

    def add_listener(self, listener: CacheListener) -> None:
        """Hooks called after each change committed (:class:`~kvcm.cache.listeners.CacheListener`)."""
        self.listeners.add(listener)

    def remove_listener(self, listener: CacheListener) -> None:
        self.listeners.remove(listener)

    def set_room_maker(self, maker: RoomMaker | None, limit: int = 4096) -> None:
        """In-line eviction (:mod:`kvcm.cache.room`): a write that meets its group's quota asks
        ``maker`` for at most ``limit`` victims (``reclaim.inline_max_blocks``) and marks them
        ``deleting`` in its own transaction. ``None``: such a write is refused
        ``QUOTA_EXCEEDED`` (what ``reclaim.inline = false`` means). Set it before serving."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise ValueError(f"in-line eviction limit must be a positive integer, got {limit!r}")
        self.room_maker = maker
        self.inline_limit = limit

    def usage(self, group: str) -> GroupUsage:
        """Committed usage of ``group`` (bytes and location counts, by type and instance)."""
        return self.usage_book.usage(group)

    def usage_net_of_frees(self, groups: Iterable[str]) -> dict[str, tuple[int, dict[str, int]]]:
        """Per group, ``(bytes, {type: bytes})`` in use and *not* already marked ``deleting``:
        what the reclaimer must bring under the watermark. Usage and the pending deletes are
        read from one snapshot, so they agree (the in-memory counters change on commit
        callbacks, the being-freed count before the deleter's commit: read apart, a free in
        between would make the group look fuller than it is, and the reclaimer evict twice)."""
        out: dict[str, tuple[int, dict[str, int]]] = {}
        with self.store.read() as view:
            freeing = pending_bytes(view)
            for group in groups:
                total, by_type = Usage.group_used(view, group)
                for (g, kind), nbytes in freeing.items():
                    if g == group:
                        total -= nbytes
                        by_type[kind] = by_type.get(kind, 0) - nbytes
                out[group] = (total, by_type)
        return out

    def evict(self, instance_id: str, keys: list[int], storage_type: str | None = None) -> int:
        return removal.evict(self, instance_id, keys, storage_type)

    def instances_of_group(self, group: str) -> list[str]:
        return [i.instance_id for i in self.registry.list_instances(group)]

    def serving_keys(self, instance_id: str) -> Iterator[tuple[int, int, str, float, int | None]]:
        """``(key, nbytes, storage type, written_at, parent)`` of every serving copy, read in
        chunks of short transactions (the parent lets ``leaf_lru`` rebuilt at start-up know
        which blocks are leaves)."""
        for chunk in self.index.chunks(self.namespace_of(instance_id)):
            for key, value in chunk:
                record = decode(value)
                for loc in record.locs:
                    if loc.status == Status.SERVING:
                        yield key, loc.nbytes, loc.type, loc.written, record.parent

    # -- consistency ----------------------------------------------------------------------------

    def recount(self) -> dict[Key, list[int]]:
        """Usage recomputed from the block records (tests, tools)."""
        return consistency.recount(self)

    def check(self) -> None:
        """Assert the data plane's invariants on a quiet server (see :mod:`kvcm.cache.consistency`).
        Frees the deleter has queued are done first (its next wake-up would do them)."""
        self.deleter.free_queued()
        consistency.check(self)
        with self.store.read() as view:
            self.pins.check(view, [i.instance_id for i in self.registry.list_instances()])
        recounted = self.recount_inflight()
        assert self.inflight.snapshot() == recounted, \
            f"in-flight counters {self.inflight.snapshot()} != recount {recounted}"

    def recount_inflight(self) -> dict[str, list[int]]:
        """``{instance: [open sessions, writing bytes]}`` recomputed from the store (tests, tools)."""
        owner: dict[str, str] = {}
        out: dict[str, list[int]] = {}
        with self.store.read() as view:
            for _, raw in view.scan(SESSIONS):
                session = decode_session(raw)
                owner[session.id] = session.instance
                out.setdefault(session.instance, [0, 0])[0] += 1
        for chunk in self.all_chunks():
            for _, value in chunk:
                for loc in decode(value).locs:
                    if loc.status == Status.WRITING:
                        out.setdefault(owner.get(loc.session, "?"), [0, 0])[1] += loc.nbytes
        return {k: v for k, v in out.items() if v[0] or v[1]}
