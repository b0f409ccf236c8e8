"""The Redis store's transactions: the read gate, reads through a write overlay, savepoints.

A write transaction buffers its puts and deletes in an overlay its own reads see; a nested
``write()`` block is a savepoint with an undo log of overlay entries (as in
:class:`~kvcm.backends.metastore.lmdb_txn.LmdbWriteTxn`). The group's overlay is committed by
one script call (:mod:`kvcm.backends.metastore.redis_layout`).

Read isolation: Redis has no snapshots. A read transaction holds a shared :class:`Gate` that this
process's commits take exclusively, so a read transaction never straddles this process's own
commit: within one ``read()`` block every read sees the same committed state, as long as no other
process writes the same prefix (the single-writer rule).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

import redis
from redis.commands.core import Script

from kvcm.backends.metastore.base import DATABASES, bad_key, key_fits
from kvcm.backends.metastore.redis_cache import CommittedCache, Miss
from kvcm.backends.metastore.redis_conn import SOCKET_TIMEOUT_S
from kvcm.backends.metastore.redis_errors import call
from kvcm.backends.metastore.redis_layout import Layer, Overlay, upper
from kvcm.backends.metastore.redis_wire import Wire

log = logging.getLogger("kvcm.backends.metastore")

_PAGE = 512  # keys per scan round trip


class _Absent(enum.Enum):
    """Undo-log marker: the key had no overlay entry."""

    ABSENT = enum.auto()


#: What a savepoint's undo log holds per (database, key): the overlay entry before its first change.
UndoEntry = bytes | None | _Absent


class _Held(threading.local):
    """How many read blocks this thread holds open on a gate."""

    def __init__(self) -> None:
        self.count = 0


class Gate:
    """Shared for read transactions, exclusive for a commit; re-entrant per thread for reads."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._exclusive = False
        self._held = _Held()

    def enter(self) -> None:
        held = self._held.count
        if held == 0:
            with self._cond:
                while self._exclusive:
                    self._cond.wait()
                self._active += 1
        self._held.count = held + 1

    def leave(self) -> None:
        self._held.count -= 1
        if self._held.count == 0:
            with self._cond:
                self._active -= 1
                if self._active == 0:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        if self._held.count:
            # This thread commits inside its own read block: waiting for readers would wait on
            # itself. Its read is the one that straddles the commit, and it knows.
            yield
            return
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            # Bounded: a reader of another thread that opens a write inside its read block waits
            # for this commit's writer lock; past the bound the commit goes on without it.
            if not self._cond.wait_for(lambda: self._active == 0, SOCKET_TIMEOUT_S):
                log.warning("a commit went ahead while %d read transaction(s) stayed open", self._active)
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class Source(Protocol):
    """What a transaction reads through: the store's connection, keys and scan script."""

    @property
    def client(self) -> redis.Redis: ...

    @property
    def scan_script(self) -> Script: ...

    @property
    def wire(self) -> Wire:
        """The hot reads' path (``HGET`` / ``HMGET``) on ``client``'s pool."""

    @property
    def cache(self) -> CommittedCache | None:
        """What the store's writer knows it holds (None: every read goes to Redis)."""

    def hash_key(self, db: str) -> bytes: ...

    def zset_key(self, db: str) -> bytes: ...


class RedisReadTxn:
    """Reads of committed data (through the overlay of a write transaction, when it has one).

    Every value read is offered to the writer's cache (:mod:`~kvcm.backends.metastore.redis_cache`),
    but only a write transaction answers from it: what it read is acknowledged only once its
    commit reached Redis, while a plain read answered from memory while Redis is away (or has
    lost the deployment's data, until the writer's watch notices) could tell a client what Redis
    no longer holds."""

    #: answer reads from the store's cache (write transactions)
    _from_cache = False

    def __init__(self, store: Source, overlay: Overlay | None = None) -> None:
        self._store = store
        self._overlay = overlay if overlay is not None else {}

    def get(self, db: str, key: bytes) -> bytes | None:
        layer = self._overlay.get(db)
        if layer is not None and key in layer:
            return layer[key]
        if not key_fits(key):
            return None
        cache = self._store.cache
        token = -1
        if cache is not None:
            key = bytes(key)  # the cache's key (a view of the caller's would change under it)
            if self._from_cache:
                known = cache.get(db, key)
                if not isinstance(known, Miss):
                    return known
            token = cache.before_read()
        value = call(self._store.wire.command, b"HGET", self._store.hash_key(db), key)
        value = value if not isinstance(value, str) else value.encode()  # never str: replies are not decoded
        if cache is not None:
            cache.fill(token, db, ((key, value),))
        return value

    def get_many(self, db: str, keys: Iterable[bytes]) -> list[bytes | None]:
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        layer = self._overlay.get(db, {})
        wanted = [k for k in keys if k not in layer and key_fits(k)]
        found: dict[bytes, bytes | None] = {}
        cache = self._store.cache
        token = -1
        if wanted and cache is not None and self._from_cache:
            missed = []
            for k in wanted:
                known = cache.get(db, bytes(k))
                if isinstance(known, Miss):
                    missed.append(k)
                else:
                    found[k] = known
            wanted = missed
        if wanted and cache is not None:
            token = cache.before_read()
        if wanted:
            values = call(self._store.wire.command, b"HMGET", self._store.hash_key(db), *wanted)
            read = {k: v for k, v in zip(wanted, values) if not isinstance(v, str)}  # never str: not decoded
            if cache is not None:
                cache.fill(token, db, ((bytes(k), read.get(k)) for k in wanted))
            found.update(read)
        return [layer[k] if k in layer else found.get(k) for k in keys]

    def scan(
        self, db: str, start: bytes = b"", prefix: bytes = b"", limit: int | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        lo = max(start, prefix)
        layer = self._overlay.get(db, {})
        own = sorted(k for k in layer if k >= lo and k.startswith(prefix))
        merged = merge(self._base_scan(db, lo, prefix), own, layer)
        for n, item in enumerate(merged):
            if limit is not None and n >= limit:
                return
            yield item

    def _base_scan(self, db: str, lo: bytes, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        store = self._store
        end = upper(prefix) if prefix else None
        low = b"[" + lo if lo else b"-"
        high = b"(" + end if end is not None else b"+"
        keys = [store.zset_key(db), store.hash_key(db)]
        while True:
            found: list[bytes]
            values: list[bytes | None]
            found, values = call(store.scan_script, keys=keys, args=[low, high, _PAGE])
            for key, value in zip(found, values):
                if not key.startswith(prefix):
                    return
                if value is not None:  # a key without a value: none a commit leaves, skipped all the same
                    yield key, value
            if len(found) < _PAGE:
                return
            low = b"(" + found[-1]

    def count(self, db: str) -> int:
        store = self._store
        total = call(store.client.hlen, store.hash_key(db))
        layer = self._overlay.get(db)
        if not layer:
            return total
        keys = list(layer)
        stored = call(store.client.hmget, store.hash_key(db), keys)
        for key, before in zip(keys, stored):
            total += (layer[key] is not None) - (before is not None)
        return total


def merge(base: Iterator[tuple[bytes, bytes]], own: list[bytes], layer: Layer) -> Iterator[tuple[bytes, bytes]]:
    """Committed items and a transaction's own keys (sorted) in one key order; own entries win."""
    i = 0
    for key, value in base:
        while i < len(own) and own[i] < key:
            mine = layer[own[i]]
            if mine is not None:
                yield own[i], mine
            i += 1
        if i < len(own) and own[i] == key:
            i += 1
        if key in layer:
            mine = layer[key]
            if mine is not None:
                yield key, mine
            continue
        yield key, value
    for key in own[i:]:
        mine = layer[key]
        if mine is not None:
            yield key, mine


class RedisWriteTxn(RedisReadTxn):
    """A savepoint of the group's overlay: ``undo`` holds each key's overlay entry as it was
    when the savepoint began (``_Absent.ABSENT``: none), written back on rollback."""

    _from_cache = True

    def __init__(self, store: Source, overlay: Overlay) -> None:
        super().__init__(store, overlay)
        self.undo: dict[tuple[str, bytes], UndoEntry] = {}
        self.callbacks: list[Callable[[], None]] = []
        self.aborts: list[Callable[[], None]] = []

    def _layer(self, db: str) -> Layer:
        if db not in DATABASES:
            raise KeyError(db)
        layer = self._overlay.get(db)
        if layer is None:
            layer = self._overlay[db] = {}
        return layer

    def _set(self, db: str, layer: Layer, key: bytes, value: bytes | None) -> None:
        slot = (db, key)
        if slot not in self.undo:
            self.undo[slot] = layer.get(key, _Absent.ABSENT)
        layer[key] = value

    def put(self, db: str, key: bytes, value: bytes) -> None:
        if not key_fits(key):
            raise bad_key()
        self._set(db, self._layer(db), bytes(key), bytes(value))

    def put_many(self, db: str, items: Iterable[tuple[bytes, bytes]]) -> None:
        layer = self._layer(db)
        for key, value in items:
            if not key_fits(key):
                raise bad_key()
            self._set(db, layer, bytes(key), bytes(value))

    def delete(self, db: str, key: bytes) -> bool:
        return self.delete_many(db, [key]) == 1

    def delete_many(self, db: str, keys: Iterable[bytes]) -> int:
        wanted = [bytes(k) for k in keys if key_fits(k)]
        if not wanted:
            return 0
        existed = self.get_many(db, wanted)  # one round trip for the keys the overlay does not know
        layer = self._layer(db)
        gone = 0
        for key, old in zip(wanted, existed):
            if old is not None:
                self._set(db, layer, key, None)
                gone += 1
        return gone

    def drop(self, db: str) -> None:
        layer = self._layer(db)
        for key, _ in list(self.scan(db)):
            self._set(db, layer, key, None)

    def on_commit(self, fn: Callable[[], None]) -> None:
        self.callbacks.append(fn)

    def on_abort(self, fn: Callable[[], None]) -> None:
        self.aborts.append(fn)

    def remember(self, db: str, items: Iterable[tuple[bytes, bytes | None]]) -> None:
        """Ignored: the undo log records overlay entries, which cost no read: nothing to spare."""

    def rollback(self) -> None:
        for (db, key), old in self.undo.items():
            layer = self._overlay[db]
            if old is _Absent.ABSENT:
                layer.pop(key, None)
            else:
                layer[key] = old  # a value or None (deleted)


class Group:
    """Per-thread group-commit state: the overlay (None until the first write block), the
    callbacks and aborts of the savepoints that committed into it, and its commit's id."""

    __slots__ = ("aborts", "callbacks", "commit_id", "overlay")

    def __init__(self) -> None:
        self.overlay: Overlay | None = None
        self.callbacks: list[Callable[[], None]] = []
        self.commit_id = b""
        self.aborts: list[Callable[[], None]] = []


class ThreadState(threading.local):
    """This thread's open group and its stack of open savepoints."""

    def __init__(self) -> None:
        self.group: Group | None = None
        self.stack: list[RedisWriteTxn] = []
