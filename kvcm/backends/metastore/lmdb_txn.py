"""Transactions of :class:`~kvcm.backends.metastore.lmdb.LmdbStore`: the read view, the savepoint
(undo log) a ``write()`` block gets inside its group's one LMDB write transaction, a follower's
refusing one, the per-database versions a commit counts, and the mapping of LMDB errors to kvcm's.

Versions: each top-level commit adds one to the counter of every database it wrote, so another
process reading the same environment (a follower) learns what changed from one read of a few
keys. The counters live in the ``meta`` database under ``version/<database name>`` (no other
``meta`` key starts so), each an 8-byte big-endian count; 0 (absent) = never written.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator
from typing import cast

import lmdb

from kvcm.backends.metastore.base import DATABASES, bad_key, from_u64, key_fits, u64
from kvcm.errors import Code, ServerError, StoreFull, Unavailable

#: The ``meta`` key of each database's version counter.
VERSION_KEYS: dict[str, bytes] = {name: b"version/" + name.encode() for name in DATABASES}
_COUNT = struct.Struct(">Q")  # a version counter's value, as base.u64 packs it
_FIRST = u64(1)

#: The databases a group wrote, in the order first written: a dict used as an ordered set, so a
#: rolled-back savepoint can forget the ones only it wrote by cutting the tail.
Touched = dict[str, None]


def translate_error(exc: lmdb.Error) -> Exception:
    if isinstance(exc, lmdb.BadValsizeError):  # a write of a key no record can have
        return bad_key()
    if isinstance(exc, lmdb.MapFullError):
        return StoreFull(
            "metadata store is full (LMDB map size reached); raise store.map_size_max",
            Code.CAPACITY_EXHAUSTED,
        )
    if isinstance(exc, lmdb.DiskError):
        return ServerError(f"metadata store disk error: {exc}", Code.IO_ERROR)
    return ServerError(f"metadata store error: {exc}", Code.IO_ERROR)


class LmdbReadTxn:
    """A read view over one LMDB transaction (committed data, or a write txn's own writes)."""

    def __init__(self, txn: lmdb.Transaction, dbs: dict[str, lmdb._Database]) -> None:
        self._txn = txn
        self._dbs = dbs

    # Transactions are opened with buffers=False, so LMDB hands out bytes, never memoryviews.

    def get(self, db: str, key: bytes) -> bytes | None:
        try:
            return cast("bytes | None", self._txn.get(key, db=self._dbs[db]))
        except lmdb.BadValsizeError:
            return None  # the key does not fit (key_fits): no record can have it

    def get_many(self, db: str, keys: Iterable[bytes]) -> list[bytes | None]:
        get, handle = self._txn.get, self._dbs[db]
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        try:
            return cast("list[bytes | None]", [get(k, db=handle) for k in keys])
        except lmdb.BadValsizeError:
            return [self.get(db, k) for k in keys]

    def scan(
        self, db: str, start: bytes = b"", prefix: bytes = b"", limit: int | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        cursor = self._txn.cursor(db=self._dbs[db])
        if not cursor.set_range(max(start, prefix)):
            return
        items = cast("Iterator[tuple[bytes, bytes]]", cursor.iternext())
        for n, (key, value) in enumerate(items):
            if not key.startswith(prefix) or (limit is not None and n >= limit):
                return
            yield key, value

    def count(self, db: str) -> int:
        return int(self._txn.stat(self._dbs[db])["entries"])


class LmdbWriteTxn(LmdbReadTxn):
    """A savepoint inside the group's one LMDB write transaction.

    Nested ``write()`` blocks are not LMDB child transactions (each of those costs a dirty-page
    list allocation plus a copy of every page it touches that its parent already dirtied): they
    share the top-level transaction and keep an *undo log* instead — the value each key had when
    the savepoint began, recorded on its first change — which a rollback writes back. ``undo``
    is None when nothing needs it (the only savepoint of a group this block created: rollback is
    the abort of the whole transaction).

    ``touched`` is shared by every savepoint of the group (see :data:`Touched`); ``mark`` is how
    many databases it held when this savepoint began.
    """

    __slots__ = ("aborts", "callbacks", "mark", "touched", "undo")

    def __init__(
        self,
        txn: lmdb.Transaction,
        dbs: dict[str, lmdb._Database],
        callbacks: list[Callable[[], None]],
        undo: dict[tuple[str, bytes], bytes | None] | None,
        touched: Touched,
    ) -> None:
        super().__init__(txn, dbs)
        self.callbacks = callbacks
        self.aborts: list[Callable[[], None]] = []
        self.undo = undo
        self.touched = touched
        self.mark = len(touched)

    def put(self, db: str, key: bytes, value: bytes) -> None:
        handle = self._dbs[db]
        self.touched[db] = None
        undo = self.undo
        if undo is not None:
            slot = (db, key)
            if slot not in undo:
                undo[slot] = cast("bytes | None", self._txn.get(key, db=handle))
        self._txn.put(key, value, db=handle)

    def put_many(self, db: str, items: Iterable[tuple[bytes, bytes]]) -> None:
        txn, handle, undo = self._txn, self._dbs[db], self.undo
        self.touched[db] = None
        put = txn.put
        if undo is None:
            with txn.cursor(db=handle) as cursor:
                cursor.putmulti(items)  # one C loop: twice as fast as put() per item
            return
        get = txn.get
        for key, value in items:
            slot = (db, key)
            if slot not in undo:
                undo[slot] = cast("bytes | None", get(key, db=handle))
            put(key, value, db=handle)

    def delete(self, db: str, key: bytes) -> bool:
        if not key_fits(key):
            return False  # no record has that key
        handle = self._dbs[db]
        self.touched[db] = None  # counted even when nothing was there: a needless bump is harmless
        undo = self.undo
        if undo is not None:
            slot = (db, key)
            if slot not in undo:
                old = cast("bytes | None", self._txn.get(key, db=handle))
                if old is None:
                    return False  # nothing to delete, nothing to undo
                undo[slot] = old
        return bool(self._txn.delete(key, db=handle))

    def delete_many(self, db: str, keys: Iterable[bytes]) -> int:
        return sum(1 for k in keys if self.delete(db, k))

    def drop(self, db: str) -> None:
        handle = self._dbs[db]
        self.touched[db] = None
        undo = self.undo
        if undo is not None:
            for key, value in list(self.scan(db)):
                undo.setdefault((db, key), value)
        self._txn.drop(handle, delete=False)

    def on_commit(self, fn: Callable[[], None]) -> None:
        self.callbacks.append(fn)

    def on_abort(self, fn: Callable[[], None]) -> None:
        self.aborts.append(fn)

    def remember(self, db: str, items: Iterable[tuple[bytes, bytes | None]]) -> None:
        """Hint: ``(key, value)`` pairs the caller just read in this savepoint and has not
        changed since, so the undo log need not read them again before a put or delete."""
        undo = self.undo
        if undo is not None:
            for key, value in items:
                undo.setdefault((db, key), value)

    def rollback(self) -> None:
        """Write back every value this savepoint changed (its undo log); the databases only it
        wrote no longer count as written."""
        txn, dbs = self._txn, self._dbs
        assert self.undo is not None
        for (db, key), old in self.undo.items():
            if old is None:
                txn.delete(key, db=dbs[db])
            else:
                txn.put(key, old, db=dbs[db])
        touched = self.touched
        for db in list(touched)[self.mark:]:
            del touched[db]


class RefusingWriteTxn(LmdbWriteTxn):
    """A follower's ``write()`` block, over a read transaction of the leader's data: it reads
    (a caller may look before it writes, and write nothing) and refuses every change."""

    __slots__ = ("refusal",)

    def __init__(self, txn: lmdb.Transaction, dbs: dict[str, lmdb._Database], refusal: str) -> None:
        super().__init__(txn, dbs, [], {}, {})
        self.refusal = refusal

    def _refuse(self) -> Unavailable:
        return Unavailable(self.refusal, Code.SERVER_NOT_LEADER)

    def put(self, db: str, key: bytes, value: bytes) -> None:
        raise self._refuse()

    def put_many(self, db: str, items: Iterable[tuple[bytes, bytes]]) -> None:
        raise self._refuse()

    def delete(self, db: str, key: bytes) -> bool:
        raise self._refuse()

    def drop(self, db: str) -> None:
        raise self._refuse()


def bump_versions(txn: lmdb.Transaction, meta: lmdb._Database, touched: Iterable[str]) -> None:
    """Count one more version of each database in ``touched``, inside the commit's transaction.
    (On every commit's path: the struct is used directly, not through u64/from_u64.)"""
    get, put, pack, unpack = txn.get, txn.put, _COUNT.pack, _COUNT.unpack
    for name in touched:
        key = VERSION_KEYS[name]
        old = get(key, db=meta)
        put(key, pack(unpack(old)[0] + 1) if old is not None else _FIRST, db=meta)


def read_versions(view: LmdbReadTxn, dbs: Iterable[str]) -> tuple[int, ...]:
    """The version of each of ``dbs`` in this view (0 = never written)."""
    got = view.get_many("meta", [VERSION_KEYS[name] for name in dbs])
    return tuple(0 if raw is None else from_u64(raw) for raw in got)


def key_range(view: LmdbReadTxn, db: str, prefix: bytes) -> tuple[bytes, bytes]:
    cursor = view._txn.cursor(db=view._dbs[db])
    cursor.set_range(prefix)
    first = cursor.key()
    # The last key with this prefix: jump past the prefix range and step back once.
    if prefix and cursor.set_range(_next_prefix(prefix)):
        cursor.prev()
    else:
        cursor.last()
    return cast(bytes, first), cast(bytes, cursor.key())


def _next_prefix(prefix: bytes) -> bytes:
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\xff" * (len(prefix) + 1)
    return stripped[:-1] + bytes([stripped[-1] + 1])
