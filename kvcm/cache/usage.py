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

:class:`BeingFreed` counts, per (group, storage type), the bytes of the locations that are
``deleting`` and not yet freed: still in usage, but on their way out. Quota admission subtracts
them (:mod:`kvcm.cache.placement`), so a write need not wait for the deleter's grace delay.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import TypedDict

import msgpack

from kvcm.backends.metastore.base import ReadTxn, WriteTxn

DB = "usage"
Key = tuple[str, str, str]  # (group, instance, storage type)


class Counts(TypedDict):
    bytes: int
    keys: int


class InstanceUsage(Counts):
    by_type: dict[str, Counts]


class GroupUsage(InstanceUsage):
    """What :meth:`UsageBook.usage` tells of a group."""

    by_instance: dict[str, InstanceUsage]


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

    def usage(self, group: str) -> GroupUsage:
        """Committed usage of ``group``: ``{"bytes", "keys", "by_type": {type: {bytes, keys}},
        "by_instance": {instance: {bytes, keys, by_type}}}``."""
        with self._lock:
            rows = [(k, list(v)) for k, v in self._counts.items() if k[0] == group]
        out: GroupUsage = {"bytes": 0, "keys": 0, "by_type": {}, "by_instance": {}}
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


FreeKey = tuple[str, str]  # (group, storage type)


class BeingFreed:
    """Bytes of ``deleting`` locations not yet freed, per (group, storage type); exact.

    Counted on mark, uncounted when the deleter drops the location; rebuilt at start-up from
    the ``deletes`` database (:func:`kvcm.cache.deleter.pending_bytes`). Each change's timing
    keeps quota admission, which computes ``used - being_freed`` with ``used`` read from its own
    write transaction, from ever admitting more than it should while another thread's change is
    half done:

    * an increase (a mark) is seen at once by the thread that made it — later requests of the
      same group commit see it — and by other threads only once it commits (then the marks are
      durable); it is dropped if it never commits;
    * a decrease (a free) is applied at once for everybody, while its transaction holds the
      single writer lock, so no other writer can see it before the usage it cancels is gone too;
      it is undone if the transaction never commits.

    Values can dip below zero for a moment (a free committed before the mark's commit callback
    ran on the marking thread); at rest they equal the recount from the block records
    (:func:`kvcm.cache.consistency.check`).
    """

    def __init__(self) -> None:
        self._counts: dict[FreeKey, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()  # .pending: this thread's uncommitted increases

    def _pending(self) -> dict[FreeKey, int]:
        pending: dict[FreeKey, int] | None = getattr(self._local, "pending", None)
        if pending is None:
            pending = self._local.pending = {}
        return pending

    def add(self, txn: WriteTxn, deltas: Mapping[FreeKey, int]) -> None:
        """Count ``{(group, type): bytes}`` (positive: marked, negative: freed) as ``txn`` does."""
        ups = {k: v for k, v in deltas.items() if v > 0}
        downs = {k: v for k, v in deltas.items() if v < 0}
        if ups:
            _merge(self._pending(), ups, 1)
            txn.on_commit(lambda: self._settle(ups, True))
            txn.on_abort(lambda: self._settle(ups, False))
        if downs:
            with self._lock:
                _merge(self._counts, downs, 1)
            txn.on_abort(lambda: self._restore(downs))

    def _settle(self, ups: dict[FreeKey, int], committed: bool) -> None:
        _merge(self._pending(), ups, -1)  # callbacks run on the thread that owned the transaction
        if committed:
            with self._lock:
                _merge(self._counts, ups, 1)

    def _restore(self, downs: dict[FreeKey, int]) -> None:
        with self._lock:
            _merge(self._counts, downs, -1)

    def of(self, group: str) -> dict[str, int]:
        """``{type: bytes}`` of ``group``: committed, plus this thread's uncommitted marks."""
        pending = getattr(self._local, "pending", None) or {}
        out: dict[str, int] = {}
        with self._lock:
            for (g, kind), n in self._counts.items():
                if g == group:
                    out[kind] = out.get(kind, 0) + n
        for (g, kind), n in pending.items():
            if g == group:
                out[kind] = out.get(kind, 0) + n
        return {k: v for k, v in out.items() if v}

    def reset(self, counts: Mapping[FreeKey, int]) -> None:
        with self._lock:
            self._counts = {k: v for k, v in counts.items() if v}

    def snapshot(self) -> dict[FreeKey, int]:
        """Committed counts (what a quiet server's recount must equal)."""
        with self._lock:
            return dict(self._counts)


def _merge(into: dict[FreeKey, int], deltas: Mapping[FreeKey, int], sign: int) -> None:
    for key, n in deltas.items():
        value = into.get(key, 0) + sign * n
        if value:
            into[key] = value
        else:
            into.pop(key, None)


def _bump(slot: Counts, nbytes: int, nkeys: int) -> None:
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
