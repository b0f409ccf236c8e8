"""Redis implementation of :class:`~kvcm.backends.metastore.base.MetaStore` (``store.backend = "redis"``).

The store is made of: the keys and Lua scripts it keeps in Redis
(:mod:`~kvcm.backends.metastore.redis_layout`), its connections and readiness probe
(:mod:`~kvcm.backends.metastore.redis_conn`), its transactions and read gate
(:mod:`~kvcm.backends.metastore.redis_txn`), its identity: the deployment it belongs to and the
single writer (:mod:`~kvcm.backends.metastore.redis_identity`), and its typed errors
(:mod:`~kvcm.backends.metastore.redis_errors`). This module joins them: the group commit, a
commit left in doubt, and what a follower and the metrics read.

Group commit: the overlay of a thread's group is committed by ONE Lua script call, which checks
the fencing token, the deployment and the type of every key before its first write. One
process-wide writer lock serialises write transactions, as LMDB's single writer does: only this
process writes (a later leader lease makes that so across hosts).

A lost connection during the commit call leaves its outcome in doubt; the store then asks for
``{P}:commit``: holding this commit's id means it was applied. Until Redis can tell, the
commit's memory side waits and every write is refused (:meth:`RedisStore.settle`).
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import redis

from kvcm.backends.metastore.base import DATABASES, merge_savepoint, run_aborts
from kvcm.backends.metastore.redis_cache import DEFAULT_BYTES, CommittedCache
from kvcm.backends.metastore.redis_conn import (
    CONNECT_TIMEOUT_S,
    PROBE_EVERY_S,
    Readiness,
    check_persistence,
    connect,
    connect_probe,
    redact,
    resolve,
)
from kvcm.backends.metastore.redis_errors import Fenced, InDoubt, NotReplicated, StoreLost, call, text, translate
from kvcm.backends.metastore.redis_identity import (
    RECORD_FILE,
    WATCH_EVERY_S,
    Identity,
    StoreRecord,
    WriterMark,
    identity_refusal,
)
from kvcm.backends.metastore.redis_layout import AT_RANKS, COMMIT, SCAN, Keys, commit_input, upper
from kvcm.backends.metastore.redis_txn import Gate, Group, RedisReadTxn, RedisWriteTxn, ThreadState
from kvcm.backends.metastore.redis_wire import Wire
from kvcm.errors import Code, Unavailable
from kvcm.lockfile import LockBusy, drop_lock_file, hold_lock_file

__all__ = [
    "CONNECT_TIMEOUT_S",
    "PROBE_EVERY_S",
    "RECORD_FILE",
    "WATCH_EVERY_S",
    "Fenced",
    "InDoubt",
    "NotReplicated",
    "RedisReadTxn",
    "RedisStore",
    "RedisWriteTxn",
    "StoreLost",
    "StoreRecord",
    "WriterMark",
    "check_persistence",
    "identity_refusal",
    "redact",
    "translate",
]

log = logging.getLogger("kvcm.backends.metastore")


class _Reading:
    __slots__ = ("_store",)

    def __init__(self, store: RedisStore) -> None:
        self._store = store

    def __enter__(self) -> RedisReadTxn:
        self._store.refuse_if_lost()
        if self._store.in_doubt:
            # Settled as soon as Redis can tell; until then a read may still be answered from
            # memory: what memory holds was committed before the doubtful commit was sent.
            try:
                self._store.settle()
            except Unavailable:
                pass
        self._store.gate.enter()
        return RedisReadTxn(self._store)

    def __exit__(self, *exc: object) -> None:
        self._store.gate.leave()


class RedisStore:
    """Metadata store on Redis. Thread-safe; one writer at a time in this process.

    ``path``: the data dir for kvcm's local files (its lock, the reclaimer's recency, the engine
    index, the default file storage); the metadata itself lives in Redis. ``fencing_token``:
    when set, a commit is refused (:class:`Fenced`) once ``{P}:epoch`` holds a higher number."""

    def __init__(
        self,
        url: str,
        path: str | None = None,
        prefix: str = "kvcm",
        password: str | None = None,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        fencing_token: int | None = None,
    ) -> None:
        self.path = path
        self.url = url
        self.prefix = prefix
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.fencing_token = fencing_token
        # Set (to the refusal's message) on a follower's store: it reads the leader's data and
        # must never write, whatever code path tries.
        self.read_only = ""
        self._lock_path = self._lock_dir(path) if path is not None else None
        #: the Redis node the deployment's slot is on (``url`` itself unless it names a cluster)
        self.node_url = url
        self.client = self._connect(url, password)
        self.keys = Keys.of(prefix)
        self.epoch_key, self.commit_key = self.keys.epoch, self.keys.commit
        self.versions_key, self.deployment_key = self.keys.versions, self.keys.deployment
        self.wire = Wire(self.client)
        self.commit_script = self.client.register_script(COMMIT)
        self.scan_script = self.client.register_script(SCAN)
        self._ranks_script = self.client.register_script(AT_RANKS)
        self._writer = threading.RLock()
        self.gate = Gate()
        self._local = ThreadState()
        self._ids = itertools.count()
        self._run = uuid.uuid4().hex[:12]
        self._closed = False
        self.in_doubt: list[Group] = []  # commits whose outcome Redis could not tell (settle)
        #: what this store's writer knows Redis holds (:meth:`enable_cache`; None: no caching)
        self.cache: CommittedCache | None = None
        self._doubt_lock = threading.RLock()
        self._probe = connect_probe(self.node_url, password)
        self.readiness = Readiness(self._probe)
        self.identity = Identity(self.client, self._probe, self.keys, prefix, url, self._run)

    def _lock_dir(self, path: str) -> str:
        os.makedirs(path, exist_ok=True)
        lock = os.path.join(path, "kvcm.lock")
        try:
            hold_lock_file(lock, f"the store object {id(self):x}", f"data dir {path!r}")
        except LockBusy:
            from kvcm.backends.metastore.lmdb import DataDirLocked

            raise DataDirLocked(f"data dir {path!r} is in use by another kvcm process (lock file kvcm.lock); "
                                "stop it or choose another --data-dir") from None
        return lock

    def _connect(self, url: str, password: str | None) -> redis.Redis:
        """The data-plane connection; the data dir's lock is given back if there is none."""
        try:
            self.node_url = resolve(url, self.prefix, password)
            return connect(self.node_url, password)
        except BaseException:
            self._release_lock()
            raise

    def _release_lock(self) -> None:
        if self._lock_path is not None:
            drop_lock_file(self._lock_path)
            self._lock_path = None

    def enable_cache(self, max_bytes: int = DEFAULT_BYTES) -> None:
        """Keep what this store commits and reads (:mod:`~kvcm.backends.metastore.redis_cache`):
        only for the deployment's one writer, whose own commits are the only changes."""
        if self.read_only:
            raise ValueError("a read-only store reads another process's writes: it cannot cache them")
        self.cache = CommittedCache(max_bytes)

    def hash_key(self, db: str) -> bytes:
        return self.keys.hash[db]

    def zset_key(self, db: str) -> bytes:
        return self.keys.zset[db]

    def describe(self) -> str:
        """One line for the start-up block (no password)."""
        wait = f", WAIT {self.wait_replicas} replica(s)" if self.wait_replicas else ""
        return f"redis {redact(self.url)}, prefix {self.prefix}{wait}"

    def is_empty(self) -> bool:
        """No database of this prefix holds a key (a new or wrong prefix / Redis db)."""
        pipe = self.client.pipeline(transaction=False)
        for name in DATABASES:
            pipe.exists(self.keys.hash[name])
        return not any(call(pipe.execute))

    # -- transactions -------------------------------------------------------------------------

    def read(self) -> _Reading:
        return _Reading(self)

    @contextmanager
    def group(self) -> Iterator[None]:
        self.refuse_if_lost()
        if self.in_doubt:
            self.settle()
        if self._local.group is not None:
            yield  # already inside a group on this thread: join it
            return
        group = self._local.group = Group()
        try:
            yield
        except BaseException:
            self._local.group = None
            self._end(group)
            run_aborts(group.aborts)
            raise
        self._local.group = None
        shortfall = self._commit_group(group)
        for fn in group.callbacks:
            fn()
        if shortfall is not None:
            raise shortfall  # applied (memory follows the store), but not on enough replicas

    def _commit_group(self, group: Group) -> NotReplicated | None:
        """Commit the group's overlay; on a failure, its aborts run, unless the commit is in doubt."""
        try:
            return self._commit(group)
        except InDoubt:
            # Neither its aborts (slots given back that Redis may hold as serving, then handed
            # out twice) nor its callbacks: whichever is true is run once Redis can tell.
            with self._doubt_lock:
                self.in_doubt.append(group)
            raise
        except BaseException:
            run_aborts(group.aborts)  # a failed commit applied nothing
            raise
        finally:
            self._end(group)

    def _end(self, group: Group) -> None:
        if group.overlay is not None:
            group.overlay = None
            self._writer.release()

    @contextmanager
    def write(self, join: bool = False) -> Iterator[RedisWriteTxn]:
        group = self._local.group
        stack = self._local.stack
        if join and group is not None and stack:
            yield stack[-1]  # no savepoint of its own: its errors roll back the enclosing block
            return
        if group is None:
            with self.group(), self.write() as txn:
                yield txn
            return
        if group.overlay is None:
            self._writer.acquire()  # released when the group ends (_end)
            group.overlay = {}
        child = RedisWriteTxn(self, group.overlay)
        stack.append(child)
        try:
            yield child
        except BaseException:
            stack.pop()
            child.rollback()
            run_aborts(child.aborts)
            raise
        stack.pop()
        merge_savepoint(child, stack, group)

    def _commit(self, group: Group) -> NotReplicated | None:
        """Apply the overlay in one script call; returns the replica shortfall, if any."""
        keys, args = commit_input(self.keys, group.overlay or {})
        if not keys:
            return None
        if self.read_only:
            raise Unavailable(self.read_only, Code.SERVER_NOT_LEADER)
        if self.in_doubt:  # another thread's commit: settled first, its marker is about to be overwritten
            self.settle()
        commit_id = group.commit_id = f"{self._run}-{next(self._ids)}".encode()
        token = b"" if self.fencing_token is None else str(self.fencing_token).encode()
        cache = self.cache
        if cache is not None:
            cache.begin_commit()  # no read sent from now on is kept: it may be older than this commit
        try:
            with self.gate.exclusive():
                self._apply(keys, [token, commit_id, self.deployment.encode(), *args], commit_id)
        except InDoubt:
            raise  # the cache was emptied, and keeps nothing until settle() tells what Redis holds
        except BaseException:
            if cache is not None:
                cache.end_commit(None)
            raise
        if cache is not None:
            cache.end_commit(group.overlay)
        return self._wait_replicas()

    def _apply(self, keys: list[bytes], args: list[bytes | int], commit_id: bytes) -> None:
        """One call of the commit script; a lost reply is resolved by the commit marker."""
        try:
            self.wire.evalsha(self.commit_script,
                              [self.epoch_key, self.commit_key, self.versions_key, self.deployment_key, *keys], args)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if self.cache is not None:
                self.cache.clear()  # whatever the marker says: what a reply got lost around is not kept
            self._resolve_in_doubt(commit_id, exc)
        except redis.RedisError as exc:
            if str(exc).startswith("KVCMLOST"):
                raise self.identity.lose(str(exc).split(" ", 1)[1] if " " in str(exc) else "") from None
            raise translate(exc) from None

    def _resolve_in_doubt(self, commit_id: bytes, exc: Exception) -> None:
        """The connection failed around the commit call: applied iff the marker holds its id."""
        try:
            marker = self.client.get(self.commit_key)
        except redis.RedisError:
            log.error("metadata commit %s: outcome unknown, Redis unreachable (%s); settled when Redis "
                      "answers again", commit_id.decode(), exc)
            raise InDoubt(f"metadata store (Redis) unavailable during a commit, outcome unknown: {exc}",
                          Code.SERVICE_NOT_READY) from None
        if marker != commit_id:
            raise Unavailable(f"metadata store (Redis) unavailable: {exc}", Code.SERVICE_NOT_READY) from None
        log.warning("metadata commit %s was applied although its reply was lost (%s)", commit_id.decode(), exc)

    def settle(self) -> None:
        """Run the memory side of every commit left in doubt (its callbacks if Redis applied it,
        else its aborts), oldest first, once Redis answers; until then every write of this store
        is refused, so no slot is handed out twice and no later commit overwrites the marker
        that tells. Reads settle first when they can. :raises Unavailable: Redis still cannot
        tell."""
        with self._doubt_lock:
            while self.in_doubt:
                group = self.in_doubt[0]
                try:
                    marker = self.client.get(self.commit_key)
                except redis.RedisError as exc:
                    raise Unavailable(f"metadata store (Redis) unavailable; a commit made when it went away "
                                      f"is still in doubt: {exc}", Code.SERVICE_NOT_READY) from None
                # Nothing of this process committed since (everything waited here), so the marker
                # names this commit iff Redis applied it.
                applied = marker == group.commit_id
                self.in_doubt.pop(0)
                if self.cache is not None:
                    self.cache.end_commit(None)  # cleared when it went in doubt: refilled from Redis
                log.warning("metadata commit %s %s", group.commit_id.decode(),
                            "was applied after all" if applied else "was not applied")
                if applied:
                    for fn in group.callbacks:
                        fn()
                else:
                    run_aborts(group.aborts)

    def _wait_replicas(self) -> NotReplicated | None:
        if self.wait_replicas <= 0:
            return None
        try:
            acked = int(self.client.wait(self.wait_replicas, self.wait_timeout_ms))
        except redis.RedisError as exc:
            acked, reason = 0, f"WAIT failed: {exc}"
        else:
            reason = f"{acked} replica(s) acknowledged within {self.wait_timeout_ms} ms"
        if acked >= self.wait_replicas:
            return None
        return NotReplicated(f"metadata commit applied on the Redis primary but not confirmed on "
                             f"{self.wait_replicas} replica(s): {reason}")

    # -- identity: the deployment, lost data, the single writer (redis_identity) ----------------

    @property
    def deployment(self) -> str:
        """This deployment's id, checked by every commit ("" = unchecked: a store opened by a
        tool or a test, never claimed). Set by :meth:`claim`."""
        return self.identity.deployment

    @property
    def lost(self) -> str:
        """Why the store is not this deployment's any more ("" = it is): then every read, commit
        and readiness probe is refused (:class:`StoreLost`)."""
        return self.identity.lost

    def stored_deployment(self) -> str | None:
        """The deployment id the store holds (None: no key, a new or lost store)."""
        return self.identity.stored()

    def check_start(self, data_dir: str, writer: bool) -> None:
        """Refuse a start that must not serve this store (:meth:`Identity.check_start`); a
        ``writer`` then holds the writer mark until :meth:`close`."""
        self.identity.check_start(data_dir, writer)

    def claim(self, data_dir: str, create: bool = True) -> None:
        """Make this store the data dir's (:meth:`Identity.claim`)."""
        self.identity.claim(data_dir, create)

    def watch(self) -> None:
        """A writer's check, every :data:`WATCH_EVERY_S` (a thread of the app): the store still
        holds this deployment, and the writer mark is still this process's (:meth:`Identity.watch`)."""
        if not self._closed:
            self.identity.watch()

    def refuse_if_lost(self) -> None:
        """:raises StoreLost: the store is not this deployment's any more."""
        self.identity.refuse_if_lost()

    def lost_error(self) -> StoreLost | None:
        """What every request is answered while the store is lost; None while it is not."""
        return self.identity.lost_error()

    # -- what a follower, the readiness probe and the metrics read ------------------------------

    def reachable(self) -> bool:
        """Redis answered a PING within ``PROBE_TIMEOUT_S`` (the answer is reused for
        ``PROBE_EVERY_S``): what the readiness probe reports about the store."""
        return not self.lost and self.readiness.answered()

    def commit_marker(self) -> bytes | None:
        """The id of the last commit applied (None: none yet, or the store was emptied): one GET,
        what a follower asks per turn before it reads every database's version."""
        self.refuse_if_lost()
        marker = call(self.client.get, self.commit_key)
        return marker.encode() if isinstance(marker, str) else marker

    def versions(self, dbs: Sequence[str]) -> tuple[int, ...]:
        """How many commits touched each of ``dbs`` so far (0 = never): a reader that cached
        something of a database knows it is stale when its number moved."""
        self.refuse_if_lost()
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(self.versions_key, [self.keys.hash[db] for db in dbs])
        pipe.get(self.deployment_key)
        got: list[bytes | None]
        stored: bytes | None
        got, stored = call(pipe.execute)
        self.identity.check_deployment(None if stored is None else text(stored))
        return tuple(int(v) if v is not None else 0 for v in got)

    def sample(self, db: str, n: int, prefix: bytes = b"") -> list[tuple[bytes, bytes]]:
        """Up to ``n`` items picked uniformly at random (by rank: every score is 0)."""
        if n <= 0:
            return []
        zset = self.keys.zset[db]
        with self.read():
            first, size = self._rank_range(zset, prefix)
            if size == 0:
                return []
            ranks = [first + r for r in random.sample(range(size), min(n, size))]
            found: list[bytes]
            values: list[bytes | None]
            found, values = call(self._ranks_script, keys=[zset, self.keys.hash[db]], args=ranks)
        return [(k, v) for k, v in zip(found, values) if v is not None and k.startswith(prefix)]

    def _rank_range(self, zset: bytes, prefix: bytes) -> tuple[int, int]:
        """``(first rank, how many)`` of the keys with ``prefix``, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        if prefix:
            pipe.zlexcount(zset, "-", b"(" + prefix)
            end = upper(prefix)
            pipe.zlexcount(zset, b"[" + prefix, b"(" + end if end is not None else "+")
        else:
            pipe.zcard(zset)
        counts = [int(c) for c in call(pipe.execute)]
        return (counts[0], counts[1]) if prefix else (0, counts[0])

    def stats(self) -> dict[str, int]:
        pipe = self.client.pipeline(transaction=False)
        for name in DATABASES:
            pipe.hlen(self.keys.hash[name])
        counts = call(pipe.execute)
        facts = {f"entries.{name}": int(c) for name, c in zip(DATABASES, counts)}
        memory = call(self.client.info, "memory")
        facts["used_bytes"] = int(memory.get("used_memory", 0))
        return facts

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.identity.drop_mark()
        with self._writer, self.gate.exclusive():
            self.client.close()
        self._probe.close()
        self._release_lock()
