"""Metadata stores behind one contract (:mod:`kvcm.backends.metastore.base`), chosen by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcm.backends.metastore.base import DATABASES, MetaStore, ReadTxn, WriteTxn, from_i64, from_u64, i64, u64
from kvcm.backends.metastore.lmdb import DataDirLocked, LmdbStore
from kvcm.backends.metastore.memory import MemoryStore


def _redis_store(*args: Any, **kwargs: Any) -> Any:
    """Imported on use: redis-py is needed only by deployments that choose Redis."""
    from kvcm.backends.metastore.redis import RedisStore

    return RedisStore(*args, **kwargs)


STORES: dict[str, Callable[..., Any]] = {"lmdb": LmdbStore, "memory": MemoryStore, "redis": _redis_store}

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
