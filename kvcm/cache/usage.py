"""Usage counters: bytes and location counts per (group, instance, storage type), exact.

Persisted in the ``usage`` database, one record per ``group \\0 instance \\0 type`` holding
``[bytes, keys]`` ("keys" counts *locations*: a block with copies on two storage types counts
once per type). Every change is written in the same transaction as the block change that
causes it, so counters and blocks can never disagree after a crash; an in-memory copy of the
committed values follows via ``txn.on_commit`` (Tair kept per-type usage in memory only and
estimated group usage).

Space counts from allocation (``writing``) until the deleter frees it: a ``deleting`` location
still occupies its storage.

Thread ownership: :meth:`Usage.add` runs on whichever thread owns the write transaction;
:meth:`Usage.usage` is safe from any thread.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import msgpack

from kvcm.store.base import ReadTxn, WriteTxn

DB = "usage"
Key = tuple[str, str, str]  # (group, instance, storage type)


def _db_key(key: Key) -> bytes:
    return "\0".join(key).encode()


def _parse_key(raw: bytes) -> Key:
    group, instance, kind = raw.decode().split("\0")
    return group, instance, kind


class Usage:
    """Committed counters in memory plus in-transaction updates."""

    def __init__(self) -> None:
        self._counts: dict[Key, list[int]] = {}
        self._lock = threading.Lock()

    def load(self, view: ReadTxn) -> None:
        counts = {_parse_key(k): list(msgpack.unpackb(v)) for k, v in view.scan(DB)}
        with self._lock:
            self._counts = counts

    def add(self, txn: WriteTxn, deltas: dict[Key, list[int]]) -> None:
        """Apply ``{(group, instance, type): [bytes, keys]}`` in ``txn`` (and in memory on commit)."""
        deltas = {k: d for k, d in deltas.items() if d[0] or d[1]}
        if not deltas:
            return
        for key, (nbytes, nkeys) in deltas.items():
            raw = txn.get(DB, _db_key(key))
            old = msgpack.unpackb(raw) if raw is not None else [0, 0]
            new = [old[0] + nbytes, old[1] + nkeys]
            if new == [0, 0]:
                txn.delete(DB, _db_key(key))
            else:
                txn.put(DB, _db_key(key), msgpack.packb(new))
        txn.on_commit(lambda: self._apply(deltas))

    def _apply(self, deltas: dict[Key, list[int]]) -> None:
        with self._lock:
            for key, (nbytes, nkeys) in deltas.items():
                now = self._counts.setdefault(key, [0, 0])
                now[0] += nbytes
                now[1] += nkeys
                if now == [0, 0]:
                    del self._counts[key]

    @staticmethod
    def group_used(view: ReadTxn, group: str) -> tuple[int, dict[str, int]]:
        """``(total bytes, {type: bytes})`` of a group as ``view`` sees it (a write txn sees the
        uncommitted allocations of earlier requests of the same group commit: quotas stay hard)."""
        total, by_type = 0, defaultdict[str, int](int)
        for raw_key, value in view.scan(DB, prefix=group.encode() + b"\0"):
            nbytes = msgpack.unpackb(value)[0]
            total += nbytes
            by_type[_parse_key(raw_key)[2]] += nbytes
        return total, dict(by_type)

    def usage(self, group: str) -> dict[str, Any]:
        """Committed usage of ``group``: ``{"bytes", "keys", "by_type": {type: {bytes, keys}},
        "by_instance": {instance: {bytes, keys, by_type}}}``."""
        with self._lock:
            rows = [(k, list(v)) for k, v in self._counts.items() if k[0] == group]
        out: dict[str, Any] = {"bytes": 0, "keys": 0, "by_type": {}, "by_instance": {}}
        for (_, instance, kind), (nbytes, nkeys) in rows:
            out["bytes"] += nbytes
            out["keys"] += nkeys
            _bump(out["by_type"].setdefault(kind, {"bytes": 0, "keys": 0}), nbytes, nkeys)
            inst = out["by_instance"].setdefault(instance, {"bytes": 0, "keys": 0, "by_type": {}})
            _bump(inst, nbytes, nkeys)
            _bump(inst["by_type"].setdefault(kind, {"bytes": 0, "keys": 0}), nbytes, nkeys)
        return out

    def snapshot(self) -> dict[Key, list[int]]:
        with self._lock:
            return {k: list(v) for k, v in self._counts.items()}

    def instances(self) -> set[str]:
        with self._lock:
            return {k[1] for k in self._counts}

    @staticmethod
    def persisted(view: ReadTxn) -> dict[Key, list[int]]:
        return {_parse_key(k): list(msgpack.unpackb(v)) for k, v in view.scan(DB)}


def _bump(slot: dict[str, Any], nbytes: int, nkeys: int) -> None:
    slot["bytes"] += nbytes
    slot["keys"] += nkeys


def tally(rows: Iterable[tuple[Key, int]]) -> dict[Key, list[int]]:
    """Counters from ``(key, nbytes)`` per live location (the recount)."""
    out: dict[Key, list[int]] = {}
    for key, nbytes in rows:
        slot = out.setdefault(key, [0, 0])
        slot[0] += nbytes
        slot[1] += 1
    return out
