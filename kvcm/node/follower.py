"""A follower's serving stage (``ha.enabled``): reads from the shared store, refusals for the rest.

A follower answers ``check_health`` and ``get_manager_cluster_info`` itself; with
``ha.follower_reads`` (the default) it also answers the read RPCs (:data:`READS`) from the store
it shares with the leader (Redis, or on one host the LMDB environment of a shared data dir), so
read load spreads over the nodes; everything else is ``SERVER_NOT_LEADER`` naming the leader,
which clients follow.

Freshness: at the start of each loop turn that brought requests (so before any of them runs)
the follower asks the store for the version of every database it mirrors in memory (each leader
commit counts one more version per database it touched; one ``HMGET`` on Redis, one read
transaction on LMDB): a changed registry is read again (and its observers told), new location
skeletons are loaded, and a changed block database clears the search cache. So a read sent to a
follower after the leader acknowledged a write sees that write. On Redis a read is several round
trips and not one snapshot: a commit landing between them may be seen in part, like a read made
during it.

What a follower does not do: it writes nothing (its store refuses every commit), opens no
storage backend (the leader owns the storages' directories and lock files), runs no background
work, and its reads do not feed the leader's eviction recency.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvcm.backends.metastore import DataDirLocked
from kvcm.backends.metastore.base import MetaStore
from kvcm.config import Config
from kvcm.errors import KvcmError, Unavailable
from kvcm.http import SideHttp, SidePort
from kvcm.metrics import Metrics
from kvcm.node.stores import open_engine_store
from kvcm.proto.methods import FOLLOWER_READS
from kvcm.proto.wire import Encodable
from kvcm.rpc.curve import CurveServer, serve_curve
from kvcm.rpc.dispatch import Dispatcher, Method
from kvcm.rpc.server import Server, Timer
from kvcm.version import __version__

if TYPE_CHECKING:
    from kvcm.control.registry import Registry
    from kvcm.engines.service import EngineService
    from kvcm.ha.campaign import Campaign
    from kvcm.rpc.auth import Authenticator

log = logging.getLogger("kvcm.follower")

REFRESH_S = 1.0  # how often an idle follower looks for what the leader changed
RETRY_READS_S = 2.0  # how long a follower stage without reads serves before it tries them again

#: What a follower answers from the shared store (with ``ha.follower_reads``).
READS = FOLLOWER_READS

class FollowedStore(MetaStore, Protocol):
    """The leader's store as a follower reads it (Redis, or the LMDB of a shared data dir)."""

    def versions(self, dbs: Sequence[str]) -> tuple[int, ...]:
        """How many commits touched each of ``dbs`` so far: a changed number means stale caches."""
        ...


@runtime_checkable
class Marked(Protocol):
    """A followed store that names its last commit in one cheap call (Redis: one GET), so a turn
    in which nothing was committed costs no read of every database's version."""

    def commit_marker(self) -> bytes | None:
        """The last commit's id; None when it cannot tell (no commit yet, or emptied)."""
        ...


#: Facts about a node, as check_health / get_manager_cluster_info report them.
Info = Callable[[], dict[str, Encodable]]
#: Turns a follower's method table into the one it serves, given the registry its reads use.
Shape = Callable[[list[Method], "Registry | None", "Authenticator | None"], list[Method]]


class FollowerReads:
    """The read side of the data plane over the shared store, kept fresh by its versions."""

    def __init__(self, config: Config, store: FollowedStore, data_dir: str, metrics: Metrics,
                 engine_dir: str | None) -> None:
        """``engine_dir``: where this node keeps its own engine index (None: in memory, when the
        data dir is the leader's too)."""
        from kvcm.cache.locations import DB as SKELETONS
        from kvcm.cache.manager import CacheManager
        from kvcm.cache.meta_index import DB as BLOCKS_DB
        from kvcm.cache.record_codec import RUNS_DB
        from kvcm.cache.storage_pool import StoragePool
        from kvcm.control.registry import Registry
        from kvcm.engines.service import DEFINITIONS
        from kvcm.rpc.auth import Authenticator

        self.store = store
        self.config = config
        self.registry = Registry(store, None, config.storage.allowed_roots)
        self.authorize = Authenticator(self.registry, config.auth)
        with ExitStack() as undo:  # a failed build closes what it opened
            undo.callback(store.close)
            undo.callback(self.authorize.close)
            self.engine_store = open_engine_store(config.store, config.events, engine_dir)
            undo.callback(self.engine_store.close)
            self.engines = self._build_engines(metrics)
            undo.callback(self.engines.stop)
            self.storages = StoragePool(self.registry, data_dir)
            self.cache = CacheManager(store, self.registry, self.storages, config.cache, index=config.store,
                                      metrics_registry=metrics.registry)
            self.storages.follow()
            undo.pop_all()
        self._registry_dbs = self.registry.databases
        self._dbs = (*self._registry_dbs, DEFINITIONS, SKELETONS, BLOCKS_DB, RUNS_DB)
        self._marker_of = store.commit_marker if isinstance(store, Marked) else None  # decided once
        self._marker = self._marker_of() if self._marker_of is not None else None
        self._seen = store.versions(self._dbs)
        self.refreshes = 0  # how often a read found the leader had changed something (tests, logs)

    def _build_engines(self, metrics: Metrics) -> EngineService:
        """This node's own engine index, fed by the sources of the config (each node subscribes
        to every source itself, so routers may ask any node)."""
        from kvcm.engines.service import EngineService
        from kvcm.engines.sources import SubscriberSettings

        cfg = self.config.events
        engines = EngineService(self.engine_store, self._block_size, SubscriberSettings.from_config(cfg),
                                registry=metrics.registry, static_sources=cfg.sources, shared=self.store)
        engines.follow_definitions()
        return engines

    def _block_size(self, instance_id: str) -> int:
        return self.registry.get_instance(instance_id).block_size

    def methods(self, info: Info) -> list[Method]:
        from kvcm.api import control, data, engines

        cache = self.cache
        table = (control.methods(self.registry, info, self.authorize) + data.methods(cache, self.engines)
                 + engines.methods(self.engines, self.authorize, lambda: cache))
        return [self._fresh(m) for m in table if m.name in READS]

    def _fresh(self, method: Method) -> Method:
        from kvcm.cache.locations import UnknownSkeleton

        handler = method.handler

        def run(req: object) -> object:
            try:
                return handler(req)
            except UnknownSkeleton:  # stored by the leader after this read's refresh: load, once more
                self.refresh()
                return handler(req)
        return replace(method, handler=run)

    def refresh(self) -> None:
        """Forget what the leader changed since the last read (one round trip when nothing did).
        :raises Unavailable: the store cannot be reached."""
        from kvcm.cache.locations import load as load_skeletons

        marker = None
        if self._marker_of is not None:
            marker = self._marker_of()
            if marker is not None and marker == self._marker:
                return  # nothing committed since the last look (None: unknown, look at every version)
        versions = self.store.versions(self._dbs)
        self._marker = marker  # read before the versions: a commit in between is seen next time
        if versions == self._seen:
            return
        seen, self._seen = self._seen, versions
        self.refreshes += 1
        n = len(self._registry_dbs)
        if versions[:n] != seen[:n]:
            self.registry.reload()
        if versions[n] != seen[n]:
            self.engines.follow_definitions()
        if versions[n + 1] != seen[n + 1]:
            load_skeletons(self.store)
        if versions[n + 2:] != seen[n + 2:]:
            self.cache.index.cache.clear()

    def start(self) -> None:
        if self.config.events.enabled:
            self.engines.start()

    def close(self) -> None:
        self.engines.stop()
        self.authorize.close()
        self.engine_store.close()
        self.store.close()


class _FreshTurns:
    """The dispatcher as the loop sees it, with ``before()`` run at the start of every turn
    that brought requests."""

    def __init__(self, dispatcher: Dispatcher, before: Callable[[], None]) -> None:
        self._dispatcher = dispatcher
        self._before = before

    def serve(self, arrivals: Sequence[tuple[object, bytes, bytes]]) -> list[tuple[object, bytes | None]]:
        if arrivals:
            self._before()
        return self._dispatcher.serve(arrivals)

    def wait_ms(self) -> int | None:
        return self._dispatcher.wait_ms()


def _hold_data_dir(config: Config, owner: str) -> str:
    """Take the data dir's lock file for ``owner``; returns its path.
    :raises DataDirLocked: another kvcm process holds it."""
    from kvcm.lockfile import LockBusy, hold_lock_file

    lock = os.path.join(os.path.abspath(config.store.data_dir), "kvcm.lock")
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    try:
        hold_lock_file(lock, owner, f"data dir {config.store.data_dir!r}")
    except LockBusy:
        raise DataDirLocked(f"data dir {config.store.data_dir!r} is in use by another kvcm process (lock file "
                            "kvcm.lock); stop it or choose another --data-dir") from None
    return lock


class FollowerStage:
    """A follower's serving stage: the RPC port answers the role-free methods and, with
    ``ha.follower_reads``, the reads (:class:`FollowerReads`); everything else is
    ``SERVER_NOT_LEADER`` naming the leader. The side HTTP port reports the role. A node builds
    its leader :class:`~kvcm.node.app.App` (and its caches) only once it holds the lease, so a
    leader's caches are never older than its term."""

    def __init__(self, config: Config, lease: Campaign, open_store: Callable[[], FollowedStore],
                 side_port: SidePort | None = None, shape: Shape | None = None) -> None:
        """``side_port``: the side HTTP port's listeners the node holds across its stages.
        ``shape``: turns the method table into the served one, given the registry the reads
        use (None without reads): a shard's node guards its routed methods with it."""
        self._shape = shape
        from kvcm.lockfile import drop_lock_file

        self.config = config
        self.lease = lease
        self.metrics = Metrics()
        self.started_at = time.time()
        self.endpoint = config.server.endpoint  # the bound one once the server is built
        self.reads: FollowerReads | None = None
        self.curve: CurveServer | None = None
        self.http: SideHttp | None = None
        self._stale: KvcmError | None = None  # why this turn's reads cannot be fresh (Redis away)
        # On Redis each node has a data dir of its own, held as usual; on a lock-file lease the
        # data dir is the leader's, whose store holds it.
        self._lock = _hold_data_dir(config, f"the follower {id(self):x}") if lease.coordination == "redis" else None
        with ExitStack() as undo:  # a failed build closes what it opened and lets the lock go
            if self._lock is not None:
                undo.callback(drop_lock_file, self._lock)
            self._wire(open_store, side_port, undo)
            undo.pop_all()

    def _wire(self, open_store: Callable[[], FollowedStore], side_port: SidePort | None, undo: ExitStack) -> None:
        config = self.config
        if config.ha.follower_reads:
            self.reads = self._build_reads(open_store)
        if self.reads is not None:
            undo.callback(self.reads.close)
        authorize = self.reads.authorize if self.reads is not None else None
        self.dispatcher = Dispatcher(self._methods(), metrics=self.metrics, gate=self._gate,
                                     authorize=authorize if authorize is not None and authorize.enabled else None)
        # The same front door as the leader's: CURVE on the RPC port, credentials on the side
        # port (a follower serves reads and /metrics too).
        self.curve = serve_curve(config.server.curve_secret_key_file, config.server.curve_allowed_clients_dir,
                                 self.metrics.registry)
        if self.curve is not None:
            undo.callback(self.curve.stop)
        self.server = self._build_server()
        undo.callback(self.server.close_unserved)
        self.endpoint = self.server.endpoint
        self.http = SideHttp(config.http, self.metrics, self.endpoint, lambda: True, lambda: True,
                             max_body=config.server.max_message_bytes, auth_required=config.auth.enabled,
                             client_options=self.curve.client_options() if self.curve is not None else None,
                             role=self.role, port=side_port) if config.http.enabled else None

    def _methods(self) -> list[Method]:
        from kvcm.api import leader as leader_api
        from kvcm.api.control import cluster_info

        methods = [
            Method("check_health", self._check_health),
            Method("get_manager_cluster_info", lambda req: cluster_info(self.info(), self.started_at)),
            # Each node's own elector settings; leader_demote is the leader's (SERVER_NOT_LEADER here).
            *(m for m in leader_api.methods(self.lease, self.lease.campaign_delay_ms) if m.name != "leader_demote"),
        ]
        if self.reads is not None:
            methods += self.reads.methods(self.info)
        if self._shape is not None:
            reads = self.reads
            methods = self._shape(methods, reads.registry if reads is not None else None,
                                  reads.authorize if reads is not None else None)
        return methods

    def _check_health(self, req: object) -> dict[str, Encodable]:
        return {"status": "ok", "is_health": True, "is_leader": False, "node": self.info()}

    def _build_server(self) -> Server:
        cfg = self.config.server
        timers = self._timers()
        return Server(cfg.endpoint, _FreshTurns(self.dispatcher, self._refresh_turn),
                      metrics=self.metrics, timers=timers,
                      max_message_bytes=cfg.max_message_bytes, poll_ms=cfg.poll_ms,
                      context=self.curve.context if self.curve is not None else None,
                      socket_setup=self.curve.setup if self.curve is not None else None)

    def _timers(self) -> list[Timer]:
        if self.reads is not None:  # between reads too: new event sources are followed without a reader
            return [Timer("follower-refresh", REFRESH_S, self._refresh_quietly)]
        if not self.config.ha.follower_reads:
            return []
        # Reads could not start (no leader had made the store yet, or it was away): the stage ends
        # after a while, so the node builds a new one that tries again.
        return [Timer("follower-retry-reads", RETRY_READS_S, self.request_stop, due=time.monotonic() + RETRY_READS_S)]

    def _build_reads(self, open_store: Callable[[], FollowedStore]) -> FollowerReads | None:
        """None when the shared store is not ready for reads yet (no leader ever initialised it,
        or Redis is away): the node still follows, and refuses reads too."""
        try:
            store = open_store()  # Redis away refuses the open (StartRefused): no reads this stage
            data_dir = os.path.abspath(self.config.store.data_dir)
            own = self.lease.coordination == "redis"
            return FollowerReads(self.config, store, data_dir, self.metrics, data_dir if own else None)
        except (Unavailable, KvcmError) as exc:
            log.warning("node %s: follower reads off for this stage: %s", self.lease.node_id, exc)
            return None

    def _refresh_quietly(self) -> None:
        try:
            if self.reads is not None:
                self.reads.refresh()
        except KvcmError as exc:  # Redis away: the next read says so to its caller
            log.debug("follower refresh: %s", exc)

    def _refresh_turn(self) -> None:
        """Before a loop turn's requests run: every request of the turn was sent before it began,
        so one refresh covers every write acknowledged before any of them was sent."""
        self._stale = None
        if self.reads is not None:
            try:
                self.reads.refresh()
            except KvcmError as exc:  # the turn's reads answer with it
                self._stale = exc

    def _gate(self, method: Method | None) -> KvcmError | None:
        from kvcm.ha.campaign import not_leader

        if method is None:
            return not_leader(self.lease.known_holder(), self.lease.node_id)
        if self._stale is not None and method.name in READS:
            return self._stale
        return None

    def info(self) -> dict[str, Encodable]:
        from kvcm.ha.campaign import lease_facts

        return {"version": __version__, "endpoint": self.endpoint, "node_id": self.lease.node_id,
                "http_port": self.http.port if self.http is not None else None, "host": socket.gethostname(),
                "pid": os.getpid(), "started_at": self.started_at, "ha": lease_facts(self.lease),
                "follower_reads": self.reads is not None}

    def role(self) -> str:
        return "follower"

    def run(self, started: Callable[[], None] | None = None) -> None:
        try:
            if self.reads is not None:
                self.reads.start()
            if self.http is not None:
                self.http.start()
            if started is not None:
                started()
            self.server.serve()
        finally:
            if self.http is not None:
                self.http.stop()
            if self.reads is not None:
                self.reads.close()
            if self.curve is not None:
                self.curve.stop()
            self._drop_lock()

    def request_stop(self) -> None:
        self.server.stop()

    def _drop_lock(self) -> None:
        from kvcm.lockfile import drop_lock_file

        if self._lock is not None:
            drop_lock_file(self._lock)


__all__ = ["READS", "FollowerReads", "FollowerStage"]
