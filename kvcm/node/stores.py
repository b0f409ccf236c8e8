"""Opening the metadata store a node runs on: LMDB under the data dir, memory, or a shared Redis.

A store that would start empty while storages still hold blocks the missing one recorded is
refused (:func:`refuse_leftovers`): starting empty would sweep them all as orphans.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from kvcm.backends.metastore import DataDirLocked, LmdbStore, MemoryStore, MetaStore
from kvcm.backends.storage.ownership import leftovers
from kvcm.config import Config, ConfigError, EventsConfig, StoreConfig
from kvcm.errors import StartRefused, Unavailable

if TYPE_CHECKING:  # redis-py is an optional extra: imported where it is used
    from kvcm.backends.metastore.redis import RedisStore

log = logging.getLogger("kvcm.app")


def open_store(config: Config, orphans: str = "refuse") -> MetaStore:
    """The configured metadata store (an LMDB env under the data dir by default).

    Refuses (StartRefused) to create a new store while storages still hold blocks the missing
    one recorded: starting empty would sweep them all as orphans. ``orphans`` ("adopt" or
    "discard", from ``kvcm serve --adopt-orphans`` / ``--discard-orphans``) lets it go on."""
    if config.store.backend == "memory":
        return MemoryStore()
    if config.store.backend == "redis":
        return open_redis(config, orphans)
    data_dir = os.path.abspath(config.store.data_dir)
    meta = os.path.join(data_dir, "meta", "data.mdb")
    if orphans == "refuse" and os.path.isdir(data_dir) and not os.path.exists(meta):
        refuse_leftovers(data_dir, meta)
    return LmdbStore(
        os.path.abspath(config.store.data_dir),
        map_size=config.store.map_size,
        map_size_max=config.store.map_size_max,
        sync=config.store.sync,
        max_readers=config.store.max_readers,
        count_versions=bool(config.ha.enabled and config.ha.coordination),  # only followers read them
    )


def open_engine_store(store: StoreConfig, events: EventsConfig, data_dir: str | None) -> MetaStore:
    """The engine index's own store: it may skip fsync (it is rebuilt by replay), which must not
    weaken the durability of the main store's commits. In memory without a data dir."""
    if data_dir is None:
        return MemoryStore()
    return LmdbStore(os.path.join(data_dir, "engines"), sync=events.sync, map_size=store.map_size,
                     map_size_max=store.map_size_max)


def open_lmdb_follower(config: Config) -> LmdbStore:
    """A follower's view of the LMDB store of the data dir it shares with the leader
    (``ha.coordination`` on one host): it reads what the leader commits and refuses every write.
    Unavailable (SERVICE_NOT_READY) while no leader has created the store yet."""
    return LmdbStore.follow(os.path.abspath(config.store.data_dir), max_readers=config.store.max_readers,
                            reason=f"node {config.ha.node_id} is a follower: only the leader writes the store")


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


def open_redis(config: Config, orphans: str = "refuse", follower: bool = False) -> RedisStore:
    """The Redis store; the data dir keeps kvcm's local files (lock, recency, engine index,
    the default file storage). An unreachable Redis refuses the start with the reason.

    ``follower``: a follower stage's store, which reads the leader's metadata and refuses
    every commit (the stage holds the data dir's lock itself)."""
    require_redis_client(config)
    from kvcm.backends.metastore.redis import RedisStore, redact

    cfg = config.store
    where = f"Redis {redact(cfg.redis_url)} (prefix {cfg.redis_prefix})"
    data_dir = os.path.abspath(cfg.data_dir)
    try:
        store = RedisStore(cfg.redis_url, None if follower else data_dir, prefix=cfg.redis_prefix,
                           password=redis_password(config), wait_replicas=cfg.redis_wait_replicas,
                           wait_timeout_ms=cfg.redis_wait_timeout_ms)
    except Unavailable as exc:
        if isinstance(exc, DataDirLocked):
            raise
        raise StartRefused(f"the metadata store {where} cannot be reached ({exc.message}); nothing was changed") from None
    try:
        if follower:
            store.read_only = f"node {config.ha.node_id} is a follower: it never writes the shared store"
            store.claim(data_dir, create=False)
        else:
            _claim_as_writer(store, config, orphans, where)
            store.enable_cache()  # the deployment's one writer: its own commits are the only changes
    except BaseException:
        store.close()
        raise
    return store


def _claim_as_writer(store: RedisStore, config: Config, orphans: str, where: str) -> None:
    from kvcm.backends.metastore.redis import check_persistence

    data_dir = os.path.abspath(config.store.data_dir)
    check_persistence(store.client, where, refuse=config.ha.enabled and config.ha.require_aof)
    # Without the lease this process is the prefix's only writer: it holds a mark that says so.
    store.check_start(data_dir, writer=not config.ha.enabled)
    if orphans == "refuse" and store.is_empty():
        refuse_leftovers(data_dir, f"in {where}")
    store.claim(data_dir)


def refuse_leftovers(data_dir: str, meta: str) -> None:
    """StartRefused if storages under ``data_dir`` hold blocks of a store that is gone (``meta``)."""
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


__all__ = ["open_engine_store", "open_lmdb_follower", "open_redis", "open_store", "redis_password", "refuse_leftovers",
           "require_redis_client"]
