"""The composition root: builds every part in dependency order and stops them in reverse.

Start: config -> store -> registry -> managers -> dispatcher -> server (binds) -> background
threads -> side HTTP. Stop (idempotent): close the front door first (the RPC loop answers what it
already received, then closes its socket), stop and join every background thread, and close the
store last, after nothing can touch it any more.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lmdb
import msgspec
import zmq

from kvcm.backends.metastore import DataDirLocked, LmdbStore, MemoryStore, MetaStore
from kvcm.backends.metastore.base import GrowableStore, SharedStore
from kvcm.backends.storage.ownership import leftovers
from kvcm.cache.keys import native_states
from kvcm.config import Config, ConfigError, HttpConfig
from kvcm.errors import KvcmError, StartRefused, Unavailable
from kvcm.follower import FollowerStage
from kvcm.http import SideHttp, SidePort, refuse_unguarded
from kvcm.metrics import Metrics
from kvcm.rpc.curve import CurveServer, serve_curve
from kvcm.rpc.dispatch import Dispatcher, Limits, Method
from kvcm.rpc.server import AddressInUse, Server, Timer, endpoint_in_use
from kvcm.threads import LoopThread
from kvcm.version import __version__

if TYPE_CHECKING:  # the lease needs redis-py, an optional extra: imported where it is used
    from kvcm.backends.metastore.redis import RedisStore
    from kvcm.ha.lease import Lease

log = logging.getLogger("kvcm.app")

#: Methods every node answers whatever its role: they describe the node (and name the leader).
ROLE_FREE = frozenset({"check_health", "get_manager_cluster_info", "get_metrics"})


def open_store(config: Config, orphans: str = "refuse") -> MetaStore:
    """The configured metadata store (an LMDB env under the data dir by default).

    Refuses (StartRefused) to create a new store while storages still hold blocks the missing
    one recorded: starting empty would sweep them all as orphans. ``orphans`` ("adopt" or
    "discard", from ``kvcm serve --adopt-orphans`` / ``--discard-orphans``) lets it go on."""
    if config.store.backend == "memory":
        return MemoryStore()
    if config.store.backend == "redis":
        return _open_redis(config, orphans)
    data_dir = os.path.abspath(config.store.data_dir)
    meta = os.path.join(data_dir, "meta", "data.mdb")
    if orphans == "refuse" and os.path.isdir(data_dir) and not os.path.exists(meta):
        _refuse_leftovers(data_dir, meta)
    return LmdbStore(
        os.path.abspath(config.store.data_dir),
        map_size=config.store.map_size,
        map_size_max=config.store.map_size_max,
        sync=config.store.sync,
        max_readers=config.store.max_readers,
    )


def require_redis_client(config: Config) -> None:
    """The Redis store and the leader lease need redis-py, an optional extra: without it, say
    which extra to install instead of a ModuleNotFoundError from deep inside the start."""
    try:
        import redis  # noqa: F401 - only whether it imports
    except ImportError:
        setting = "ha.enabled = true" if config.ha.enabled else f"store.backend = {config.store.backend}"
        raise ConfigError(f"{setting} needs the Redis client, an optional extra: pip install 'kvcm[redis]' "
                          "(from a checkout: pip install '.[redis]')") from None


def redis_password(config: Config) -> str | None:
    """The Redis password of ``store.redis_password_file`` (None: none, or the URL's own)."""
    if not config.store.redis_password_file:
        return None
    try:
        with open(config.store.redis_password_file, encoding="utf-8") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            if mode & 0o077:  # as for CURVE secrets: a warning, since mounted secrets are often 0644
                log.warning("store.redis_password_file %s is readable by other users (mode %o); chmod 600 it",
                            config.store.redis_password_file, mode & 0o777)
            return fh.read().rstrip("\r\n")
    except OSError as exc:
        raise StartRefused(f"cannot read store.redis_password_file: {exc.strerror}") from None


def _open_redis(config: Config, orphans: str = "refuse", follower: bool = False) -> RedisStore:
    """The Redis store; the data dir keeps kvcm's local files (lock, recency, engine index,
    the default file storage). An unreachable Redis refuses the start with the reason.

    ``follower``: a follower stage's store, which reads the leader's metadata and refuses
    every commit (the stage holds the data dir's lock itself)."""
    require_redis_client(config)
    from kvcm.backends.metastore.redis import RedisStore, check_persistence, redact

    cfg = config.store
    where = f"Redis {redact(cfg.redis_url)} (prefix {cfg.redis_prefix})"
    password = redis_password(config)
    data_dir = os.path.abspath(cfg.data_dir)
    try:
        store = RedisStore(cfg.redis_url, None if follower else data_dir, prefix=cfg.redis_prefix,
                           password=password, wait_replicas=cfg.redis_wait_replicas,
                           wait_timeout_ms=cfg.redis_wait_timeout_ms)
    except Unavailable as exc:
        if isinstance(exc, DataDirLocked):
            raise
        raise StartRefused(f"the metadata store {where} cannot be reached ({exc.message}); nothing was changed") from None
    try:
        if follower:
            store.read_only = f"node {config.ha.node_id} is a follower: it never writes the shared store"
            store.claim(data_dir, create=False)
            return store
        check_persistence(store.client, where, refuse=config.ha.enabled and config.ha.require_aof)
        # Without the lease this process is the prefix's only writer: it holds a mark that says so.
        store.check_start(data_dir, writer=not config.ha.enabled)
        if orphans == "refuse" and store.is_empty():
            _refuse_leftovers(data_dir, f"in {where}")
        store.claim(data_dir)
    except BaseException:
        store.close()
        raise
    return store


def _refuse_leftovers(data_dir: str, meta: str) -> None:
    found = leftovers(data_dir)
    if not found:
        return
    where = "; ".join(
        f"{f.where} holds {f.files} block file(s)" + (f" of {f.marker.describe()}" if f.marker else "") for f in found
    )
    raise StartRefused(
        f"the metadata {meta} is missing but {where}; nothing was deleted. Restore the metadata, or start with "
        "--adopt-orphans (keep those files, unindexed) or --discard-orphans (delete the blocks kvcm named)"
    )


def _store_error(config: Config, exc: Exception) -> StartRefused:
    meta = os.path.join(os.path.abspath(config.store.data_dir), "meta", "data.mdb")
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return StartRefused(
        f"the metadata {meta} cannot be read ({type(exc).__name__}: {reason}); nothing was changed or deleted. "
        "Restore it from a backup (or move it away to start empty)"
    )


def _rpc_in_use(endpoint: str) -> StartRefused:
    return StartRefused(f"the RPC endpoint {endpoint} is already in use by another process; "
                        "choose another with --endpoint or server.endpoint")


def _http_port_in_use(cfg: HttpConfig) -> bool:
    if cfg.port == 0:
        return False
    return endpoint_in_use(f"tcp://{'[' + cfg.host + ']' if ':' in cfg.host else cfg.host}:{cfg.port}")


def _http_in_use(cfg: HttpConfig) -> StartRefused:
    default = (" (the default http.port: every kvcm binds it unless told otherwise, so a second server "
               "needs its own)") if cfg.port == HttpConfig.port else ""
    return StartRefused(f"the HTTP port {cfg.host}:{cfg.port} is already in use by another process{default}; "
                        "choose another with --http-port or http.port (0 picks a free port)")


def _publisher_in_use(key: str, endpoint: str) -> StartRefused:
    return StartRefused(f"the publisher's {endpoint} is already in use by another process; "
                        f"choose another with --set publisher.{key}=...")


class App:
    """One kvcm process. ``start()`` serves on a thread; ``run()`` serves on the caller's.

    ``orphans``: what to do with storages holding blocks of a data dir whose metadata is gone
    (``refuse`` to start, ``adopt`` them unindexed, or ``discard`` them)."""

    def __init__(self, config: Config, orphans: str = "refuse", lease: Lease | None = None,
                 side_port: SidePort | None = None) -> None:
        """``lease``: the leader lease this process holds (``ha.enabled``, from :class:`HaNode`):
        commits carry its epoch, requests and background work run only while it is valid.
        ``side_port``: the side HTTP port's listeners the node holds across its stages (bound
        already: served here, not bound)."""
        self.lease = lease
        self.side_port = side_port
        self.term = lease.epoch if lease is not None else 0  # the lease term this App serves
        refuse_unguarded(config)
        # A taken port refuses the start before the data dir is even opened; the binds below
        # still report a port taken in between (and clean up what was built).
        if endpoint_in_use(config.server.endpoint):
            raise _rpc_in_use(config.server.endpoint)
        if config.http.enabled and side_port is None and _http_port_in_use(config.http):
            raise _http_in_use(config.http)
        if config.publisher.enabled:
            for key, endpoint in (("endpoint", config.publisher.endpoint),
                                  ("replay_endpoint", config.publisher.replay_endpoint)):
                if endpoint and endpoint_in_use(endpoint):
                    raise _publisher_in_use(key, endpoint)
        try:
            self._build(config, orphans)
        except (lmdb.Error, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _store_error(config, exc) from None

    def _build(self, config: Config, orphans: str) -> None:
        load_hash_kernel(config)
        self.config = config
        self.orphans = orphans
        self.metrics = Metrics()
        self.started_at = time.time()
        self.store = open_store(config, orphans)
        if self.lease is not None:
            # Before anything is loaded: any commit of a deposed leader after this is refused.
            self.store.fencing_token = self.lease.epoch  # type: ignore[attr-defined]
        self.threads: list[Any] = []
        self.publisher: Any = None  # kvcm's own vLLM-format event publisher, when enabled
        self.event_log: Any = None  # the JSON-lines event log, when configured
        self.timers: list[Timer] = []
        self._stopped = False
        self._serve_thread: threading.Thread | None = None
        self.curve: CurveServer | None = None  # keys, context and ZAP handler when CURVE is on
        self.http: SideHttp | None = None
        try:
            self.curve = self._build_curve()
            methods = self._build_services()
            self.dispatcher = Dispatcher(
                methods,
                metrics=self.metrics,
                group=self.store.group,
                atomic=self.store.write,
                # Off, no hook at all: not even a call per request.
                authorize=self.authorize if self.authorize.enabled else None,
                limits=Limits.of(config.server),
                group_commit=config.server.group_commit,
                access_log=config.server.access_log,
                grow=self.store.grow if isinstance(self.store, GrowableStore) else None,
                gate=self._gate if self.lease is not None or isinstance(self.store, SharedStore) else None,
            )
            self.server = Server(
                config.server.endpoint,
                self.dispatcher,
                metrics=self.metrics,
                timers=self.timers,
                max_message_bytes=config.server.max_message_bytes,
                drain_max=config.server.drain_max,
                poll_ms=config.server.poll_ms,
                sndhwm=config.server.sndhwm,
                context=self.curve.context if self.curve is not None else None,
                socket_setup=self.curve.setup if self.curve is not None else None,
            )
            self.endpoint = self.server.endpoint
            self.http = self._bind_http()
        except AddressInUse:
            self._abort_build()
            raise _rpc_in_use(config.server.endpoint) from None
        except BaseException:
            self._abort_build()
            raise

    def _abort_build(self) -> None:
        """Undo a build that failed half-way (a port taken, a bad storage): every socket, thread,
        lock file and store it opened is closed, so nothing outlives the failed start."""
        server: Server | None = getattr(self, "server", None)
        if server is not None:
            server.close_unserved()
        authorize = getattr(self, "authorize", None)
        if authorize is not None:
            authorize.close()
        self._close_parts()

    def _close_parts(self) -> None:
        """What both a stop and a failed build close once no thread uses them, in this order:
        the publisher, CURVE (after every socket on its context), the event log, HTTP, the
        storages (lock files, shm mappings), the engine store, the metadata store last. Parts a
        failed build never made are skipped."""
        if self.publisher is not None:
            self.publisher.stop()
        if self.curve is not None:
            self.curve.stop()
        if self.event_log is not None:
            self.event_log.close()
        if self.http is not None:
            self.http.stop()
        cache = getattr(self, "cache", None)
        if cache is not None and getattr(self, "storages", None) is not None:
            try:  # copies whose records are gone: freed before their storages close
                cache.deleter.free_queued()
            except Exception:  # a stop goes on; a restart gives the slots back
                log.exception("freeing the queued copies at stop failed")
        if getattr(self, "storages", None) is not None:
            self.storages.close()
        if getattr(self, "engine_store", None) is not None:
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
            if exc.errno == errno.EADDRINUSE:
                raise _http_in_use(self.config.http) from None
            raise StartRefused(f"cannot bind the HTTP port {self.config.http.host}:{self.config.http.port} "
                               f"({exc.strerror or exc}); change --http-port or http.host / http.port") from None

    # -- wiring ---------------------------------------------------------------------------------

    def _build_curve(self) -> CurveServer | None:
        """CURVE for the RPC port (and the publisher with publisher.curve); None = plaintext."""
        cfg = self.config.server
        return serve_curve(cfg.curve_secret_key_file, cfg.curve_allowed_clients_dir, self.metrics.registry)

    def _build_services(self) -> list[Method]:
        """Every service of the process; returns the RPC method table."""
        from kvcm.api import control as registry_api
        from kvcm.api import leader as leader_api
        from kvcm.api import system as system_api
        from kvcm.api import tokens as auth_api
        from kvcm.control.registry import Registry
        from kvcm.rpc.auth import Authenticator

        data_dir = None if self.store.path is None else os.path.abspath(self.config.store.data_dir)
        self.registry = Registry(self.store, data_dir, self.config.storage.allowed_roots)
        self.registry.ensure_defaults(data_dir or os.path.abspath(self.config.store.data_dir))
        self.authorize = Authenticator(self.registry, self.config.auth)
        methods: list[Method] = []
        methods += registry_api.methods(self.registry, self.info, self.authorize)
        methods += auth_api.methods(self.registry, self.authorize)
        methods += system_api.methods(self.metrics, self.info)
        methods += leader_api.methods(self.lease, self.config.ha.campaign_delay_ms)
        methods += self._build_engines(data_dir)
        methods += self._build_cache(data_dir)
        self._build_storage_events()
        self._build_reclaimer()
        return methods

    def _build_storage_events(self) -> None:
        """kvcm's own storage-tier events: vLLM-format publisher and JSON-lines event log."""
        from kvcm.publish.bridge import StorageEvents
        from kvcm.publish.publisher import EventPublisher

        cfg = self.config.publisher
        if cfg.enabled:
            try:
                self.publisher = EventPublisher(cfg.endpoint, cfg.replay_endpoint or None, topic=cfg.topic,
                                                buffer_steps=cfg.buffer_steps, encoding=cfg.encoding,
                                                registry=self.metrics.registry, **self._publisher_curve())
            except zmq.ZMQError as exc:  # taken after the start-up check, or not bindable at all
                raise StartRefused(f"cannot bind the publisher ({cfg.endpoint}, replay {cfg.replay_endpoint or 'off'}): "
                                   f"{exc}; change publisher.endpoint / publisher.replay_endpoint") from None
        if self.publisher is not None or self.event_log is not None:
            self.cache.add_listener(StorageEvents(self.publisher, self.event_log,
                                                  lambda instance_id: self.registry.get_instance(instance_id).block_size))

    def _publisher_curve(self) -> dict[str, Any]:
        """EventPublisher arguments that make it a CURVE server like the RPC port."""
        if not self.config.publisher.curve or self.curve is None:
            return {}
        return {"context": self.curve.context, "socket_setup": self.curve.setup}

    def _build_engines(self, data_dir: str | None) -> list[Method]:
        """The engine tier: event subscriber, engine index, kvcm's own publisher."""
        from kvcm.api import engines as engines_api
        from kvcm.engines.service import EngineService
        from kvcm.engines.sources import SubscriberSettings

        cfg = self.config.events
        # A store of its own: the engine index may skip fsync (it is rebuilt by replay), which
        # must not weaken the durability of the main store's commits.
        self.engine_store: MetaStore = (
            MemoryStore() if data_dir is None
            else LmdbStore(os.path.join(data_dir, "engines"), sync=cfg.sync, map_size=self.config.store.map_size,
                           map_size_max=self.config.store.map_size_max)
        )
        self.engines = EngineService(
            self.engine_store,
            lambda instance_id: self.registry.get_instance(instance_id).block_size,
            SubscriberSettings.from_config(cfg),
            registry=self.metrics.registry,
            static_sources=cfg.sources,
            # Nodes sharing a Redis store follow the same sources (each keeps its own index).
            shared=self.store if self.config.store.backend == "redis" else None,
        )
        self.engines.adopt_definitions()
        return engines_api.methods(self.engines, self.authorize, lambda: getattr(self, "cache", None))

    def _build_cache(self, data_dir: str | None) -> list[Method]:
        """The data plane: storages, block index, write sessions, deleter, health."""
        from kvcm.api import data as cache_api
        from kvcm.backends.storage.registry import StorageAvailability, StorageHealth
        from kvcm.cache.manager import CacheManager
        from kvcm.cache.record_codec import set_cache_bytes as set_wire_cache_bytes
        from kvcm.cache.storage_pool import StoragePool

        cfg = self.config.cache
        if self.config.publisher.event_log:
            from kvcm.publish.eventlog import EventLog

            self.event_log = EventLog(self.config.publisher.event_log)
        self.storages = StoragePool(self.registry, data_dir, orphans=self.orphans)
        self.cache = CacheManager(self.store, self.registry, self.storages, default_write_timeout=cfg.write_timeout_seconds,
                                  max_write_timeout=cfg.max_write_timeout_seconds,
                                  max_open_sessions=cfg.max_open_sessions_per_instance,
                                  max_writing_bytes=cfg.max_writing_bytes_per_instance,
                                  metrics_registry=self.metrics.registry, lost_scan_s=cfg.lost_scan_s,
                                  lock_shards=self.config.store.lock_shards, cache_size=self.config.store.search_cache_size,
                                  runs=cfg.runs, max_pins_per_instance=cfg.max_pins_per_instance,
                                  max_pin_ttl_s=cfg.max_pin_ttl_s)
        set_wire_cache_bytes(cfg.wire_cache_bytes)
        self.cache.start()
        self.timers.append(Timer("write-session-expiry", cfg.session_check_ms / 1000.0,
                                 self._leading(self.cache.expire_sessions)))
        # Same cadence: a tick with nothing due is one comparison per pinned instance.
        self.timers.append(Timer("pin-expiry", cfg.session_check_ms / 1000.0, self._leading(self.cache.expire_pins)))
        self.threads.append(LoopThread("deleter", self._leading(self.cache.background_once), cfg.delete_poll_ms / 1000.0))
        # A storage whose lock another process holds for now (a paused leader) waits: the health
        # thread opens it once the lock frees, and the deleter keeps its frees until then.
        self.cache.deleter.waiting = self.storages.waiting
        health = StorageHealth(self.storages.backends, self.registry.set_storage_available,
                               reopen=lambda: self.storages.reopen_waiting(self.cache))
        StorageAvailability(lambda: [(s.global_unique_name, s.available) for s in self.registry.list_storages()],
                            self.metrics.registry)
        self.threads.append(LoopThread("storage-health", health.run_once, cfg.storage_health_interval_s))
        if isinstance(self.store, SharedStore):  # Redis: is the store still this deployment's?
            from kvcm.backends.metastore.redis import WATCH_EVERY_S

            self.threads.append(LoopThread("store-watch", self.store.watch, WATCH_EVERY_S))
        return cache_api.methods(self.cache, self.engines)

    def _build_reclaimer(self) -> None:
        """Capacity management: the reclaimer thread, fed by the cache manager's hooks."""
        from kvcm.reclaimer import Reclaimer, duty_pacer, limits_from_registry

        cfg = self.config.reclaim
        self.reclaimer = None
        if not cfg.enabled:  # not even a listener: nobody would drain its event queue
            return
        # Recency lives beside the metadata (an in-memory store keeps none across restarts).
        state_dir = None if self.store.path is None else os.path.join(os.path.abspath(self.config.store.data_dir),
                                                                       "reclaim")
        self.reclaimer = Reclaimer(self.cache, limits_from_registry(self.registry), cfg,
                                   registry=self.metrics.registry, pace=duty_pacer(cfg.duty_cycle),
                                   free_grace_s=self.config.cache.delete_poll_ms / 1000.0 + 0.05,
                                   state_dir=state_dir)
        if cfg.inline:  # a write that would exceed a quota evicts, by the group's policy, what it needs
            self.cache.set_room_maker(self.reclaimer, cfg.inline_max_blocks)
        self.threads.append(LoopThread("reclaimer", self._leading(self.reclaimer.tick), self.reclaimer.period))

    def _leading(self, fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` as a background step that does nothing once the lease is no longer valid (the
        leader stage is being stopped; its commits would be fenced anyway)."""
        lease = self.lease
        if lease is None:
            return fn

        def step() -> object:
            return fn() if self.leading() else None
        return step

    def leading(self) -> bool:
        """This App's term is the lease's current, valid term (always true without a lease)."""
        lease = self.lease
        return lease is None or (lease.is_leader() and lease.epoch == self.term)

    def _gate(self, method: Method | None) -> KvcmError | None:
        """A Redis store that lost this deployment's data refuses everything (no read answered
        from memory either); then the lease's role check."""
        refused = self.store.lost_error() if isinstance(self.store, SharedStore) else None
        return refused if refused is not None else self._leader_gate(method)

    def _leader_gate(self, method: Method | None) -> KvcmError | None:
        lease = self.lease
        if lease is None or self.leading() or (method is not None and method.name in ROLE_FREE):
            return None
        from kvcm.ha.lease import not_leader

        return not_leader(lease.known_holder(), lease.node_id)

    def role(self) -> str:
        return "leader" if self.lease is not None and self.leading() else "follower"

    def info(self) -> dict[str, Any]:
        """Facts about this node for check_health / get_manager_cluster_info."""
        facts = self._facts()
        if self.lease is not None:
            from kvcm.ha.lease import lease_facts

            facts.update(node_id=self.lease.node_id, ha=lease_facts(self.lease))
        return facts

    def _facts(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "endpoint": getattr(self, "endpoint", self.config.server.endpoint),
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
        http = f"{cfg.http.host}:{self.http.port}" if self.http is not None else "off"
        if self.http is not None and self.http.admin_port is not None:
            http += f", admin {cfg.http.host}:{self.http.admin_port}"  # Tair's AdminService (http.admin_port)
        # A memory store still keeps the default file storage's blocks under the data dir.
        store = "memory (metadata not persisted)" if self.store.path is None else \
            f"lmdb, sync {'on' if cfg.store.sync else 'off'}"
        if isinstance(self.store, SharedStore):  # a store that says what it is (Redis)
            store = self.store.describe()
        publisher = "off"
        if self.publisher is not None:
            replay = f", replay {cfg.publisher.replay_endpoint}" if cfg.publisher.replay_endpoint else ""
            publisher = f"{cfg.publisher.endpoint}{replay}"
        curve = "off"
        if self.curve is not None:
            curve = "on, " + ("client keys in " + cfg.server.curve_allowed_clients_dir
                              if cfg.server.curve_allowed_clients_dir else "any client key")
        rows = [
            ("version", __version__),
            ("http", http),
            ("data dir", self.store.path or os.path.abspath(cfg.store.data_dir)),
            ("config", os.path.abspath(config_file) if config_file else "none"),
            ("store", store),
            ("auth", "on" if cfg.auth.enabled else "off"),
            ("curve", curve),
            ("publisher", publisher),
        ]
        if self.lease is not None:
            rows.append(("ha", f"node {self.lease.node_id}, {self.role()}, epoch {self.lease.epoch}"))
        return [f"kvcm serving on {self.endpoint}"] + [f"  {name:<10} {value}" for name, value in rows]

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


class HaNode:
    """``kvcm serve`` with ``ha.enabled``: a follower stage until the lease is won, then a
    full :class:`App` for the term; back to a follower stage when the lease is lost. Each stage
    binds the same endpoints, so clients only see refusals and a reconnect."""

    def __init__(self, config: Config, orphans: str = "refuse") -> None:
        require_redis_client(config)
        refuse_unguarded(config)
        import redis

        from kvcm.backends.metastore.redis import CONNECT_TIMEOUT_S
        from kvcm.ha.floor import EpochFloor
        from kvcm.ha.guard import check_node_start
        from kvcm.ha.lease import Lease

        load_hash_kernel(config)  # the follower stage hashes the token_ids of the reads it serves
        self.config = config
        self.orphans = orphans
        ha = config.ha
        password = redis_password(config)
        # Replies within a renew interval: a Redis that hangs must not hold the renew thread past
        # the lease's deadline (is_leader() turns false by the clock regardless).
        client = redis.Redis.from_url(config.store.redis_url, password=password,
                                      socket_timeout=ha.renew_ms / 1000.0,
                                      socket_connect_timeout=min(CONNECT_TIMEOUT_S, ha.renew_ms / 1000.0))
        check_node_start(client, config)  # a node that could never lead says so before binding anything
        self.lease = Lease(client, config.store.redis_prefix, ha.node_id,
                           ha.advertise_endpoint or config.server.endpoint, ha.lease_ms, ha.renew_ms,
                           on_change=self._changed, campaign_delay_ms=ha.campaign_delay_ms,
                           floor=EpochFloor.in_data_dir(os.path.abspath(config.store.data_dir)))
        self.stage: App | FollowerStage | None = None
        self._stop = threading.Event()
        self._stage_lock = threading.Lock()
        self._announced = False
        # Bound once for the node's life, so the side port never closes between stages.
        self.side_port = self._bind_side_port() if config.http.enabled else None

    def _bind_side_port(self) -> SidePort:
        try:
            return SidePort(self.config.http)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise _http_in_use(self.config.http) from None
            raise StartRefused(f"cannot bind the HTTP port {self.config.http.host}:{self.config.http.port} "
                               f"({exc.strerror or exc}); change --http-port or http.host / http.port") from None

    def _changed(self, leader: bool) -> None:
        with self._stage_lock:
            stage = self.stage
        if stage is not None and (isinstance(stage, App) != leader or
                                  (isinstance(stage, App) and stage.term != self.lease.epoch)):
            log.info("node %s: role change to %s", self.lease.node_id, "leader" if leader else "follower")
            # Off the lease thread (a renew must not wait for HTTP requests in flight).
            threading.Thread(target=self._switch, args=(stage,), name="kvcm-role-change", daemon=True).start()

    @staticmethod
    def _switch(stage: App | FollowerStage) -> None:
        """End a stage at a role change: the side port's requests in flight are answered by it
        while its RPC loop still serves, then the loop ends."""
        if stage.http is not None:
            stage.http.hand_over()
        stage.request_stop()

    def run(self, started: Callable[[], None] | None = None) -> None:
        self.lease.step()  # the first attempt before any port is bound: a free lease is taken at once
        self.lease.start()
        try:
            while not self._stop.is_set():
                self._run_stage(started)
        finally:
            self.lease.stop(release=True)
            if self.side_port is not None:
                self.side_port.close()

    def _run_stage(self, started: Callable[[], None] | None) -> None:
        leader = self.lease.is_leader()
        self._wait_endpoint_free()
        try:
            stage: App | FollowerStage = App(self.config, self.orphans, lease=self.lease, side_port=self.side_port) \
                if leader else FollowerStage(self.config, self.lease, lambda: _open_redis(self.config, follower=True),
                                             side_port=self.side_port)
        except DataDirLocked:
            raise
        except Unavailable as exc:  # Redis away while building the leader stage: follow, retry
            log.warning("node %s: cannot start the %s stage: %s", self.lease.node_id,
                        "leader" if leader else "follower", exc)
            self._stop.wait(self.lease.renew_ms / 1000.0)
            return
        with self._stage_lock:
            self.stage = stage
        if self._stop.is_set() or self.lease.is_leader() != leader or (isinstance(stage, App) and self.lease.epoch != stage.term):
            stage.request_stop()
        stage.run(started=self._announce(started, stage))

    def _wait_endpoint_free(self, timeout: float = 5.0) -> None:
        """The last stage's sockets close in ZeroMQ's I/O thread, a moment after its stop: the
        next stage binds the same endpoint once it is free (a port still taken past ``timeout``
        refuses the start as usual)."""
        if self.stage is None:
            return
        deadline = time.monotonic() + timeout
        while endpoint_in_use(self.config.server.endpoint) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _announce(self, started: Callable[[], None] | None, stage: App | FollowerStage) -> Callable[[], None] | None:
        if started is None or self._announced:
            return None

        def once() -> None:
            self._announced = True
            started()
        return once

    @property
    def endpoint(self) -> str:
        return self.stage.endpoint if self.stage is not None else self.config.server.endpoint

    def role(self) -> str:
        return "leader" if self.lease.is_leader() else "follower"

    def startup_block(self, config_file: str | None = None) -> list[str]:
        stage = self.stage
        if isinstance(stage, App):
            return stage.startup_block(config_file)
        return [f"kvcm serving on {self.endpoint}",
                f"  {'version':<10} {__version__}",
                f"  {'ha':<10} node {self.lease.node_id}, follower"]

    def request_stop(self) -> None:
        """Signal-safe: ends the current stage and the loop."""
        self._stop.set()
        stage = self.stage
        if stage is not None:
            stage.request_stop()


def load_hash_kernel(config: Config) -> None:
    """``server.hash_kernel = "numba"``: the compiled block hash for the whole process (idempotent),
    or a start-up error naming what is missing."""
    if config.server.hash_kernel != "numba" or native_states() is not None:
        return  # off, or loaded already (an HA node builds an App per leader term)
    started = time.monotonic()
    try:
        from kvcm.cache import hash_kernel
    except ImportError as exc:
        raise ConfigError(f"server.hash_kernel = numba needs numba and numpy (pip install 'kvcm[fast]'): {exc}") from None
    try:
        hash_kernel.load()
    except Exception as exc:  # noqa: BLE001 - numba's build errors are many; each is a start-up refusal
        raise ConfigError(f"server.hash_kernel = numba: the kernel could not be built: {type(exc).__name__}: {exc}") from None
    log.info("server.hash_kernel: the numba kernel is loaded (%.1f s)", time.monotonic() - started)


__all__ = ["App", "HaNode", "LoopThread", "open_store"]

