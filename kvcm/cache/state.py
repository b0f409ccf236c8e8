"""The parts every data-plane operation shares, and the registry as the data plane sees it.

:class:`CacheState` is what :mod:`.lookup`, :mod:`.writes`, :mod:`.removal` and
:mod:`.consistency` take: the store, the meta index, the storage pool, sessions, usage and the
bytes being freed, the deleter, the listeners, the soft pins (:mod:`.pins`), the room maker of
in-line eviction (:mod:`.room`), the write limits, and cached views of instances and groups. It
knows no operation; :class:`kvcm.cache.manager.CacheManager` is the facade that adds them, so
every call goes down from the facade to the operations to this module, never back up.

Thread ownership is the manager's (see :mod:`kvcm.cache.manager`); the views here are filled on
the RPC thread and dropped from a registry change callback (dict operations the GIL keeps atomic).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter

from kvcm.backends.metastore.base import MetaStore, ReadTxn, WriteTxn, i64
from kvcm.cache.deleter import Deleter
from kvcm.cache.listeners import Listeners
from kvcm.cache.locations import load as load_skeletons
from kvcm.cache.meta_index import DB as BLOCKS
from kvcm.cache.meta_index import MetaIndex, namespace
from kvcm.cache.pins import Pins
from kvcm.cache.placement import GroupView, InstanceView
from kvcm.cache.record_codec import RUNS_DB, Record, check_value, decode, encode
from kvcm.cache.room import RoomMaker
from kvcm.cache.sessions import InFlightStats, Sessions
from kvcm.cache.storage_pool import StoragePool
from kvcm.cache.usage import BeingFreed, Usage
from kvcm.config import CacheConfig, StoreConfig
from kvcm.control.registry import GROUP, INSTANCE, Registry
from kvcm.errors import Code, InvalidArgument, NotFound, Unavailable

#: Keys a lookup takes per lock batch (the index's lock granularity; no setting).
BATCH_SIZE = 16


class LostCounter:
    """``kvcm_blocks_lost_total{source}``: copies found without their bytes (startup scan,
    periodic scan, client report). Kept in memory too, for tools and tests."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.counts: dict[str, int] = defaultdict(int)
        self._metric: Counter | None = None
        if registry is not None:
            self._metric = Counter("kvcm_blocks_lost", "Block copies whose bytes were found gone (no longer served)",
                                   ["source"], registry=registry)

    def add(self, source: str, n: int) -> None:
        self.counts[source] += n
        if self._metric is not None:
            self._metric.labels(source=source).inc(n)


class CacheState:
    """Shared data-plane state; see the module docstring."""

    def __init__(
        self,
        store: MetaStore,
        registry: Registry,
        pool: StoragePool,
        config: CacheConfig = CacheConfig(),
        *,
        index: StoreConfig = StoreConfig(),
        metrics_registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``config``: the ``[cache]`` settings; ``index``: the ``[store]`` settings of the
        block index (its lock shards and search cache)."""
        self.store = store
        self.registry = registry
        self.pool = pool
        self.clock = clock
        self.monotonic = monotonic
        self.default_write_timeout = config.write_timeout_seconds
        self.max_write_timeout = config.max_write_timeout_seconds
        self.max_open_sessions = config.max_open_sessions_per_instance
        self.max_writing_bytes = config.max_writing_bytes_per_instance
        self.runs = config.runs
        self.index = MetaIndex(store, index.lock_shards, BATCH_SIZE, index.search_cache_size, encode, decode, check_value,
                               tag=_run_of, drop_tag=_drop_run)
        load_skeletons(store)  # before any record is read: their locations name skeletons
        self.usage_book = Usage()
        self.being_freed = BeingFreed()
        # In-line eviction (kvcm.cache.room): None = a full group refuses QUOTA_EXCEEDED and
        # waits for the reclaimer's round; ``inline_limit`` = most victims per request.
        self.room_maker: RoomMaker | None = None
        self.inline_limit = 4096
        self.sessions = Sessions(clock, monotonic)
        self.inflight = self.sessions.inflight
        if metrics_registry is not None:
            metrics_registry.register(InFlightStats(self.inflight))
        self.lost = LostCounter(metrics_registry)
        self.lost_scan_s = config.lost_scan_s
        self.next_lost_scan = monotonic() + config.lost_scan_s  # the deleter thread's schedule
        self.deleter = Deleter(store, self.index, self.usage_book.add, pool.get, clock, being_freed=self.being_freed)
        self.listeners = Listeners()
        self.pins = Pins(config.max_pins_per_instance, config.max_pin_ttl_s)
        self.known: dict[str, str] = {}  # instance id -> group, kept after removal (purges)
        self.purges: list[str] = []
        self._views: dict[str, InstanceView] = {}
        self._groups: dict[str, GroupView] = {}
        registry.on_change(self._on_registry_change)

    # -- the registry as the data plane sees it -------------------------------------------------

    def instance(self, instance_id: str) -> InstanceView:
        """:raises NotFound: INSTANCE_NOT_EXIST."""
        view = self._views.get(instance_id)
        if view is None:
            if not instance_id:
                raise InvalidArgument("instance_id: required")
            view = InstanceView.of(self.registry.get_instance(instance_id))
            self._views[instance_id] = view
            self.known[instance_id] = view.group
        if self.purges and instance_id in self.purges:
            # Removed and registered again before the deleter purged the old blocks: the purge
            # takes every block of the namespace, so a block written now would go with them.
            raise Unavailable(f"instance {instance_id[:200]!r} was removed and registered again; its old blocks "
                              "are being purged: retry in a moment", Code.SERVICE_NOT_READY)
        return view

    def group_view(self, name: str) -> GroupView:
        view = self._groups.get(name)
        if view is None:
            view = self._groups[name] = GroupView.of(self.registry.get_group(name))
        return view

    def registered(self, instance_id: str) -> bool:
        try:
            self.registry.get_instance(instance_id)
        except NotFound:
            return False
        return True

    def delay(self, group: str) -> float:
        """The group's grace before a ``deleting`` copy is freed, in seconds (0: group gone)."""
        try:
            return self.group_view(group).delay_ms / 1000.0
        except NotFound:
            return 0.0

    def owners(self) -> dict[bytes, tuple[str, str]]:
        """Namespace -> (group, instance) of every instance known since start."""
        owners = {namespace(i): (g, i) for i, g in self.known.items()}
        for inst in self.registry.list_instances():
            owners[namespace(inst.instance_id)] = (inst.instance_group, inst.instance_id)
        return owners

    def _on_registry_change(self, kind: str, name: str) -> None:
        if kind == INSTANCE:
            self._views.pop(name, None)
            if not self.registered(name):
                self.pins.forget(name)  # its pins go with it (rows: at the next pin sweep)
                if name in self.known:
                    self.purges.append(name)  # its blocks go: the deleter thread purges them
        elif kind == GROUP:
            self._groups.pop(name, None)

    # -- records --------------------------------------------------------------------------------

    @staticmethod
    def namespace_of(instance_id: str) -> bytes:
        return namespace(instance_id)

    def records_in(self, view: ReadTxn, ns: bytes, keys: Sequence[int]) -> list[Record | None]:
        """Records as ``view`` sees them, bypassing the search cache (write paths)."""
        get = view.get
        return [None if (raw := get(BLOCKS, ns + i64(k))) is None else decode(raw) for k in keys]

    def all_chunks(self, size: int = 4096) -> Iterator[list[tuple[bytes, bytes]]]:
        """Every block record, ``(db key, value)``, in chunks of short read transactions."""
        start = b""
        while True:
            with self.store.read() as view:
                chunk = list(view.scan(BLOCKS, start=start, limit=size + 1))
            yield chunk[:size]
            if len(chunk) <= size:
                return
            start = chunk[size][0]


def _run_of(record: Record) -> int | None:
    return record.run


def _drop_run(txn: WriteTxn, ns: bytes, first: int) -> None:
    txn.delete(RUNS_DB, ns + i64(first))
