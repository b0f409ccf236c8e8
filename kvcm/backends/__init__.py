"""Metadata stores behind one contract (:mod:`kvcm.backends.base`), chosen by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcm.backends.base import DATABASES, MetaStore, ReadTxn, WriteTxn, from_i64, from_u64, i64, u64
from kvcm.backends.lmdb_store import DataDirLocked, LmdbStore
from kvcm.backends.memory_store import MemoryStore
from kvcm.backends.storage_base import ParsedUri, StorageBackend
from kvcm.backends.storages import (
    STORAGE_BACKENDS,
    StorageHealth,
    format_uri,
    normalize_spec,
    open_backend,
    parse_uri,
    resolve_file_uri,
    resolve_shm_uri,
)

STORES: dict[str, Callable[..., Any]] = {"lmdb": LmdbStore, "memory": MemoryStore}

__all__ = [
    "DATABASES",
    "STORAGE_BACKENDS",
    "STORES",
    "DataDirLocked",
    "LmdbStore",
    "MemoryStore",
    "MetaStore",
    "ParsedUri",
    "ReadTxn",
    "StorageBackend",
    "StorageHealth",
    "WriteTxn",
    "format_uri",
    "from_i64",
    "from_u64",
    "i64",
    "normalize_spec",
    "open_backend",
    "parse_uri",
    "resolve_file_uri",
    "resolve_shm_uri",
    "u64",
]
