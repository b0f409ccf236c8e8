"""CacheManager: the data plane (Tair KVCM's cache RPCs, with its known weaknesses fixed).

The RPC operations live in :mod:`kvcm.cache.lookup` (reads) and :mod:`kvcm.cache.writes` (two-phase
writes); this module holds the shared state and everything that marks blocks ``deleting``
(``remove_cache``, ``trim_cache``, :meth:`CacheManager.evict`, instance purges), recovery at
start-up, and the hooks other parts of kvcm use (listeners, usage, serving keys).

Thread ownership: RPC operations and the session-expiry timer run on the RPC thread;
:meth:`CacheManager.background_once` (deletes, purges) on the deleter thread;
:meth:`evict` / :meth:`serving_keys` / :meth:`usage` on the reclaimer thread. Every thread
brings its own store transactions; in-memory state changes only in ``txn.on_commit`` callbacks
or under the GIL-atomic operations noted where they happen.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvcm.backends.base import MetaStore, ReadTxn, WriteTxn, from_i64, i64
from kvcm.cache import consistency, lookup, writes
from kvcm.cache.storage_pool import StoragePool
from kvcm.deleter import Deleter, schedule
from kvcm.errors import InvalidArgument, NotFound
from kvcm.index import DB as BLOCKS
from kvcm.index import KEEP, MetaIndex, namespace
from kvcm.locations import load as load_skeletons
from kvcm.masks import BlockMask, check_mask, derive_keys, unmasked_indices
from kvcm.proto.wire import Raw
from kvcm.records import (
    RUNS_DB,
    Location,
    Record,
    Status,
    check_value,
    decode,
    encode,
)
from kvcm.registry import GROUP, INSTANCE, Registry
from kvcm.selection import GroupView, InstanceView
from kvcm.sessions import DB as SESSIONS
from kvcm.sessions import InFlightStats, Sessions, decode_session
from kvcm.usage import Key, Usage

log = logging.getLogger("kvcm.manager")


class LostCounter:
    """``kvcm_blocks_lost_total{source}``: copies found without their bytes (startup scan,
    periodic scan, client report). Kept in memory too, for tools and tests."""

    def __init__(self, registry: Any = None) -> None:
        self.counts: dict[str, int] = defaultdict(int)
        self._metric: Any = None
        if registry is not None:
            from prometheus_client import Counter

            self._metric = Counter("kvcm_blocks_lost", "Block copies whose bytes were found gone (no longer served)",
                                   ["source"], registry=registry)

    def add(self, source: str, n: int) -> None:
        self.counts[source] += n
        if self._metric is not None:
            self._metric.labels(source=source).inc(n)


TRIM_STRATEGIES = ("remove_all_cache", "remove_all_meta", "timestamp")


class CacheManager:
    """Block metadata of every instance; see the module docstring for thread ownership."""

    def __init__(
        self,
        store: MetaStore,
        registry: Registry,
        pool: StoragePool,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        default_write_timeout: float = 30.0,
        max_write_timeout: float = 600.0,
        max_open_sessions: int = 1024,
        max_writing_bytes: int = 16 << 30,
        metrics_registry: Any = None,
        lost_scan_s: float = 60.0,
        lock_shards: int = 64,
        cache_size: int = 65536,
        batch_size: int = 16,
        runs: bool = True,
    ) -> None:
        self.store = store
        self.registry = registry
        self.pool = pool
        self.clock = clock
        self.default_write_timeout = default_write_timeout
        self.max_write_timeout = max_write_timeout
        self.max_open_sessions = max_open_sessions
        self.max_writing_bytes = max_writing_bytes
        self.runs = runs
        self.index = MetaIndex(store, lock_shards, batch_size, cache_size, encode, decode, check_value,
                               tag=_run_of, drop_tag=_drop_run)
        load_skeletons(store)  # before any record is read: their locations name skeletons
        self.usage_book = Usage()
        self.sessions = Sessions(clock, monotonic)
        self.inflight = self.sessions.inflight
        if metrics_registry is not None:
            metrics_registry.register(InFlightStats(self.inflight))
        self.lost = LostCounter(metrics_registry)
        self.lost_scan_s = lost_scan_s
        self._next_lost_scan = monotonic() + lost_scan_s
        self._monotonic = monotonic
        self.deleter = Deleter(store, self.index, self.usage_book.add, pool.get, clock)
        self._views: dict[str, InstanceView] = {}
        self._groups: dict[str, GroupView] = {}
        self._known: dict[str, str] = {}  # instance id -> group, kept after removal (purges)
        self._purges: list[str] = []
        self._listeners: list[Any] = []
        registry.on_change(self._on_registry_change)

    # -- start-up -------------------------------------------------------------------------------

    def start(self) -> None:
        """Recover: open storages, load counters and sessions, reserve every URI the metadata
        holds (the storages rebuild their free space from it), queue purges of instances that
        were removed while blocks remained."""
        self.pool.open_all()
        owner: dict[str, str] = {}
        with self.store.read() as view:
            self.usage_book.load(view)
            self.sessions.load(view, owner)
        self._reserve_all(owner)
        for registered in self.registry.list_instances():
            self._known[registered.instance_id] = registered.instance_group
        for group, instance_id, _ in self.usage_book.snapshot():
            self._known.setdefault(instance_id, group)
            if not self._registered(instance_id) and instance_id not in self._purges:
                self._purges.append(instance_id)

    def _reserve_all(self, owner: dict[str, str]) -> None:
        """Reserve every recorded URI, sweep the rest, and count ``writing`` bytes per instance
        (``owner``: session id -> instance; a writing copy always names its live session)."""
        by_storage: dict[str, list[str]] = defaultdict(list)
        inflight = self.inflight.snapshot()
        for chunk in self._all_chunks():
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
                if getattr(backend, "damaged", lambda: False)():
                    self.mark_lost(name, backend.lost, "startup")
                removed = backend.sweep()
                if removed:
                    log.info("storage %r: removed %d container(s) no block refers to", name, removed)
            except Exception:
                log.exception("recovering storage %r failed", name)

    def _all_chunks(self, size: int = 4096) -> Iterator[list[tuple[bytes, bytes]]]:
        start = b""
        while True:
            with self.store.read() as view:
                chunk = list(view.scan(BLOCKS, start=start, limit=size + 1))
            yield chunk[:size]
            if len(chunk) <= size:
                return
            start = chunk[size][0]

    # -- registry facts -------------------------------------------------------------------------

    def instance(self, instance_id: str) -> InstanceView:
        """:raises NotFound: INSTANCE_NOT_EXIST."""
        view = self._views.get(instance_id)
        if view is None:
            if not instance_id:
                raise InvalidArgument("instance_id: required")
            view = InstanceView.of(self.registry.get_instance(instance_id))
            self._views[instance_id] = view
            self._known[instance_id] = view.group
        return view

    def group_view(self, name: str) -> GroupView:
        view = self._groups.get(name)
        if view is None:
            view = self._groups[name] = GroupView.of(self.registry.get_group(name))
        return view

    def _registered(self, instance_id: str) -> bool:
        try:
            self.registry.get_instance(instance_id)
        except NotFound:
            return False
        return True

    @staticmethod
    def namespace_of(instance_id: str) -> bytes:
        return namespace(instance_id)

    def _on_registry_change(self, kind: str, name: str) -> None:
        if kind == INSTANCE:
            self._views.pop(name, None)
            if not self._registered(name) and name in self._known:
                self._purges.append(name)  # its blocks go: the deleter thread purges them
        elif kind == GROUP:
            self._groups.pop(name, None)

    def records_in(self, view: ReadTxn, ns: bytes, keys: Sequence[int]) -> list[Record | None]:
        """Records as ``view`` sees them, bypassing the search cache (write paths)."""
        get = view.get
        return [None if (raw := get(BLOCKS, ns + i64(k))) is None else decode(raw) for k in keys]

    # -- RPC operations -------------------------------------------------------------------------

    def get_cache_location(self, instance_id: str, query_type: str, block_keys: Sequence[int] | None,
                           token_ids: Sequence[int] | None, mask: BlockMask | None, sw_size: int = 0,
                           spec_names: Sequence[str] | None = None) -> Raw:
        return lookup.get_cache_location(self, instance_id, query_type, block_keys, token_ids, mask, sw_size, spec_names)

    def get_cache_meta(self, instance_id: str, block_keys: Sequence[int] | None, token_ids: Sequence[int] | None,
                       mask: BlockMask | None, detail_level: int = 0) -> dict[str, Any]:
        return lookup.get_cache_meta(self, instance_id, block_keys, token_ids, mask, detail_level)

    def start_write_cache(self, instance_id: str, block_keys: Sequence[int] | None, token_ids: Sequence[int] | None,
                          spec_group_names: Sequence[str] | None = None, timeout: float | None = None) -> Raw:
        return writes.start_write_cache(self, instance_id, block_keys, token_ids, spec_group_names, timeout)

    def finish_write_cache(self, instance_id: str, session_id: str, success: BlockMask | None) -> dict[str, Any]:
        return writes.finish_write_cache(self, instance_id, session_id, success)

    def remove_cache(self, instance_id: str, block_keys: Sequence[int] | None, token_ids: Sequence[int] | None,
                     mask: BlockMask | None) -> dict[str, Any]:
        """Mark every copy of the unmasked keys ``deleting`` now; the deleter frees them after
        the group's ``delay_before_delete_ms`` (readers that already hold URIs get that grace)."""
        inst = self.instance(instance_id)
        keys = derive_keys(block_keys, token_ids, inst.block_size)
        mask = check_mask(mask, len(keys), destructive=True)
        keys = [keys[i] for i in unmasked_indices(mask, len(keys))]
        with self.store.write() as txn:
            marked, _ = self._mark_deleting(txn, inst.instance_id, inst.group, keys, self._delay(inst.group))
        return {"removed": marked}

    def trim_cache(self, instance_id: str, strategy: str, begin_us: int = 0, end_us: int = 0) -> dict[str, Any]:
        """``remove_all_cache``: every block, freed after the delay; ``remove_all_meta``: forget
        the metadata now (space is released, data left as is); ``timestamp``: blocks last
        modified in ``[begin_timestamp, end_timestamp)`` (wall-clock µs, end 0 = no bound)."""
        inst = self.instance(instance_id)
        if strategy not in TRIM_STRATEGIES:
            raise InvalidArgument(f"strategy: {strategy!r} is not one of {', '.join(TRIM_STRATEGIES)}")
        _check_trim_range(strategy, begin_us, end_us)
        with self.store.write() as txn:
            items = list(self.index.scan(txn, inst.ns))
            if strategy == "remove_all_meta":
                return {"removed": self._forget_all(txn, inst, items)}
            keys = [k for k, v in items if strategy == "remove_all_cache" or _in_range(v, begin_us, end_us)]
            marked, _ = self._mark_deleting(txn, inst.instance_id, inst.group, keys, self._delay(inst.group))
            if strategy == "remove_all_cache":
                txn.on_commit(lambda: self._emit("on_cleared", inst.instance_id))
        return {"removed": marked}

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

    # -- marking deleting -----------------------------------------------------------------------

    def _delay(self, group: str) -> float:
        try:
            return self.group_view(group).delay_ms / 1000.0
        except NotFound:
            return 0.0

    def _mark_deleting(self, txn: WriteTxn, instance_id: str, group: str, keys: Sequence[int], delay: float,
                       serving_only: bool = False, storage_type: str | None = None,
                       only: Callable[[int, Location], bool] | None = None) -> tuple[int, int]:
        """CAS copies to ``deleting`` and schedule their free; ``(copies marked, serving bytes)``.

        ``serving_only`` (eviction) never touches ``writing`` copies; ``only(key, location)``
        picks the copies to mark (lost ones)."""
        now = self.clock()
        marked: list[tuple[int, str]] = []
        gone: list[int] = []
        freed = [0, 0]  # serving bytes, writing bytes

        def modify(_: int, key: int, record: Record | None) -> Any:
            if record is None:
                return KEEP
            had = any(x.status == Status.SERVING for x in record.locs)
            for loc in record.locs:
                if loc.status == Status.DELETING or (serving_only and loc.status != Status.SERVING):
                    continue
                if storage_type is not None and loc.type != storage_type:
                    continue
                if only is not None and not only(key, loc):
                    continue
                if loc.status == Status.SERVING:
                    freed[0] += loc.nbytes
                elif loc.status == Status.WRITING:
                    freed[1] += loc.nbytes
                loc.status = Status.DELETING
                marked.append((key, loc.id))
            if had and not any(x.status == Status.SERVING for x in record.locs):
                gone.append(key)
            if not marked or marked[-1][0] != key:
                return KEEP
            record.updated = now
            return record

        self.index.read_modify_write(txn, namespace(instance_id), list(dict.fromkeys(keys)), modify)
        for key, loc_id in marked:
            schedule(txn, now + delay, group, instance_id, key, loc_id)
        self.inflight.release(txn, instance_id, 0, freed[1])
        if gone:
            txn.on_commit(lambda: self._emit("on_removed", instance_id, gone))
        return len(marked), freed[0]

    def _forget_all(self, txn: WriteTxn, inst: InstanceView, items: list[tuple[int, bytes]]) -> int:
        released: dict[str, list[str]] = defaultdict(list)
        deltas: dict[Key, list[int]] = defaultdict(lambda: [0, 0])
        writing = 0
        for _key, value in items:
            for loc in decode(value).locs:
                released[loc.storage].extend(loc.uris())
                writing += loc.nbytes if loc.status == Status.WRITING else 0
                deltas[(inst.group, inst.instance_id, loc.type)][0] -= loc.nbytes
                deltas[(inst.group, inst.instance_id, loc.type)][1] -= 1
        self.index.read_modify_write(txn, inst.ns, [k for k, _ in items], lambda i, k, r: None)
        self.usage_book.add(txn, dict(deltas))
        self.inflight.release(txn, inst.instance_id, 0, writing)

        def release() -> None:
            for name, uris in released.items():
                backend = self.pool.get(name)
                if backend is not None:
                    backend.release(uris)
            self._emit("on_cleared", inst.instance_id)

        txn.on_commit(release)
        return sum(-d[1] for d in deltas.values())

    # -- lost blocks ------------------------------------------------------------------------------

    def mark_lost(self, storage: str, lost: Callable[[list[str]], set[str]], source: str) -> int:
        """Every copy on ``storage`` with a URI ``lost(uris)`` names (its bytes are gone) becomes
        ``deleting`` at once: no query returns it again, its key is writable again, and the
        deleter releases its slots and usage. One pass over every record (rare: only when a
        storage reports damage). Returns the copies marked, counted in ``kvcm_blocks_lost_total``."""
        hits: dict[bytes, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
        for chunk in self._all_chunks():
            for dbkey, value in chunk:
                for loc in decode(value).locs:
                    if loc.storage == storage and loc.status != Status.DELETING and lost(loc.uris()):
                        hits[dbkey[:8]][from_i64(dbkey[8:])].add(loc.id)
        owners = self.owners()
        marked = 0
        for ns, by_key in hits.items():
            group, instance_id = owners.get(ns, ("", ""))
            if not instance_id:
                continue
            with self.store.write() as txn:
                marked += self._mark_deleting(txn, instance_id, group, list(by_key), 0.0, only=_picked(by_key))[0]
        if marked:
            log.warning("storage %r: %d cop(ies) lost their bytes (%s); no longer served", storage, marked, source)
            self.lost.add(source, marked)
        return marked

    def report_lost(self, instance_id: str, block_keys: Sequence[int] | None, token_ids: Sequence[int] | None,
                    mask: BlockMask | None) -> dict[str, Any]:
        """A client could not read these blocks (``report_lost``): their serving copies become
        ``deleting`` now (no grace delay: the bytes are bad for every reader) and count as lost."""
        inst = self.instance(instance_id)
        keys = derive_keys(block_keys, token_ids, inst.block_size)
        mask = check_mask(mask, len(keys), destructive=True)
        keys = [keys[i] for i in unmasked_indices(mask, len(keys))]
        with self.store.write() as txn:
            marked, _ = self._mark_deleting(txn, inst.instance_id, inst.group, keys, 0.0, serving_only=True)
            if marked:
                txn.on_commit(lambda: self.lost.add("client", marked))
        return {"lost": marked}

    def scan_lost(self) -> int:
        """Ask every storage that can look (``rescan``) whether containers vanished or shrank,
        and mark the copies in them lost. Deleter thread, every ``cache.lost_scan_s``."""
        marked = 0
        for name in self.pool.names():
            backend = self.pool.get(name)
            if backend is None or not hasattr(backend, "rescan") or not backend.rescan():
                continue
            marked += self.mark_lost(name, backend.lost, "scan")
        return marked

    # -- background (deleter thread) ------------------------------------------------------------

    def background_once(self) -> int:
        """Deleter thread body: purge removed instances, look for lost blocks when due, then
        free due deletes."""
        if self.lost_scan_s > 0 and self._monotonic() >= self._next_lost_scan:
            self._next_lost_scan = self._monotonic() + self.lost_scan_s
            try:
                self.scan_lost()
            except Exception:
                log.exception("looking for lost blocks failed")
        while self._purges:
            instance_id = self._purges[0]
            self.purge_instance(instance_id)
            self._purges.pop(0)
        return self.deleter.run_once()

    def purge_instance(self, instance_id: str) -> int:
        """Schedule the free of every copy of a removed instance (no delay: nobody can read them)."""
        group = self._known.get(instance_id, "")
        ns = namespace(instance_id)
        marked = 0
        for chunk in self.index.chunks(ns):
            with self.store.write() as txn:
                marked += self._mark_deleting(txn, instance_id, group, [k for k, _ in chunk], 0.0)[0]
        self._emit("on_cleared", instance_id)
        return marked

    # -- hooks for the reclaimer and the event publisher ----------------------------------------

    def add_listener(self, obj: Any) -> None:
        """``obj`` may implement ``on_serving``, ``on_read``, ``on_removed``, ``on_stored``,
        ``on_cleared``, ``on_evicted`` (see the README, "Data plane"); each is called after the change
        committed."""
        self._listeners.append(obj)

    def _emit(self, name: str, *args: Any) -> None:
        for obj in self._listeners:
            fn = getattr(obj, name, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception:
                log.exception("listener %s.%s failed", type(obj).__name__, name)

    def notify_read(self, instance_id: str, keys: list[int]) -> None:
        if self._listeners:
            self._emit("on_read", instance_id, keys, self.clock())

    def notify_served(self, instance_id: str, served: list[tuple[int, Any, int | None]], now: float) -> None:
        if not self._listeners:
            return
        for key, loc, parent in served:
            self._emit("on_serving", instance_id, key, loc.nbytes, loc.type, parent, now)
        self._emit("on_stored", instance_id, [k for k, _, _ in served], served[0][2], None)

    def usage(self, group: str) -> dict[str, Any]:
        """Committed usage of ``group`` (bytes and location counts, by type and instance)."""
        return self.usage_book.usage(group)

    def evict(self, instance_id: str, keys: list[int], storage_type: str | None = None) -> int:
        """Reclaimer: ``serving -> deleting`` by CAS (never ``writing``), freed after the group's
        delay. Returns the bytes reclaimed."""
        group = self._known.get(instance_id) or self.instance(instance_id).group
        delay = self._delay(group)
        with self.store.write() as txn:
            _, freed = self._mark_deleting(txn, instance_id, group, keys, delay,
                                           serving_only=True, storage_type=storage_type)
            if freed and self._listeners:
                txn.on_commit(lambda: self._emit("on_evicted", instance_id, list(keys), delay))
        return freed

    def instances_of_group(self, group: str) -> list[str]:
        return [i.instance_id for i in self.registry.list_instances(group)]

    def serving_keys(self, instance_id: str) -> Iterator[tuple[int, int, str, float]]:
        """``(key, nbytes, storage type, written_at)`` of every serving copy, read in chunks of
        short transactions."""
        for chunk in self.index.chunks(namespace(instance_id)):
            for key, value in chunk:
                for loc in decode(value).locs:
                    if loc.status == Status.SERVING:
                        yield key, loc.nbytes, loc.type, loc.written

    # -- consistency ----------------------------------------------------------------------------

    def recount(self) -> dict[Key, list[int]]:
        """Usage recomputed from the block records (tests, tools)."""
        return consistency.recount(self)

    def check(self) -> None:
        """Assert the data plane's invariants on a quiet server (see :mod:`kvcm.cache.consistency`)."""
        consistency.check(self)
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
        for chunk in self._all_chunks():
            for _, value in chunk:
                for loc in decode(value).locs:
                    if loc.status == Status.WRITING:
                        out.setdefault(owner.get(loc.session, "?"), [0, 0])[1] += loc.nbytes
        return {k: v for k, v in out.items() if v[0] or v[1]}

    def owners(self) -> dict[bytes, tuple[str, str]]:
        """Namespace -> (group, instance) of every instance known since start."""
        owners = {namespace(i): (g, i) for i, g in self._known.items()}
        for inst in self.registry.list_instances():
            owners[namespace(inst.instance_id)] = (inst.instance_group, inst.instance_id)
        return owners

    def all_chunks(self, size: int = 4096) -> Iterator[list[tuple[bytes, bytes]]]:
        """Every block record, ``(db key, value)``, in chunks of short read transactions."""
        return self._all_chunks(size)


def _picked(by_key: dict[int, set[str]]) -> Callable[[int, Location], bool]:
    """A ``_mark_deleting`` filter: the copies whose ids ``by_key`` lists for their key."""
    return lambda key, loc: loc.id in by_key.get(key, ())


def _run_of(record: Record) -> int | None:
    return record.run


def _drop_run(txn: WriteTxn, ns: bytes, first: int) -> None:
    txn.delete(RUNS_DB, ns + i64(first))


def _check_trim_range(strategy: str, begin_us: int, end_us: int) -> None:
    """A trim's range only ever narrows it: a range that is inverted, negative, empty for
    ``timestamp`` or given to another strategy (which would ignore it) is refused, never read
    as "every block"."""
    if begin_us < 0 or end_us < 0:
        raise InvalidArgument("begin_timestamp/end_timestamp: must not be negative")
    if strategy != "timestamp":
        if begin_us or end_us:
            raise InvalidArgument(f"begin_timestamp/end_timestamp: only for strategy 'timestamp', not {strategy!r}")
        return
    if not begin_us and not end_us:
        raise InvalidArgument("begin_timestamp/end_timestamp: strategy 'timestamp' needs at least one of them "
                              "(remove_all_cache removes every block)")
    if end_us and end_us <= begin_us:
        raise InvalidArgument("begin_timestamp/end_timestamp: need begin < end (end 0 = open)")


def _in_range(value: bytes, begin_us: int, end_us: int) -> bool:
    updated_us = int(decode(value).updated * 1e6)
    return updated_us >= begin_us and (not end_us or updated_us < end_us)
