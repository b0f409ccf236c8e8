"""LMDB implementation of :class:`~kvcm.backends.metastore.base.MetaStore`.

One environment under the data dir, one named sub-database per entry of ``DATABASES``.
Durability: with ``sync=True`` (default) every top-level commit is fsynced before it returns,
so anything acknowledged after a commit survives ``kill -9`` and power loss (as far as the disk
honours fdatasync). Throughput comes from group commit (``group()``), not from weakening sync.

Rules from py-lmdb and lmdb.h this module enforces:

* a write transaction is opened, used and committed on one thread; nested ``write()`` blocks on
  that thread become savepoints of it (an undo log each, see
  :class:`~kvcm.backends.metastore.lmdb_txn.LmdbWriteTxn`), never a second writer (deadlock). An LMDB
  error inside (e.g. MDB_MAP_FULL) leaves the shared transaction unusable, so the whole group
  then aborts and raises it: nothing of it is acknowledged;
* ``set_mapsize`` needs a process with no live transaction, so growth waits at :class:`_Gate`
  until every transaction has ended;
* ``MapFullError`` becomes :class:`~kvcm.errors.StoreFull` (``CAPACITY_EXHAUSTED``); the next
  top-level write grows the map (doubling) up to ``map_size_max``, and :meth:`LmdbStore.grow`
  does it at once (the dispatcher then runs the failed batch again);
* a data dir is used by one kvcm at a time: an ``flock`` on ``kvcm.lock`` refuses a second one;
* an environment must not be used across ``fork()`` (lmdb.h: "Use an MDB_env* in the process
  which opened it, without fork()ing"); py-lmdb does not stop a child, so a store refuses every
  transaction in a forked child with a clear error.

Followers (:meth:`LmdbStore.follow`): other processes on the host may read the environment live
while the one writer (the leader, holding ``kvcm.lock``) writes it; LMDB keeps a reader table in
``lock.mdb`` for them. A follower opens the environment read-only (``lock.mdb`` still has to be
writable: the reader table lives there), takes no ``kvcm.lock``, creates nothing, runs no
migration and refuses every write (``SERVER_NOT_LEADER``). Each read transaction sees the latest
commit. Each commit of the writer (``count_versions``) counts one more version per database it wrote
(:meth:`LmdbStore.versions`, see :mod:`~kvcm.backends.metastore.lmdb_txn`), so a follower knows
cheaply what changed. When the writer grows the map past a follower's mapping, the follower's next
transaction fails with MDB_MAP_RESIZED: it maps the new size (no transaction of its process may be
live then, so it waits at :class:`_Gate`) and begins again. lmdb.h forbids opening one environment
twice in one process (closing either drops the other's locks); py-lmdb refuses it ("already open
in this process"), so a process cannot follow a data dir it writes, nor write one it follows.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import lmdb

from kvcm.backends.metastore.base import DATABASES, merge_savepoint, run_aborts
from kvcm.backends.metastore.lmdb_txn import (
    LmdbReadTxn,
    LmdbWriteTxn,
    RefusingWriteTxn,
    Touched,
    bump_versions,
    key_range,
    read_versions,
    translate_error,
)
from kvcm.backends.migrations import METASTORE, upgrade_lmdb_layout
from kvcm.errors import Code, ServerError, Unavailable
from kvcm.lockfile import LockBusy, drop_lock_file, hold_lock_file

log = logging.getLogger("kvcm.backends.metastore")

_GROW_AT = 0.75  # grow the map once it is this full, before a write fails

# The meta key kvcm.control.registry keeps the store's schema version under (METASTORE's format).
_SCHEMA_KEY = b"registry.schema"

_NOT_INITIALISED = "no leader has initialised the store yet"


class DataDirLocked(Unavailable):
    """Another process holds the data dir."""


class _Gate:
    """Shared/exclusive gate: transactions enter shared, map growth enters exclusive.

    Every read request passes it twice, so the uncontended shared path takes one plain lock
    and nothing else (a Condition over an RLock cost about 2 us per request)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._active = 0
        self._exclusive = False

    def enter(self) -> None:
        with self._lock:
            while self._exclusive:
                self._cond.wait()
            self._active += 1

    def leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0 and self._exclusive:
                self._cond.notify_all()  # only a grower waits for the count to reach zero

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._lock:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._lock:
                self._exclusive = False
                self._cond.notify_all()


class _Group:
    """Per-thread group-commit state: the lazily opened top-level txn and its callbacks.

    ``broken``: an LMDB error inside the transaction (LMDB then refuses every further operation
    on it, e.g. after MDB_MAP_FULL) or a failed rollback; the group can only abort, and it raises
    this error at its end so nothing of it is acknowledged."""

    __slots__ = ("aborts", "broken", "callbacks", "implicit", "touched", "txn")

    def __init__(self, implicit: bool = False) -> None:
        self.txn: lmdb.Transaction | None = None
        self.touched: Touched = {}  # the databases its savepoints wrote: their versions move at commit
        self.callbacks: list[Callable[[], None]] = []
        self.aborts: list[Callable[[], None]] = []  # of committed savepoints: run if the txn never commits
        self.broken: Exception | None = None
        self.implicit = implicit  # opened by a lone write(): its rollback is the abort


class _ThreadState(threading.local):
    """This thread's open group, its stack of open savepoints, and how many transactions it
    holds on the gate."""

    def __init__(self) -> None:
        self.group: _Group | None = None
        self.stack: list[LmdbWriteTxn] = []
        self.held = 0


class _Reading:
    """``with store.read() as view``: a class rather than a generator context manager, since
    every lookup request opens one (the generator cost about 2 us of a 40 us request)."""

    __slots__ = ("_store", "_txn")

    def __init__(self, store: LmdbStore) -> None:
        self._store = store
        self._txn: lmdb.Transaction | None = None

    def __enter__(self) -> LmdbReadTxn:
        store = self._store
        store._enter()
        try:
            self._txn = store._begin_read()
        except BaseException:
            store._leave()
            raise
        return LmdbReadTxn(self._txn, store._dbs)

    def __exit__(self, *exc: object) -> None:
        try:
            if self._txn is not None:
                self._txn.abort()
        finally:
            self._store._leave()


class LmdbStore:
    """Metadata store on LMDB. Thread-safe: each thread gets its own transactions."""

    def __init__(
        self,
        path: str,
        map_size: int = 256 << 20,
        map_size_max: int = 64 << 30,
        sync: bool = True,
        max_readers: int = 126,
        lock_dir: bool = True,
        count_versions: bool = True,
    ) -> None:
        """``count_versions``: count each commit's databases (:meth:`versions`) for followers
        reading this environment; off where nobody follows, a commit then writes no ``meta`` page."""
        self.path: str | None = path
        self.count_versions = count_versions
        os.makedirs(path, exist_ok=True)
        self._lock_path = self._lock_dir(path) if lock_dir else None
        self.map_size_max = max(map_size, map_size_max)
        self.sync = sync
        # Set (to the refusal's message) on a follower: it reads the leader's data and must
        # never write, whatever code path tries.
        self.read_only = ""
        try:
            self._env = lmdb.open(
                os.path.join(path, "meta"),
                map_size=map_size,
                max_dbs=len(DATABASES) + 8,
                sync=sync,
                metasync=sync,
                max_readers=max_readers,
                subdir=True,
            )
        except BaseException:  # e.g. this process follows it (py-lmdb: "already open in this process")
            self._drop_lock()
            raise
        self._attach({name: self._env.open_db(name.encode()) for name in DATABASES})
        upgrade_lmdb_layout(self._env, self._dbs)  # the layout steps of kvcm.backends.migrations

    def _attach(self, dbs: dict[str, lmdb._Database]) -> None:
        """The state every store keeps beside its open environment."""
        self.stale_readers_cleared = 0
        self._clear_stale_readers()  # slots left by killed readers of a previous run
        self._dbs = dbs
        self._meta = dbs["meta"]
        self._gate = _Gate()
        self._local = _ThreadState()
        self._closed = False
        self._forked = False  # set in a child process after fork(): see _mark_forked
        _open_stores.add(self)

    @classmethod
    def follow(cls, path: str, max_readers: int = 126,
               reason: str = "this node is a follower: the leader writes the metadata store") -> LmdbStore:
        """A read-only store of the environment under data dir ``path`` that another process
        (the leader) writes; every write raises ``Unavailable(reason, SERVER_NOT_LEADER)``.

        :raises Unavailable: ``SERVICE_NOT_READY`` when no leader has made the environment or
            every database yet, its schema version is not the one this kvcm writes (a follower
            runs no migration), or this process already has it open."""
        store = cls.__new__(cls)
        store.path, store._lock_path, store.sync, store.read_only = path, None, False, reason
        store.count_versions = False
        env_dir = os.path.join(path, "meta")
        if not os.path.isfile(os.path.join(env_dir, "data.mdb")):
            raise Unavailable(f"metadata store {path!r}: {_NOT_INITIALISED} (no meta/data.mdb)",
                              Code.SERVICE_NOT_READY)
        try:
            # map_size 0: the size the writer last set; max_readers counts only if this
            # process makes lock.mdb (else the writer's size of the reader table holds).
            env = lmdb.open(env_dir, readonly=True, create=False, map_size=0, max_dbs=len(DATABASES) + 8,
                            max_readers=max_readers, subdir=True)
        except lmdb.Error as exc:
            raise Unavailable(f"metadata store {path!r}: cannot open it to follow ({exc}); "
                              f"{_NOT_INITIALISED}?", Code.SERVICE_NOT_READY) from None
        try:
            store._env = env
            store.map_size_max = int(env.info()["map_size"])  # the writer's to grow
            store._attach(_follower_dbs(env, path))
            _check_schema(store, path)
        except lmdb.Error as exc:  # e.g. the writer grew the map while the databases were opened
            store._abandon()
            raise Unavailable(f"metadata store {path!r}: cannot open it to follow ({exc}); try again",
                              Code.SERVICE_NOT_READY) from None
        except BaseException:
            store._abandon()
            raise
        return store

    def _abandon(self) -> None:
        """Close a follower whose opening failed."""
        _open_stores.discard(self)
        self._closed = True
        self._env.close()

    def _lock_dir(self, path: str) -> str:
        """Hold ``kvcm.lock`` (see :mod:`kvcm.lockfile`: a clean close removes it again)."""
        lock = os.path.join(path, "kvcm.lock")
        try:
            hold_lock_file(lock, f"the store object {id(self):x}", f"data dir {path!r}")
        except LockBusy:
            raise DataDirLocked(
                f"data dir {path!r} is in use by another kvcm process (lock file kvcm.lock); "
                "stop it or choose another --data-dir"
            ) from None
        return lock

    # -- transactions -------------------------------------------------------------------------

    def read(self) -> _Reading:
        return _Reading(self)

    @contextmanager
    def group(self) -> Iterator[None]:
        """Share one top-level transaction among the ``write()`` blocks inside; commit once."""
        if self._local.group is not None:
            yield  # already inside a group on this thread: join it
            return
        with self._group(_Group()):
            yield

    @contextmanager
    def _group(self, group: _Group) -> Iterator[None]:
        self._local.group = group
        try:
            yield
        except BaseException:
            self._local.group = None
            if group.txn is not None:
                group.txn.abort()
                self._leave()
            run_aborts(group.aborts)
            raise
        self._local.group = None
        if group.txn is not None:
            if group.broken is not None:
                group.txn.abort()
                self._leave()
                run_aborts(group.aborts)
                raise group.broken
            try:
                self._commit_top(group.txn, group.touched)
            except BaseException:
                run_aborts(group.aborts)  # a failed commit made nothing durable
                raise
        for fn in group.callbacks:
            fn()

    @contextmanager
    def write(self, join: bool = False) -> Iterator[LmdbWriteTxn]:
        group = self._local.group
        if join and group is not None and group.broken is None:
            open_blocks = self._local.stack
            if open_blocks:
                yield open_blocks[-1]  # no savepoint of its own: its errors roll back the enclosing block
                return
        if group is None:
            with self._group(_Group(implicit=True)), self.write() as txn:
                yield txn
            return
        if group.broken is not None:
            raise group.broken
        if group.txn is None:
            group.txn = self._begin_top()
        stack = self._local.stack
        # A savepoint (see LmdbWriteTxn), not an LMDB child transaction. The only savepoint of a
        # group opened by this very write() needs no undo log: its rollback aborts the group.
        lone = group.implicit and not stack
        if self.read_only:
            child: LmdbWriteTxn = RefusingWriteTxn(group.txn, self._dbs, self.read_only)
        else:
            child = LmdbWriteTxn(group.txn, self._dbs, [], None if lone else {}, group.touched)
        stack.append(child)
        try:
            yield child
        except lmdb.Error as exc:
            stack.pop()
            translated = translate_error(exc)
            group.broken = translated  # LMDB refuses any further use of this transaction
            run_aborts(child.aborts)
            raise translated from None
        except BaseException:
            stack.pop()
            if child.undo is not None and group.broken is None:
                try:
                    child.rollback()
                except lmdb.Error as exc:
                    group.broken = translate_error(exc)
            run_aborts(child.aborts)  # rolled back, or its group can only abort
            raise
        stack.pop()
        merge_savepoint(child, stack, group)

    def _begin_top(self) -> lmdb.Transaction:
        if self.read_only:  # a follower's group reads through its RefusingWriteTxn blocks
            self._enter()
            try:
                return self._begin_read()
            except BaseException:
                self._leave()
                raise
        self._maybe_grow()
        self._enter()
        try:
            return self._env.begin(write=True)
        except lmdb.Error as exc:
            self._leave()
            raise translate_error(exc) from None

    def _commit_top(self, txn: lmdb.Transaction, touched: Touched) -> None:
        try:
            if touched and self.count_versions:
                bump_versions(txn, self._meta, touched)
            txn.commit()  # with sync on, LMDB fsyncs inside commit()
        except lmdb.Error as exc:
            txn.abort()  # a no-op after a failed commit(); a failed bump leaves the txn live
            raise translate_error(exc) from None
        finally:
            self._leave()

    def _begin_read(self) -> lmdb.Transaction:
        try:
            return self._env.begin(buffers=False)
        except lmdb.MapResizedError:
            self._adopt_map_size()
            return self._env.begin(buffers=False)
        except lmdb.ReadersFullError:
            # Every reader slot taken: often by processes that died holding one (a killed
            # inspection tool), which only a reader check notices.
            if not self._clear_stale_readers():
                raise Unavailable("metadata store: every LMDB reader slot is in use; raise store.max_readers",
                                  Code.SERVICE_NOT_READY) from None
            return self._env.begin(buffers=False)

    def _adopt_map_size(self) -> None:
        """Map the size another process (the writer) grew the map to. The mapping may change
        only while this process has no live transaction: this thread gives up its place at the
        gate and waits for the others' to end. A thread that holds another transaction cannot
        (it would wait on itself): its request fails, to be tried again."""
        if self._local.held != 1:
            raise Unavailable("metadata store: the leader grew the LMDB map while this request held a "
                              "transaction; try again", Code.SERVICE_NOT_READY)
        self._leave()
        try:
            with self._gate.exclusive():
                self._env.set_mapsize(0)  # 0: the size the writer set (lmdb.h, mdb_env_set_mapsize)
        finally:
            self._enter()

    def versions(self, dbs: Sequence[str]) -> tuple[int, ...]:
        """How many commits wrote each of ``dbs`` so far (0 = never), read in one transaction: a
        reader that cached something of a database knows it is stale when its number moved.
        A savepoint rolled back inside a committed group does not count."""
        with self.read() as view:
            return read_versions(view, dbs)

    def _clear_stale_readers(self) -> int:
        cleared = int(self._env.reader_check())
        if cleared:
            self.stale_readers_cleared += cleared
            log.warning("cleared %d LMDB reader slots of dead processes", cleared)
        return cleared

    def _enter(self) -> None:
        if self._forked:
            raise ServerError("this metadata store was opened by the parent of a fork(); "
                              "open the data dir again in this process", Code.INTERNAL_ERROR)
        # Re-entrant per thread: a thread that already holds the gate must not queue behind a
        # waiting grower, or the grower (waiting for this thread) and this thread deadlock.
        held = self._local.held
        if held == 0:
            self._gate.enter()
        self._local.held = held + 1

    def _leave(self) -> None:
        self._local.held -= 1
        if self._local.held == 0:
            self._gate.leave()

    # -- map growth ----------------------------------------------------------------------------

    def _used_bytes(self) -> int:
        info = self._env.info()
        return int((info["last_pgno"] + 1) * self._env.stat()["psize"])

    def _maybe_grow(self) -> None:
        size = int(self._env.info()["map_size"])
        if size < self.map_size_max and self._used_bytes() >= size * _GROW_AT:
            self._grow_from(size)

    def grow(self) -> bool:
        """Double the map now (up to ``map_size_max``), e.g. after a transaction found it full
        while it was less than ``_GROW_AT`` used. False: at the limit, or this thread holds a
        transaction (waiting for every transaction to end would then wait on itself)."""
        if self.read_only:
            return False  # the writer grows the map; a follower adopts it (_adopt_map_size)
        size = int(self._env.info()["map_size"])
        return size < self.map_size_max and self._grow_from(size)

    def _grow_from(self, size: int) -> bool:
        if self._local.held:
            return False  # this thread holds a transaction: growing now would wait on itself
        with self._gate.exclusive():
            new = min(size * 2, self.map_size_max)
            if int(self._env.info()["map_size"]) < new:
                self._env.set_mapsize(new)
        return True

    # -- misc ------------------------------------------------------------------------------------

    def sample(self, db: str, n: int, prefix: bytes = b"") -> list[tuple[bytes, bytes]]:
        """Up to ``n`` random items: probes spread uniformly between the first and last key.

        Each probe takes the next key at or after a random point, so keys after a wide gap are
        more likely to be picked: good enough for sampled eviction, not a uniform sample.
        """
        with self.read() as view:
            items = list(view.scan(db, prefix=prefix, limit=n * 4 + 1))
            if len(items) <= n * 4:
                return random.sample(items, min(max(n, 0), len(items)))
            lo, hi = key_range(view, db, prefix)
            width = max(len(lo), len(hi))
            low, high = int.from_bytes(lo.ljust(width, b"\0"), "big"), int.from_bytes(hi.ljust(width, b"\0"), "big")
            out: dict[bytes, bytes] = {}
            for _ in range(n * 3):
                probe = random.randint(low, high).to_bytes(width, "big")
                for key, value in view.scan(db, start=probe, prefix=prefix, limit=1):
                    out[key] = value
                if len(out) >= n:
                    break
        return list(out.items())

    def stats(self) -> dict[str, int]:
        info = self._env.info()
        facts = {
            "map_size": int(info["map_size"]),
            "used_bytes": self._used_bytes(),
            "readers": int(info["num_readers"]),
            "stale_readers_cleared": self.stale_readers_cleared + self._clear_stale_readers(),
        }
        with self.read() as view:
            for name in DATABASES:
                facts[f"entries.{name}"] = view.count(name)
        return facts

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._gate.exclusive():
            self._env.close()
        self._drop_lock()

    def _drop_lock(self) -> None:
        """Give up ``kvcm.lock`` (a follower holds none)."""
        if self._lock_path is not None:
            drop_lock_file(self._lock_path)
            self._lock_path = None


_open_stores: weakref.WeakSet[LmdbStore] = weakref.WeakSet()


def _follower_dbs(env: lmdb.Environment, path: str) -> dict[str, lmdb._Database]:
    """Open every database without creating any (a read transaction: the env is read-only)."""
    dbs = {}
    for name in DATABASES:
        try:
            dbs[name] = env.open_db(name.encode(), create=False)
        except lmdb.NotFoundError:
            raise Unavailable(f"metadata store {path!r}: {_NOT_INITIALISED} (no database {name!r})",
                              Code.SERVICE_NOT_READY) from None
    return dbs


def _check_schema(store: LmdbStore, path: str) -> None:
    """The schema version must be the one this kvcm writes: a follower runs no upgrade, the
    leader (of this kvcm version) does, and a newer one is not read."""
    with store.read() as view:
        found = view.get("meta", _SCHEMA_KEY)
    if found is None:
        raise Unavailable(f"metadata store {path!r}: {_NOT_INITIALISED} (no schema version; this kvcm "
                          f"reads version {METASTORE.current})", Code.SERVICE_NOT_READY)
    if found != METASTORE.marker:
        shown = found.decode("ascii", "replace")
        raise Unavailable(f"metadata store {path!r}: schema version {shown} found, this kvcm reads version "
                          f"{METASTORE.current}; a follower runs no migration: let a leader of this kvcm "
                          "version open it first, or run the kvcm version that wrote it", Code.SERVICE_NOT_READY)


def _mark_forked() -> None:
    for store in list(_open_stores):
        store._forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked)
