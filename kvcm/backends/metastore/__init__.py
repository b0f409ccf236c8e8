"""Metadata stores behind one contract (:mod:`kvcm.backends.metastore.base`), chosen by name."""

from __future__ import annotations

from collections.abc import Callable

from kvcm.backends.metastore.base import DATABASES, MetaStore, ReadTxn, WriteTxn, from_i64, from_u64, i64, u64
from kvcm.backends.metastore.lmdb import DataDirLocked, LmdbStore
from kvcm.backends.metastore.memory import MemoryStore


def _redis_store(url: str, path: str | None = None, prefix: str = "kvcm", password: str | None = None,
                 wait_replicas: int = 0, wait_timeout_ms: int = 1000, fencing_token: int | None = None) -> MetaStore:
    """:class:`~kvcm.backends.metastore.redis.RedisStore`, imported on use: redis-py is needed
    only by deployments that choose Redis."""
    from kvcm.backends.metastore.redis import RedisStore

    return RedisStore(url, path, prefix, password, wait_replicas, wait_timeout_ms, fencing_token)


STORES: dict[str, Callable[..., MetaStore]] = {"lmdb": LmdbStore, "memory": MemoryStore, "redis": _redis_store}

__all__ = [
    "DATABASES",
    "STORES",
    "DataDirLocked",
    "LmdbStore",
    "MemoryStore",
    "MetaStore",
    "ReadTxn",
    "WriteTxn",
    "from_i64",
    "from_u64",
    "i64",
    "u64",
]
