"""The composition root: builds every part in dependency order and stops them in reverse.

Start: config -> store -> registry -> engine service -> cache -> method tables -> dispatcher ->
server (binds) -> background threads -> side HTTP. Each part is built once every part it needs
exists and is handed to it whole (no part looks another up later). A build that fails half-way
closes what it opened, newest first. Stop (idempotent): close the front door first (the RPC loop
answers what it already received, then closes its socket), stop and join every background
thread, and close the store last, after nothing can touch it any more.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING

import lmdb
import msgspec
import zmq

from kvcm.api.leader import ELECTOR_METHODS, LocalElector
from kvcm.backends.metastore import MetaStore
from kvcm.backends.metastore.base import GrowableStore, SharedStore
from kvcm.backends.storage.host import TAKEOVERS
from kvcm.config import Config
from kvcm.errors import KvcmError, StartRefused, Unavailable
from kvcm.http import SideHttp, SidePort, refuse_unguarded
from kvcm.metrics import Metrics
from kvcm.node.follower import READS
from kvcm.node.kernel import load_hash_kernel
from kvcm.node.refusals import http_bind_failed, refuse_taken_ports, rpc_in_use, store_error
from kvcm.node.shard import Sharding, shard_map_method
from kvcm.node.stores import open_engine_store, open_redis, open_store
from kvcm.proto.wire import Encodable
from kvcm.rpc.curve import CurveServer, serve_curve
from kvcm.rpc.dispatch import Dispatcher, Limits, Method
from kvcm.rpc.server import AddressInUse, Server, Timer
from kvcm.threads import LoopThread
from kvcm.version import __version__

if TYPE_CHECKING:  # the lease needs redis-py, an optional extra; the rest is imported where built
    from kvcm.cache.manager import CacheManager
    from kvcm.cache.storage_pool import StoragePool
    from kvcm.control.registry import Registry
    from kvcm.engines.service import EngineService
    from kvcm.ha.campaign import Campaign
    from kvcm.publish.eventlog import EventLog
    from kvcm.publish.publisher import EventPublisher
    from kvcm.reclaimer import Reclaimer
    from kvcm.rpc.auth import Authenticator

log = logging.getLogger("kvcm.app")

#: Methods every node answers whatever its role: they describe the node (and name the leader).
ROLE_FREE = frozenset({"check_health", "get_manager_cluster_info", "get_metrics", "get_shard_map"})


class App:
    """One kvcm process. ``start()`` serves on a thread; ``run()`` serves on the caller's.

    ``orphans``: what to do with storages holding blocks of a data dir whose metadata is gone
    (``refuse`` to start, ``adopt`` them unindexed, or ``discard`` them)."""

    registry: Registry
    authorize: Authenticator
    engine_store: MetaStore
    engines: EngineService
    storages: StoragePool
    cache: CacheManager
    dispatcher: Dispatcher
    server: Server

    def __init__(self, config: Config, orphans: str = "refuse", lease: Campaign | None = None,
                 side_port: SidePort | None = None, sharding: Sharding | None = None) -> None:
        """``lease``: the leader lease this process holds (``ha.enabled``, from
        :class:`~kvcm.node.ha.HaNode`): commits carry its epoch, requests and background work run
        only while it is valid. ``side_port``: the side HTTP port's listeners the node holds
        across its stages (bound already: served here, not bound)."""
        self.lease = lease
        self.side_port = side_port
        self.sharding = sharding  # this node's part in a shard directory (shard.directory), if any
        self.term = lease.epoch if lease is not None else 0  # the lease term this App serves
        refuse_unguarded(config)
        refuse_taken_ports(config, side_port)
        try:
            self._build(config, orphans)
        except (lmdb.Error, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise store_error(config, exc) from None

    def _build(self, config: Config, orphans: str) -> None:
        load_hash_kernel(config)
        self.config = config
        self.orphans = orphans
        self.metrics = Metrics()
        self.metrics.registry.register(TAKEOVERS)  # process-wide: a takeover happens in a backend's open
        self.started_at = time.time()
        self.endpoint = config.server.endpoint  # the bound one once the server is built
        self.threads: list[LoopThread] = []
        self.timers: list[Timer] = []
        self.publisher: EventPublisher | None = None  # kvcm's own vLLM-format event publisher, when enabled
        self.event_log: EventLog | None = None  # the JSON-lines event log, when configured
        self.reclaimer: Reclaimer | None = None  # capacity management, when reclaim.enabled
        self.curve: CurveServer | None = None  # keys, context and ZAP handler when CURVE is on
        self.http: SideHttp | None = None
        self._stopped = False
        self._serve_thread: threading.Thread | None = None
        # Without the lease the node leads except for the campaign delay after a leader_demote.
        self.elector = LocalElector(config.ha.campaign_delay_ms) if self.lease is None else None
        self.store = self._open_store()
        # A Protocol isinstance costs tens of microseconds: checked once, not per request.
        self._shared: SharedStore | None = self.store if isinstance(self.store, SharedStore) else None
        try:
            with ExitStack() as undo:  # a failed build closes every socket, thread, lock and store it opened
                undo.callback(self.store.close)
                self._wire(undo)
                undo.pop_all()
        except AddressInUse:
            raise rpc_in_use(config.server.endpoint) from None

    def _open_store(self) -> MetaStore:
        if self.lease is None or self.lease.coordination != "redis":
            # A lock-file lease leads the LMDB store of the shared data dir, whose own lock
            # (held while it is open) keeps any second writer out.
            return open_store(self.config, self.orphans)
        store = open_redis(self.config, self.orphans)
        # Before anything is loaded: any commit of a deposed leader after this is refused.
        store.fencing_token = self.lease.epoch
        return store

    def _wire(self, undo: ExitStack) -> None:
        self.curve = self._build_curve()
        if self.curve is not None:
            undo.callback(self.curve.stop)
        self.dispatcher = self._build_dispatcher(self._build_services(undo))
        self.server = self._build_server()
        undo.callback(self.server.close_unserved)
        self.endpoint = self.server.endpoint
        self.http = self._bind_http()
        if self.http is not None:
            undo.callback(self.http.stop)

    def _build_dispatcher(self, methods: list[Method]) -> Dispatcher:
        cfg = self.config.server
        return Dispatcher(
            methods,
            metrics=self.metrics,
            group=self.store.group,
            atomic=self.store.write,
            # Off, no hook at all: not even a call per request.
            authorize=self.authorize if self.authorize.enabled else None,
            limits=Limits.of(cfg),
            group_commit=cfg.group_commit,
            access_log=cfg.access_log,
            grow=self.store.grow if isinstance(self.store, GrowableStore) else None,
            gate=self._gate,  # any node may be demoted (leader_demote), so every one has a role to check
        )

    def _build_server(self) -> Server:
        cfg = self.config.server
        return Server(
            cfg.endpoint,
            self.dispatcher,
            metrics=self.metrics,
            timers=self.timers,
            max_message_bytes=cfg.max_message_bytes,
            drain_max=cfg.drain_max,
            poll_ms=cfg.poll_ms,
            sndhwm=cfg.sndhwm,
            context=self.curve.context if self.curve is not None else None,
            socket_setup=self.curve.setup if self.curve is not None else None,
        )

    def _close_parts(self) -> None:
        """What a stop closes once no thread uses them, in this order: the publisher, CURVE
        (after every socket on its context), the event log, HTTP, the storages (lock files, shm
        mappings), the engine store, the metadata store last."""
        if self.publisher is not None:
            self.publisher.stop()
        if self.curve is not None:
            self.curve.stop()
        if self.event_log is not None:
            self.event_log.close()
        if self.http is not None:
            self.http.stop()
        _free_queued(self.cache)
        self.storages.close()
        self.engine_store.close()
        self.store.close()

    def _bind_http(self) -> SideHttp | None:
        """Bind the side HTTP port now (served from :meth:`_start_background`), so every port is
        bound before the start-up block says the server is serving."""
        if not self.config.http.enabled:
            return None
        try:
            return SideHttp(
                self.config.http, self.metrics, self.endpoint, self.live, self.ready,
                max_body=self.config.server.max_message_bytes,
                auth_required=self.config.auth.enabled,
                client_options=self.curve.client_options() if self.curve is not None else None,
                role=self.role if self.lease is not None else None,
                port=self.side_port,
            )
        except OSError as exc:
            raise http_bind_failed(self.config.http, exc) from None

    # -- wiring ---------------------------------------------------------------------------------

    def _build_curve(self) -> CurveServer | None:
        """CURVE for the RPC port (and the publisher with publisher.curve); None = plaintext."""
        cfg = self.config.server
        return serve_curve(cfg.curve_secret_key_file, cfg.curve_allowed_clients_dir, self.metrics.registry)

    def _build_services(self, undo: ExitStack) -> list[Method]:
        """Every service of the process, each built once what it needs exists; returns the RPC
        method table."""
        from kvcm.api import data as cache_api
        from kvcm.api import engines as engines_api

        data_dir = None if self.store.path is None else os.path.abspath(self.config.store.data_dir)
        methods = self._build_control(data_dir, undo)
        self.engines = self._build_engine_service(data_dir, undo)
        cache = self.cache = self._build_cache(data_dir, undo)
        # The engine tier answers prefix matches from the block index of the cache built above.
        methods += engines_api.methods(self.engines, self.authorize, lambda: cache)
        methods += cache_api.methods(cache, self.engines)
        self._build_storage_events(undo)
        self.reclaimer = self._build_reclaimer()
        if self.sharding is None:
            return [*methods, shard_map_method(None)]
        return self.sharding.shape(methods, self.registry, self.store, self.authorize)

    def _build_control(self, data_dir: str | None, undo: ExitStack) -> list[Method]:
        """The registry, accounts and tokens, the node's own facts and its elector."""
        from kvcm.api import control as registry_api
        from kvcm.api import leader as leader_api
        from kvcm.api import system as system_api
        from kvcm.api import tokens as auth_api
        from kvcm.control.registry import Registry
        from kvcm.rpc.auth import Authenticator

        self.registry = Registry(self.store, data_dir, self.config.storage.allowed_roots)
        self.registry.ensure_defaults(data_dir or os.path.abspath(self.config.store.data_dir))
        self.authorize = Authenticator(self.registry, self.config.auth)
        undo.callback(self.authorize.close)
        return (registry_api.methods(self.registry, self.info, self.authorize)
                + auth_api.methods(self.registry, self.authorize)
                + system_api.methods(self.metrics, self.info)
                + leader_api.methods(self.lease, self.config.ha.campaign_delay_ms, self.elector))

    def _build_engine_service(self, data_dir: str | None, undo: ExitStack) -> EngineService:
        """The engine tier: event subscriber and engine index, in a store of its own."""
        from kvcm.engines.service import EngineService
        from kvcm.engines.sources import SubscriberSettings

        cfg = self.config.events
        self.engine_store = open_engine_store(self.config.store, cfg, data_dir)
        undo.callback(self.engine_store.close)
        engines = EngineService(
            self.engine_store,
            self._block_size,
            SubscriberSettings.from_config(cfg),
            registry=self.metrics.registry,
            static_sources=cfg.sources,
            # Nodes sharing a Redis store follow the same sources (each keeps its own index).
            shared=self.store if self.config.store.backend == "redis" else None,
        )
        engines.adopt_definitions()
        return engines

    def _block_size(self, instance_id: str) -> int:
        return self.registry.get_instance(instance_id).block_size

    def _build_cache(self, data_dir: str | None, undo: ExitStack) -> CacheManager:
        """The data plane: storages, block index, write sessions, deleter, health."""
        from kvcm.cache.manager import CacheManager
        from kvcm.cache.record_codec import set_cache_bytes as set_wire_cache_bytes
        from kvcm.cache.storage_pool import StoragePool

        cfg = self.config.cache
        if self.config.publisher.event_log:
            from kvcm.publish.eventlog import EventLog

            self.event_log = EventLog(self.config.publisher.event_log)
            undo.callback(self.event_log.close)
        self.storages = StoragePool(self.registry, data_dir, orphans=self.orphans, takeover_orphans=self.config.storage.orphans)
        undo.callback(self.storages.close)
        cache = CacheManager(self.store, self.registry, self.storages, cfg, index=self.config.store,
                             metrics_registry=self.metrics.registry)
        undo.callback(_free_queued, cache)
        set_wire_cache_bytes(cfg.wire_cache_bytes)
        cache.start()
        self._schedule_cache(cache)
        return cache

    def _schedule_cache(self, cache: CacheManager) -> None:
        """The cache's timers (RPC thread) and background threads."""
        from kvcm.backends.storage.registry import StorageAvailability, StorageHealth

        cfg = self.config.cache
        self.timers.append(Timer("write-session-expiry", cfg.session_check_ms / 1000.0,
                                 self._leading(cache.expire_sessions)))
        # Same cadence: a tick with nothing due is one comparison per pinned instance.
        self.timers.append(Timer("pin-expiry", cfg.session_check_ms / 1000.0, self._leading(cache.expire_pins)))
        self.threads.append(LoopThread("deleter", self._leading(cache.background_once), cfg.delete_poll_ms / 1000.0))
        # A storage whose lock another process holds for now (a paused leader) waits: the health
        # thread opens it once the lock frees, and the deleter keeps its frees until then.
        cache.deleter.waiting = self.storages.waiting
        health = StorageHealth(self.storages.backends, self.registry.set_storage_available,
                               reopen=lambda: self.storages.reopen_waiting(cache))
        StorageAvailability(lambda: [(s.global_unique_name, s.available) for s in self.registry.list_storages()],
                            self.metrics.registry)
        self.threads.append(LoopThread("storage-health", health.run_once, cfg.storage_health_interval_s))
        if isinstance(self.store, SharedStore):  # Redis: is the store still this deployment's?
            from kvcm.backends.metastore.redis import WATCH_EVERY_S

            self.threads.append(LoopThread("store-watch", self.store.watch, WATCH_EVERY_S))

    def _build_storage_events(self, undo: ExitStack) -> None:
        """kvcm's own storage-tier events: vLLM-format publisher and JSON-lines event log."""
        from kvcm.publish.bridge import StorageEvents
        from kvcm.publish.publisher import EventPublisher

        cfg = self.config.publisher
        if cfg.enabled:
            curve = self.curve if cfg.curve else None  # a CURVE server like the RPC port
            try:
                self.publisher = EventPublisher(cfg.endpoint, cfg.replay_endpoint or None, topic=cfg.topic,
                                                buffer_steps=cfg.buffer_steps, encoding=cfg.encoding,
                                                registry=self.metrics.registry,
                                                context=curve.context if curve is not None else None,
                                                socket_setup=curve.setup if curve is not None else None)
            except zmq.ZMQError as exc:  # taken after the start-up check, or not bindable at all
                raise StartRefused(f"cannot bind the publisher ({cfg.endpoint}, replay {cfg.replay_endpoint or 'off'}): "
                                   f"{exc}; change publisher.endpoint / publisher.replay_endpoint") from None
            undo.callback(self.publisher.stop)
        if self.publisher is not None or self.event_log is not None:
            self.cache.add_listener(StorageEvents(self.publisher, self.event_log, self._block_size))

    def _build_reclaimer(self) -> Reclaimer | None:
        """Capacity management: the reclaimer thread, fed by the cache manager's hooks."""
        from kvcm.reclaimer import Reclaimer, duty_pacer, limits_from_registry

        cfg = self.config.reclaim
        if not cfg.enabled:  # not even a listener: nobody would drain its event queue
            return None
        # Recency lives beside the metadata (an in-memory store keeps none across restarts).
        state_dir = None if self.store.path is None else os.path.join(os.path.abspath(self.config.store.data_dir),
                                                                       "reclaim")
        reclaimer = Reclaimer(self.cache, limits_from_registry(self.registry), cfg,
                              registry=self.metrics.registry, pace=duty_pacer(cfg.duty_cycle),
                              free_grace_s=self.config.cache.delete_poll_ms / 1000.0 + 0.05,
                              state_dir=state_dir)
        if cfg.inline:  # a write that would exceed a quota evicts, by the group's policy, what it needs
            self.cache.set_room_maker(reclaimer, cfg.inline_max_blocks)
        self.threads.append(LoopThread("reclaimer", self._leading(reclaimer.tick), reclaimer.period))
        return reclaimer

    def _leading(self, fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` as a background step that does nothing while this node does not lead: the lease
        is no longer valid (the leader stage is being stopped; its commits would be fenced
        anyway), or a node without the lease is in its campaign delay after a demote."""
        def step() -> object:
            return fn() if self.leading() else None
        return step

    def leading(self) -> bool:
        """This App's term is the lease's current, valid term; without a lease, the node is not
        in its campaign delay after a demote."""
        lease = self.lease
        if lease is None:
            return self.elector is None or self.elector.is_leader()
        return lease.is_leader() and lease.epoch == self.term

    def _gate(self, method: Method | None) -> KvcmError | None:
        """A Redis store that lost this deployment's data refuses everything (no read answered
        from memory either); then the lease's role check."""
        refused = self._shared.lost_error() if self._shared is not None else None
        return refused if refused is not None else self._leader_gate(method)

    def _leader_gate(self, method: Method | None) -> KvcmError | None:
        if self.leading() or (method is not None and method.name in ROLE_FREE):
            return None
        lease = self.lease
        if lease is None:
            # Demoted, alone: answered as a follower would (reads and the elector's own methods;
            # leader_demote answers SERVER_NOT_LEADER itself), the rest refused naming no leader.
            elector = self.elector
            if elector is None or (method is not None and (method.name in READS or method.name in ELECTOR_METHODS)):
                return None
            return elector.refusal()
        from kvcm.ha.campaign import not_leader

        return not_leader(lease.known_holder(), lease.node_id)

    def role(self) -> str:
        return "leader" if self.lease is not None and self.leading() else "follower"

    def info(self) -> dict[str, Encodable]:
        """Facts about this node for check_health / get_manager_cluster_info (``ha``: the role,
        under the lease, or while a node without it is demoted)."""
        facts = self._facts()
        if self.lease is not None:
            from kvcm.ha.campaign import lease_facts

            facts.update(node_id=self.lease.node_id, ha=lease_facts(self.lease))
        elif self.elector is not None:
            demoted = self.elector.facts()
            if demoted is not None:
                facts["ha"] = demoted
        return facts

    def _facts(self) -> dict[str, Encodable]:
        return {
            "version": __version__,
            "endpoint": self.endpoint,
            "http_port": self.http.port if self.http is not None else None,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": self.started_at,
            "data_dir": self.store.path,
        }

    def startup_block(self, config_file: str | None = None) -> list[str]:
        """The lines ``kvcm serve`` prints once every port is bound: what this process serves,
        where it keeps its data and which protections are on. The first line stays
        ``kvcm serving on ENDPOINT`` (scripts wait for it)."""
        cfg = self.config
        rows = [
            ("version", __version__),
            ("http", self._http_row()),
            ("data dir", self.store.path or os.path.abspath(cfg.store.data_dir)),
            ("config", os.path.abspath(config_file) if config_file else "none"),
            ("store", self._store_row()),
            ("auth", "on" if cfg.auth.enabled else "off"),
            ("curve", self._curve_row()),
            ("publisher", self._publisher_row()),
        ]
        if self.lease is not None:
            rows.append(("ha", f"node {self.lease.node_id}, {self.role()}, epoch {self.lease.epoch}"))
        return [f"kvcm serving on {self.endpoint}"] + [f"  {name:<10} {value}" for name, value in rows]

    def _http_row(self) -> str:
        if self.http is None:
            return "off"
        http = f"{self.config.http.host}:{self.http.port}"
        if self.http.admin_port is not None:
            http += f", admin {self.config.http.host}:{self.http.admin_port}"  # Tair's AdminService (http.admin_port)
        return http

    def _store_row(self) -> str:
        if isinstance(self.store, SharedStore):  # a store that says what it is (Redis)
            return self.store.describe()
        # A memory store still keeps the default file storage's blocks under the data dir.
        return "memory (metadata not persisted)" if self.store.path is None else \
            f"lmdb, sync {'on' if self.config.store.sync else 'off'}"

    def _curve_row(self) -> str:
        if self.curve is None:
            return "off"
        allowed = self.config.server.curve_allowed_clients_dir
        return "on, " + ("client keys in " + allowed if allowed else "any client key")

    def _publisher_row(self) -> str:
        cfg = self.config.publisher
        if self.publisher is None:
            return "off"
        replay = f", replay {cfg.replay_endpoint}" if cfg.replay_endpoint else ""
        return f"{cfg.endpoint}{replay}"

    # -- lifecycle ------------------------------------------------------------------------------

    def _start_background(self) -> None:
        for thread in self.threads:
            thread.start()
        if self.config.events.enabled:
            self.engines.start()
        if self.publisher is not None:
            self.publisher.start()
        if self.http is not None:
            self.http.start()

    def start(self) -> App:
        """Serve on a background thread (tests, embedding); returns self."""
        self._start_background()
        self._serve_thread = threading.Thread(target=self.server.serve, name="kvcm-rpc", daemon=True)
        self._serve_thread.start()
        return self

    def run(self, started: Callable[[], None] | None = None) -> None:
        """Serve on the calling thread until :meth:`request_stop`; then shut down in order.
        ``started`` runs once everything is bound and started, before the first request."""
        try:
            self._start_background()
            if started is not None:
                started()
            self.server.serve()
        finally:
            self.stop()

    def request_stop(self) -> None:
        """Signal-safe: only asks the loop to end."""
        self.server.stop()

    def live(self) -> bool:
        return time.monotonic() - self.server.heartbeat < self.config.server.live_after_s

    def ready(self) -> bool:
        """Serving, not stopping, and the metadata store reachable (a store without a
        ``reachable`` probe, local LMDB or memory, always is)."""
        return self.live() and not self.server.draining and not self._stopped and \
            (not isinstance(self.store, SharedStore) or self.store.reachable())

    def stop(self) -> None:
        """Idempotent, in reverse order of start: front door, threads, HTTP, store last."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.server.shutdown_grace_s
        if self._serve_thread is not None:
            self.server.stop(timeout=grace)
            self._serve_thread.join(grace)
        else:
            self.server.stop()
            self.server.close_unserved()
        self.authorize.close()  # the password-check thread
        self.engines.stop()
        for thread in reversed(self.threads):
            thread.stop()
        if self.reclaimer is not None:
            try:
                self.reclaimer.close()  # every thread stopped: nothing feeds it any more
            except Unavailable as exc:  # Redis away: only its last recency sync is lost; stop goes on
                log.warning("reclaimer: last sync skipped: %s", exc)
        self._close_parts()
        log.info("kvcm stopped")


def _free_queued(cache: CacheManager) -> None:
    """Copies whose records are gone: freed before their storages close."""
    try:
        cache.deleter.free_queued()
    except Exception:  # a stop goes on; a restart gives the slots back
        log.exception("freeing the queued copies at stop failed")


__all__ = ["ROLE_FREE", "App"]
