"""Metadata stores behind one contract (:mod:`kvcm.store.base`), chosen by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcm.store.base import DATABASES, MetaStore, ReadTxn, WriteTxn, from_i64, from_u64, i64, u64
from kvcm.store.lmdb import DataDirLocked, LmdbStore
from kvcm.store.memory import MemoryStore

STORES: dict[str, Callable[..., Any]] = {"lmdb": LmdbStore, "memory": MemoryStore}

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
