"""Redis implementation of :class:`~kvcm.backends.metastore.base.MetaStore` (``store.backend = "redis"``).

Layout: each named database is a hash of values (``{P}:h:<db>``) plus a sorted set of its keys
with every score 0 (``{P}:z:<db>``), so ``ZRANGEBYLEX`` walks them in byte order for ``scan``.
``{P}:epoch`` is the fencing epoch and ``{P}:commit`` the id of the last commit. Every key
carries one hash tag ``{P}`` (``store.redis_prefix``), so a Redis Cluster keeps all of one
kvcm's keys on one slot (multi-key scripts need that) and deployments with different prefixes
share one Redis.

Transactions: a write transaction buffers its puts and deletes in an overlay its own reads see;
a nested ``write()`` block is a savepoint with an undo log of overlay entries (as in
:class:`~kvcm.backends.metastore.lmdb_txn.LmdbWriteTxn`). The group's overlay is committed by ONE Lua script
call: Redis runs a script atomically, and the script checks the fencing token and the type of
every key it will touch *before* its first write, because Redis does not undo the writes of a
script that fails midway. One process-wide writer lock serialises write transactions, as LMDB's
single writer does: only this process writes (a later leader lease makes that so across hosts).

Read isolation: Redis has no snapshots. A read transaction holds a shared gate that this
process's commits take exclusively, so a read transaction never straddles this process's own
commit: within one ``read()`` block every read sees the same committed state, as long as no other
process writes the same prefix (the single-writer rule above).

Identity: ``{P}:deployment`` holds the id of the deployment that created the store, recorded in
each data dir that serves it (:class:`StoreRecord`). Every commit checks it, a writer watches it
(:meth:`RedisStore.watch`) and a follower reads it with the versions: a Redis that lost it (a
restart without persistence, a flush) lost the metadata, and the store turns lost
(:class:`StoreLost`) instead of answering from memory or writing into an empty store; a start on
such a store, or on another deployment's, is refused naming the remedy. Without the lease the
writer holds ``{P}:writer`` (:class:`WriterMark`), so a second deployment on the prefix is refused.

A lost connection during the commit call leaves its outcome in doubt; the store then asks for
``{P}:commit``: holding this commit's id means it was applied. Redis errors become kvcm's
typed errors (a connection failure is :class:`~kvcm.errors.Unavailable`), never raw redis-py
exceptions.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvcm.backends.metastore.base import DATABASES, bad_key, key_fits, merge_savepoint, run_aborts
from kvcm.errors import Code, ServerError, StartRefused, Unavailable
from kvcm.lockfile import LockBusy, drop_lock_file, hold_lock_file

log = logging.getLogger("kvcm.backends.metastore")

CONNECT_TIMEOUT_S = 2.0  # a Redis that does not accept within this is unavailable
SOCKET_TIMEOUT_S = 5.0  # one command's reply; a commit's WAIT has its own timeout on top
PROBE_TIMEOUT_S = 0.5  # a readiness PING: a hung Redis makes the node unready, not the probe slow
PROBE_EVERY_S = 1.0  # at most one readiness PING per this, however hot the probe
_PAGE = 512  # keys per scan round trip
_ABSENT = object()  # undo-log marker: the key had no overlay entry

# KEYS: epoch, commit marker, versions, deployment, then (hash, zset) per database touched.
# ARGV: fencing token ("" = none), commit id, deployment id ("" = unchecked), then per database:
# #puts, #deletes, k, v, ..., k, ...
# Each database touched counts one more version (field: its hash key), so a follower knows what
# it must reload or forget with one HMGET. The deployment key is checked like the fencing token:
# a Redis that lost it (restarted without persistence, flushed) lost this kvcm's metadata, and a
# write there would build a second, partial store under the same prefix.
_COMMIT = """
local token = ARGV[1]
if token ~= '' then
  local epoch = tonumber(redis.call('GET', KEYS[1]) or '0')
  if epoch == nil or epoch > tonumber(token) then
    return redis.error_reply('KVCMFENCED ' .. tostring(redis.call('GET', KEYS[1])))
  end
end
if ARGV[3] ~= '' then
  local stored = redis.call('GET', KEYS[4])
  if stored ~= ARGV[3] then
    return redis.error_reply('KVCMLOST ' .. (stored or ''))
  end
end
for i = 5, #KEYS, 2 do
  local h = redis.call('TYPE', KEYS[i])['ok']
  local z = redis.call('TYPE', KEYS[i + 1])['ok']
  if (h ~= 'none' and h ~= 'hash') or (z ~= 'none' and z ~= 'zset') then
    return redis.error_reply('KVCMTYPE ' .. KEYS[i] .. ' is ' .. h .. ', ' .. KEYS[i + 1] .. ' is ' .. z)
  end
end
local a = 4
for i = 5, #KEYS, 2 do
  local h, z = KEYS[i], KEYS[i + 1]
  redis.call('HINCRBY', KEYS[3], h, 1)
  local nput, ndel = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  a = a + 2
  for j = a, a + 2 * nput - 1, 2 do
    redis.call('HSET', h, ARGV[j], ARGV[j + 1])
    redis.call('ZADD', z, 0, ARGV[j])
  end
  a = a + 2 * nput
  for j = a, a + ndel - 1 do
    redis.call('HDEL', h, ARGV[j])
    redis.call('ZREM', z, ARGV[j])
  end
  a = a + ndel
end
redis.call('SET', KEYS[2], ARGV[2])
return 1
"""

# KEYS: zset, hash. ARGV: min, max, count. One round trip for a page of keys and their values.
_SCAN = """
local keys = redis.call('ZRANGEBYLEX', KEYS[1], ARGV[1], ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))
if #keys == 0 then return {{}, {}} end
return {keys, redis.call('HMGET', KEYS[2], unpack(keys))}
"""

# KEYS: zset, hash. ARGV: ranks. The members at those ranks (all scores are 0: rank = byte order).
_AT_RANKS = """
local keys = {}
for i = 1, #ARGV do
  local got = redis.call('ZRANGE', KEYS[1], ARGV[i], ARGV[i])
  if got[1] then keys[#keys + 1] = got[1] end
end
if #keys == 0 then return {{}, {}} end
return {keys, redis.call('HMGET', KEYS[2], unpack(keys))}
"""

# KEYS: deployment, writer mark. ARGV: deployment id, this process's writer mark ("" = not the
# writer), the mark's TTL in ms. {stored deployment, the mark now held}. The mark is refreshed only
# while the store is still this deployment's: a lost store gets no new key from a watcher.
_WATCH = """
local stored = redis.call('GET', KEYS[1]) or ''
if ARGV[2] == '' or stored ~= ARGV[1] then return {stored, ''} end
local held = redis.call('GET', KEYS[2])
if not held or held == ARGV[2] then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  return {stored, ARGV[2]}
end
return {stored, held}
"""

# KEYS: writer mark. ARGV: this process's mark. Compare-and-delete (a clean stop).
_DROP_MARK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

#: The file in the data dir naming the store it belongs to (:class:`StoreRecord`).
RECORD_FILE = "redis-store.json"
#: How long a writer's mark outlives its last refresh (a kvcm killed without a clean stop).
WRITER_TTL_MS = 10_000
#: How often a writer checks that the store is still its deployment's and refreshes its mark.
WATCH_EVERY_S = 1.0


class Fenced(Unavailable):
    """A commit refused: a newer leader's epoch is stored (this process is no longer the writer)."""

    default_code = Code.SERVER_NOT_LEADER


class InDoubt(Unavailable):
    """Redis went away during a commit and could not say afterwards whether it applied it. The
    commit's memory side (its callbacks, or its aborts, which give back storage slots) waits
    until Redis can tell: the store refuses everything meanwhile (:meth:`RedisStore.settle`)."""


class NotReplicated(Unavailable):
    """A commit applied on the primary that fewer than ``store.redis_wait_replicas`` replicas
    acknowledged in time: it is not lost now, but may be if the primary fails before they copy it."""

    default_code = Code.TIMEOUT


class StoreLost(Unavailable):
    """The Redis store is not this deployment's any more: Redis lost its data (a restart without
    persistence, a flush) or another kvcm took it over. Everything is refused until a restart,
    which then refuses to start and names the remedy."""


def translate(exc: redis.RedisError) -> Exception:
    """kvcm's typed error for a redis-py exception."""
    if isinstance(exc, redis.AuthenticationError):
        return Unavailable(f"metadata store (Redis) refused the password: {exc}", Code.SERVICE_NOT_READY)
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return Unavailable(f"metadata store (Redis) unavailable: {exc}", Code.SERVICE_NOT_READY)
    if isinstance(exc, redis.ReadOnlyError):
        return Unavailable(f"metadata store (Redis) is a read-only replica: {exc}", Code.SERVER_NOT_LEADER)
    if str(exc).startswith("KVCMFENCED"):
        return Fenced(f"commit refused: a newer writer holds the metadata store (stored epoch "
                      f"{str(exc).split(' ', 1)[1]})")
    return ServerError(f"metadata store (Redis) error: {exc}", Code.IO_ERROR)


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one redis-py call; its errors come out as kvcm's."""
    try:
        return fn(*args, **kwargs)
    except redis.RedisError as exc:
        raise translate(exc) from None


def redact(url: str) -> str:
    """``url`` without its password, for logs and messages."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user + ':' if user else ':'}***@{host}"


def aof_state(client: Any) -> tuple[bool | None, str]:
    """Whether Redis keeps an append-only file, and how that was learnt: ``CONFIG GET
    appendonly``, else (a managed Redis may forbid CONFIG) ``INFO persistence``'s ``aof_enabled``;
    ``(None, why neither answered)`` when both are refused. Connection errors propagate."""
    reasons: list[str] = []
    try:
        got = client.config_get("appendonly")
        value = _text(got.get("appendonly", got.get(b"appendonly")))
        if value:
            return value == "yes", "CONFIG GET appendonly"
        reasons.append("CONFIG GET appendonly: no such setting")
    except redis.ResponseError as exc:
        reasons.append(f"CONFIG GET appendonly: {exc}")
    try:
        info = client.info("persistence")
        if "aof_enabled" in info:
            return bool(int(info["aof_enabled"])), "INFO persistence"
        reasons.append("INFO persistence: no aof_enabled field")
    except redis.ResponseError as exc:
        reasons.append(f"INFO persistence: {exc}")
    return None, "; ".join(reasons)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value or "")


def persistence_problem(client: Any) -> str | None:
    """Why a restart of this Redis may lose kvcm's metadata (its AOF is off, or cannot be read);
    None when the AOF is on."""
    enabled, how = aof_state(client)
    if enabled:
        return None
    if enabled is None:
        return (f"cannot tell whether Redis keeps an append-only file (neither answered: {how}); "
                "without one a Redis restart loses the metadata and the lease's epoch")
    return (f"Redis runs without an append-only file (appendonly no, by {how}): a restart of Redis "
            "loses the metadata and the lease's epoch; run it with appendonly yes and appendfsync always")


def check_persistence(client: Any, where: str, refuse: bool) -> None:
    """At a start: a Redis without an AOF (or one that will not say) refuses it when ``refuse``
    (the lease, ``ha.require_aof``), else is logged as a warning.
    :raises StartRefused: ``refuse`` and the AOF is off or unknown.
    :raises Unavailable: Redis cannot be reached."""
    try:
        problem = persistence_problem(client)
    except redis.RedisError as exc:
        raise translate(exc) from None
    if problem is None:
        return
    if refuse:
        raise StartRefused(f"{where}: {problem}. The leader lease (ha.enabled) needs the epoch to survive a Redis "
                           "restart; turn the AOF on, or set ha.require_aof = false to start anyway")
    log.warning("%s: %s (a store that lost its data is noticed and refused, not served; docs/redis.md"
                "#persistence-check)", where, problem)


@dataclass(frozen=True)
class StoreRecord:
    """What a data dir remembers of the Redis store it served (:data:`RECORD_FILE`): the prefix
    and that store's deployment id, written when the store was created or first joined. A Redis
    that no longer holds the id lost this deployment's metadata; one holding another id is
    another deployment's."""

    prefix: str
    deployment: str

    @staticmethod
    def path(data_dir: str) -> str:
        return os.path.join(data_dir, RECORD_FILE)

    @classmethod
    def read(cls, data_dir: str | None) -> StoreRecord | None:
        """The data dir's record; None when it has none (a data dir that never served a Redis
        store). A record kvcm cannot parse refuses the start: guessing could hide a lost store."""
        if data_dir is None:
            return None
        path = cls.path(data_dir)
        try:
            with open(path, encoding="utf-8") as fh:
                obj = json.load(fh)
            return cls(str(obj["prefix"]), str(obj["deployment"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise StartRefused(f"the data dir's {path} cannot be read ({exc}); restore it, or remove it if this "
                               "data dir should join the store as new") from None

    def write(self, data_dir: str, where: str) -> None:
        """Replace the record atomically (a crash leaves the old one or the new one)."""
        path = self.path(data_dir)
        tmp = f"{path}.{os.getpid()}.tmp"
        os.makedirs(data_dir, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"prefix": self.prefix, "deployment": self.deployment, "redis": where}, fh)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)


def identity_refusal(stored: str | None, record: StoreRecord | None, prefix: str, where: str,
                     data_dir: str) -> StartRefused | None:
    """Why this data dir must not serve the store ``where`` whose deployment key holds ``stored``
    (None: no key): its store lost its data, or the prefix holds another deployment's."""
    if record is None:
        return None  # a data dir new to Redis stores joins (an HA node) or creates one
    remove = f"remove {StoreRecord.path(data_dir)}"
    if stored is None and record.prefix == prefix:
        return StartRefused(
            f"the metadata store {where} lost this deployment's data (its key {{{prefix}}}:deployment is gone: "
            f"Redis restarted without persistence or was flushed, or the URL names another Redis), while this "
            f"data dir served deployment {record.deployment} there; restore Redis's data and start again, or, "
            f"to start over on an empty store, {remove}")
    if stored is not None and stored != record.deployment:
        return StartRefused(
            f"store.redis_prefix {prefix} on {where} holds deployment {stored}, but this data dir belongs to "
            f"deployment {record.deployment} (on prefix {record.prefix}): two deployments must not share a "
            f"prefix; give this one its own store.redis_prefix (or, if this data dir should join deployment "
            f"{stored}, {remove})")
    return None


@dataclass(frozen=True)
class WriterMark:
    """Who writes a prefix without the lease (``ha.enabled`` off): ``{P}:writer``, refreshed
    while it serves. A second kvcm on the prefix finds it and refuses to start; a restart on the
    same host and data dir takes it over (holding the data dir's lock, its predecessor is gone)."""

    host: str
    data_dir: str
    pid: int
    run: str

    def encode(self) -> bytes:
        return json.dumps({"host": self.host, "data_dir": self.data_dir, "pid": self.pid, "run": self.run},
                          sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: Any) -> WriterMark | None:
        try:
            obj = json.loads(raw)
            return cls(str(obj["host"]), str(obj["data_dir"]), int(obj["pid"]), str(obj["run"]))
        except (ValueError, TypeError, KeyError):
            return None

    def same_place(self, other: WriterMark | None) -> bool:
        return other is not None and (other.host, other.data_dir) == (self.host, self.data_dir)

    def describe(self) -> str:
        return f"host {self.host}, data dir {self.data_dir}, pid {self.pid}"


def _upper(prefix: bytes) -> bytes | None:
    """The first key past every key with ``prefix`` (None: no such key, the range is open)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


class _Gate:
    """Shared for read transactions, exclusive for a commit; re-entrant per thread for reads."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._exclusive = False
        self.local = threading.local()

    def enter(self) -> None:
        held = getattr(self.local, "held", 0)
        if held == 0:
            with self._cond:
                while self._exclusive:
                    self._cond.wait()
                self._active += 1
        self.local.held = held + 1

    def leave(self) -> None:
        self.local.held -= 1
        if self.local.held == 0:
            with self._cond:
                self._active -= 1
                if self._active == 0:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        if getattr(self.local, "held", 0):
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


class RedisReadTxn:
    """Reads of committed data (through the overlay of a write transaction, when it has one)."""

    def __init__(self, store: RedisStore, overlay: dict[str, dict[bytes, bytes | None]] | None = None) -> None:
        self._store = store
        self._overlay = overlay if overlay is not None else {}

    def get(self, db: str, key: bytes) -> bytes | None:
        layer = self._overlay.get(db)
        if layer is not None and key in layer:
            return layer[key]
        if not key_fits(key):
            return None
        value: bytes | None = _call(self._store.client.hget, self._store.hash_key(db), key)
        return value

    def get_many(self, db: str, keys: Iterable[bytes]) -> list[bytes | None]:
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        layer = self._overlay.get(db, {})
        wanted = [k for k in keys if k not in layer and key_fits(k)]
        found: dict[bytes, bytes | None] = {}
        if wanted:
            values = _call(self._store.client.hmget, self._store.hash_key(db), wanted)
            found = dict(zip(wanted, values))
        return [layer[k] if k in layer else found.get(k) for k in keys]

    def scan(
        self, db: str, start: bytes = b"", prefix: bytes = b"", limit: int | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        lo = max(start, prefix)
        layer = self._overlay.get(db, {})
        own = sorted(k for k in layer if k >= lo and k.startswith(prefix))
        merged = _merge(self._base_scan(db, lo, prefix), own, layer)
        for n, item in enumerate(merged):
            if limit is not None and n >= limit:
                return
            yield item

    def _base_scan(self, db: str, lo: bytes, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        store = self._store
        upper = _upper(prefix) if prefix else None
        low = b"[" + lo if lo else b"-"
        high = b"(" + upper if upper is not None else b"+"
        keys = [store.zset_key(db), store.hash_key(db)]
        while True:
            found, values = _call(store.scan_script, keys=keys, args=[low, high, _PAGE])
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
        total = int(_call(store.client.hlen, store.hash_key(db)))
        layer = self._overlay.get(db)
        if not layer:
            return total
        keys = list(layer)
        stored = _call(store.client.hmget, store.hash_key(db), keys)
        for key, before in zip(keys, stored):
            total += (layer[key] is not None) - (before is not None)
        return total


def _merge(base: Iterator[tuple[bytes, bytes]], own: list[bytes],
           layer: dict[bytes, bytes | None]) -> Iterator[tuple[bytes, bytes]]:
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
    when the savepoint began (``_ABSENT``: none), written back on rollback."""

    def __init__(self, store: RedisStore, overlay: dict[str, dict[bytes, bytes | None]]) -> None:
        super().__init__(store, overlay)
        self.undo: dict[tuple[str, bytes], object] = {}
        self.callbacks: list[Callable[[], None]] = []
        self.aborts: list[Callable[[], None]] = []

    def _layer(self, db: str) -> dict[bytes, bytes | None]:
        if db not in DATABASES:
            raise KeyError(db)
        layer = self._overlay.get(db)
        if layer is None:
            layer = self._overlay[db] = {}
        return layer

    def _set(self, db: str, layer: dict[bytes, bytes | None], key: bytes, value: bytes | None) -> None:
        slot = (db, key)
        if slot not in self.undo:
            self.undo[slot] = layer.get(key, _ABSENT)
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
            if old is _ABSENT:
                layer.pop(key, None)
            else:
                layer[key] = old  # type: ignore[assignment]  # a value or None (deleted)


class _Group:
    """Per-thread group-commit state: the overlay (None until the first write block) and the
    callbacks of the savepoints that committed into it."""

    __slots__ = ("aborts", "callbacks", "commit_id", "overlay")

    def __init__(self) -> None:
        self.overlay: dict[str, dict[bytes, bytes | None]] | None = None
        self.callbacks: list[Callable[[], None]] = []
        self.commit_id = b""
        self.aborts: list[Callable[[], None]] = []


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
        self._store._gate.enter()
        return RedisReadTxn(self._store)

    def __exit__(self, *exc: object) -> None:
        self._store._gate.leave()


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
        self._lock_path: str | None = None
        if path is not None:
            os.makedirs(path, exist_ok=True)
            self._lock_path = self._lock_dir(path)
        try:
            self.client: Any = redis.Redis.from_url(
                url, password=password, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S,
                retry=Retry(NoBackoff(), 1),  # once, at once: a pooled connection from before a Redis restart
            )
            _call(self.client.ping)
        except BaseException:
            self._release_lock()
            raise
        tag = "{" + prefix + "}"
        self._hash = {name: f"{tag}:h:{name}".encode() for name in DATABASES}
        self._zset = {name: f"{tag}:z:{name}".encode() for name in DATABASES}
        self.epoch_key = f"{tag}:epoch".encode()
        self.commit_key = f"{tag}:commit".encode()
        self.versions_key = f"{tag}:versions".encode()
        self.deployment_key = f"{tag}:deployment".encode()
        self.writer_key = f"{tag}:writer".encode()
        self.leader_key = f"{tag}:leader".encode()  # the lease's (kvcm.ha.lease), read here only
        self.where = f"Redis {redact(url)} (prefix {prefix})"
        #: This deployment's id, checked by every commit ("" = unchecked: a store opened by a tool
        #: or a test, never claimed). Set by :meth:`claim`.
        self.deployment = ""
        #: Why the store is not this deployment's any more ("" = it is): then every read, commit
        #: and readiness probe is refused (:class:`StoreLost`).
        self.lost = ""
        self._mark = b""  # this process's writer mark while it holds one (check_start)
        self._adopt_into: str | None = None  # the data dir that records the deployment once one exists
        self.commit_script = self.client.register_script(_COMMIT)
        self.scan_script = self.client.register_script(_SCAN)
        self._ranks_script = self.client.register_script(_AT_RANKS)
        self._writer = threading.RLock()
        self._gate = _Gate()
        self._local = threading.local()
        self._ids = itertools.count()
        self._run = uuid.uuid4().hex[:12]
        self._closed = False
        self.in_doubt: list[_Group] = []  # commits whose outcome Redis could not tell (settle)
        self._doubt_lock = threading.RLock()
        # Its own connection with short timeouts: a probe never waits behind a data-plane command.
        self._probe = redis.Redis.from_url(url, password=password, socket_timeout=PROBE_TIMEOUT_S,
                                           socket_connect_timeout=PROBE_TIMEOUT_S, retry=Retry(NoBackoff(), 0))
        self._probe_lock = threading.Lock()
        self._probed = (-PROBE_EVERY_S, True)  # (monotonic time, answered)
        self._watch_script = self._probe.register_script(_WATCH)
        self._drop_mark_script = self._probe.register_script(_DROP_MARK)

    def _lock_dir(self, path: str) -> str:
        lock = os.path.join(path, "kvcm.lock")
        try:
            hold_lock_file(lock, f"the store object {id(self):x}", f"data dir {path!r}")
        except LockBusy:
            from kvcm.backends.metastore.lmdb import DataDirLocked

            raise DataDirLocked(f"data dir {path!r} is in use by another kvcm process (lock file kvcm.lock); "
                                "stop it or choose another --data-dir") from None
        return lock

    def _release_lock(self) -> None:
        if self._lock_path is not None:
            drop_lock_file(self._lock_path)
            self._lock_path = None

    def hash_key(self, db: str) -> bytes:
        return self._hash[db]

    def zset_key(self, db: str) -> bytes:
        return self._zset[db]

    def describe(self) -> str:
        """One line for the start-up block (no password)."""
        wait = f", WAIT {self.wait_replicas} replica(s)" if self.wait_replicas else ""
        return f"redis {redact(self.url)}, prefix {self.prefix}{wait}"

    def is_empty(self) -> bool:
        """No database of this prefix holds a key (a new or wrong prefix / Redis db)."""
        pipe = self.client.pipeline(transaction=False)
        for name in DATABASES:
            pipe.exists(self._hash[name])
        return not any(_call(pipe.execute))

    # -- transactions -------------------------------------------------------------------------

    def read(self) -> _Reading:
        return _Reading(self)

    @contextmanager
    def group(self) -> Iterator[None]:
        self.refuse_if_lost()
        if self.in_doubt:
            self.settle()
        if getattr(self._local, "group", None) is not None:
            yield  # already inside a group on this thread: join it
            return
        group = _Group()
        self._local.group = group
        try:
            yield
        except BaseException:
            self._local.group = None
            self._end(group)
            run_aborts(group.aborts)
            raise
        self._local.group = None
        shortfall: NotReplicated | None = None
        try:
            shortfall = self._commit(group)
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
        for fn in group.callbacks:
            fn()
        if shortfall is not None:
            raise shortfall  # applied (memory follows the store), but not on enough replicas

    def _end(self, group: _Group) -> None:
        if group.overlay is not None:
            group.overlay = None
            self._writer.release()

    @contextmanager
    def write(self, join: bool = False) -> Iterator[RedisWriteTxn]:
        group: _Group | None = getattr(self._local, "group", None)
        stack: list[RedisWriteTxn] = self._stack()
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

    def _stack(self) -> list[Any]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _commit(self, group: _Group) -> NotReplicated | None:
        """Apply the overlay in one script call; returns the replica shortfall, if any."""
        keys, args = self._script_input(group.overlay or {})
        if not keys:
            return None
        if self.read_only:
            raise Unavailable(self.read_only, Code.SERVER_NOT_LEADER)
        if self.in_doubt:  # another thread's commit: settled first, its marker is about to be overwritten
            self.settle()
        commit_id = group.commit_id = f"{self._run}-{next(self._ids)}".encode()
        token = b"" if self.fencing_token is None else str(self.fencing_token).encode()
        with self._gate.exclusive():
            try:
                self.commit_script(keys=[self.epoch_key, self.commit_key, self.versions_key, self.deployment_key,
                                         *keys],
                                   args=[token, commit_id, self.deployment.encode(), *args])
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self._resolve_in_doubt(commit_id, exc)
            except redis.RedisError as exc:
                if str(exc).startswith("KVCMLOST"):
                    raise self._lose(str(exc).split(" ", 1)[1] if " " in str(exc) else "") from None
                raise translate(exc) from None
        return self._wait_replicas()

    @staticmethod
    def _flatten(layer: dict[bytes, bytes | None]) -> tuple[list[bytes], list[bytes]]:
        puts: list[bytes] = []
        dels: list[bytes] = []
        for key, value in layer.items():
            if value is None:
                dels.append(key)
            else:
                puts += (key, value)
        return puts, dels

    def _script_input(self, overlay: dict[str, dict[bytes, bytes | None]]) -> tuple[list[bytes], list[Any]]:
        keys: list[bytes] = []
        args: list[Any] = []
        for db, layer in overlay.items():
            if not layer:
                continue
            puts, dels = self._flatten(layer)
            keys += (self._hash[db], self._zset[db])
            args += (len(puts) // 2, len(dels), *puts, *dels)
        return keys, args

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

    # -- identity: the deployment, lost data, the single writer ---------------------------------

    def stored_deployment(self) -> str | None:
        """The deployment id the store holds (None: no key, a new or lost store)."""
        raw = _call(self.client.get, self.deployment_key)
        return None if raw is None else _text(raw)

    def check_start(self, data_dir: str, writer: bool) -> None:
        """Before a start serves this store from ``data_dir``: refuse (:class:`StartRefused`)
        a store that lost the data dir's deployment or holds another's, and, for a ``writer``
        without the lease, a prefix another kvcm writes or an HA deployment leads; then hold
        the writer mark until :meth:`close`. Changes nothing in Redis on a refusal."""
        refusal = identity_refusal(self.stored_deployment(), StoreRecord.read(data_dir), self.prefix, self.where,
                                   data_dir)
        if refusal is not None:
            raise refusal
        if writer:
            self._hold_writer(data_dir)

    def _hold_writer(self, data_dir: str) -> None:
        leader = _call(self.client.get, self.leader_key)
        if leader is not None:
            raise StartRefused(
                f"store.redis_prefix {self.prefix} on {self.where} is led by a node under the leader lease "
                f"({_text(leader)}): a kvcm without ha.enabled would write beside it; start this one with "
                "ha.enabled and its own ha.node_id, or give it its own store.redis_prefix")
        mine = WriterMark(socket.gethostname(), data_dir, os.getpid(), self._run)
        for _ in range(3):  # a mark that expires between the SET and the GET: try again
            if _call(self.client.set, self.writer_key, mine.encode(), px=WRITER_TTL_MS, nx=True):
                break
            raw = _call(self.client.get, self.writer_key)
            if raw is None:
                continue
            held = WriterMark.decode(raw)
            if not mine.same_place(held):
                who = held.describe() if held is not None else _text(raw)
                raise StartRefused(
                    f"store.redis_prefix {self.prefix} on {self.where} is written by another kvcm ({who}): two "
                    f"deployments must not share a prefix; give this one its own store.redis_prefix (several nodes "
                    f"of one deployment share it under ha.enabled). If that kvcm is gone, its mark expires "
                    f"within {WRITER_TTL_MS // 1000} s")
            # The same host and data dir: its last process, gone (this one holds the data dir's lock).
            _call(self.client.set, self.writer_key, mine.encode(), px=WRITER_TTL_MS)
            break
        self._mark = mine.encode()

    def claim(self, data_dir: str, create: bool = True) -> None:
        """Make this store the data dir's: the deployment id it holds (created now on a store
        without one, when ``create``: a new store, or one from before deployment ids) is
        recorded in ``data_dir`` and checked by every commit from now on. Without ``create`` (a
        follower) a store without an id is adopted once its leader created one (:meth:`versions`).
        :raises StartRefused: the store lost the data dir's deployment, or holds another's."""
        stored = self.stored_deployment()
        refusal = identity_refusal(stored, StoreRecord.read(data_dir), self.prefix, self.where, data_dir)
        if refusal is not None:
            raise refusal
        if stored is None and create:
            new = uuid.uuid4().hex
            if not _call(self.client.set, self.deployment_key, new, nx=True):
                return self.claim(data_dir, create)  # another node created it first: check that one
            log.info("%s: a new store, deployment %s", self.where, new)
            stored = new
        if stored is None:
            self._adopt_into = data_dir
            return None
        self._adopt(stored, data_dir)
        return None

    def _adopt(self, deployment: str, data_dir: str) -> None:
        record = StoreRecord(self.prefix, deployment)
        if StoreRecord.read(data_dir) != record:
            try:
                record.write(data_dir, redact(self.url))
            except OSError as exc:
                raise StartRefused(f"cannot write {StoreRecord.path(data_dir)} ({exc.strerror or exc}): the data "
                                   "dir must record the store it serves") from None
        self.deployment = deployment
        self._adopt_into = None

    def watch(self) -> None:
        """A writer's check, every :data:`WATCH_EVERY_S` (a thread of the app): the store still
        holds this deployment (else it is lost: every request is refused from now on, before a
        read is answered from memory or a write lands in an empty store) and the writer mark is
        still this process's (refreshed). Redis away changes nothing here: the probe says so."""
        if not self.deployment or self.lost or self._closed:
            return
        try:
            stored, held = self._watch_script(keys=[self.deployment_key, self.writer_key],
                                              args=[self.deployment, self._mark, WRITER_TTL_MS],
                                              client=self._probe)
        except redis.RedisError:
            return
        if _text(stored) != self.deployment:
            self._lose(_text(stored))
        elif self._mark and _text(held) != self._mark.decode():
            other = WriterMark.decode(held)
            self._lose_to(other.describe() if other is not None else _text(held))

    def _lose(self, stored: str) -> StoreLost:
        """Mark the store lost (its deployment key is gone or names another); returns the error."""
        why = "is gone (Redis restarted without persistence, or was flushed)" if not stored else \
            f"names deployment {stored}"
        return self._set_lost(f"the metadata store {self.where} lost this deployment's data: its key "
                              f"{self.deployment_key.decode()} {why}, not deployment {self.deployment}")

    def _lose_to(self, other: str) -> None:
        self._set_lost(f"another kvcm ({other}) writes the metadata store {self.where} now")

    def _set_lost(self, why: str) -> StoreLost:
        with self._probe_lock:
            first = not self.lost
            if first:
                self.lost = (f"{why}; every request is refused until kvcm is restarted, and a restart names "
                             "the remedy")
        if first:
            log.error("%s", self.lost)
        return StoreLost(self.lost)

    def refuse_if_lost(self) -> None:
        """:raises StoreLost: the store is not this deployment's any more."""
        if self.lost:
            raise StoreLost(self.lost)

    def lost_error(self) -> StoreLost | None:
        """What every request is answered while the store is lost; None while it is not."""
        return StoreLost(self.lost) if self.lost else None

    # -- misc ------------------------------------------------------------------------------------

    def reachable(self) -> bool:
        """Redis answered a PING within ``PROBE_TIMEOUT_S`` (the answer is reused for
        ``PROBE_EVERY_S``): what the readiness probe reports about the store."""
        if self.lost:
            return False
        with self._probe_lock:
            at, answered = self._probed
            if time.monotonic() - at < PROBE_EVERY_S:
                return answered
            try:
                answered = bool(self._probe.ping())
            except redis.RedisError:
                answered = False
            self._probed = (time.monotonic(), answered)
            return answered

    def versions(self, dbs: Sequence[str]) -> tuple[int, ...]:
        """How many commits touched each of ``dbs`` so far (0 = never): a reader that cached
        something of a database knows it is stale when its number moved."""
        self.refuse_if_lost()
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(self.versions_key, [self._hash[db] for db in dbs])
        pipe.get(self.deployment_key)
        got, stored = _call(pipe.execute)
        self._check_deployment(None if stored is None else _text(stored))
        return tuple(int(v) if v is not None else 0 for v in got)

    def _check_deployment(self, stored: str | None) -> None:
        """A reader's check of the deployment key it just read (each :meth:`versions`)."""
        if self.deployment:
            if stored != self.deployment:
                raise self._lose(stored or "")
        elif stored is not None and self._adopt_into is not None:
            try:
                self._adopt(stored, self._adopt_into)  # the leader created the store since
            except StartRefused as exc:  # checked in memory all the same; the next stage writes it
                log.warning("%s", exc.message)
                self.deployment, self._adopt_into = stored, None

    def sample(self, db: str, n: int, prefix: bytes = b"") -> list[tuple[bytes, bytes]]:
        """Up to ``n`` items picked uniformly at random (by rank: every score is 0)."""
        if n <= 0:
            return []
        zset = self._zset[db]
        with self.read():
            pipe = self.client.pipeline(transaction=False)
            if prefix:
                pipe.zlexcount(zset, "-", b"(" + prefix)
                upper = _upper(prefix)
                pipe.zlexcount(zset, b"[" + prefix, b"(" + upper if upper is not None else "+")
            else:
                pipe.zcard(zset)
            counts = [int(c) for c in _call(pipe.execute)]
            first, size = (counts[0], counts[1]) if prefix else (0, counts[0])
            if size == 0:
                return []
            ranks = [first + r for r in random.sample(range(size), min(n, size))]
            found, values = _call(self._ranks_script, keys=[zset, self._hash[db]], args=ranks)
        return [(k, v) for k, v in zip(found, values) if v is not None and k.startswith(prefix)]

    def stats(self) -> dict[str, int]:
        pipe = self.client.pipeline(transaction=False)
        for name in DATABASES:
            pipe.hlen(self._hash[name])
        counts = _call(pipe.execute)
        facts = {f"entries.{name}": int(c) for name, c in zip(DATABASES, counts)}
        memory = _call(self.client.info, "memory")
        facts["used_bytes"] = int(memory.get("used_memory", 0))
        return facts

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._drop_mark()
        with self._writer, self._gate.exclusive():
            self.client.close()
        self._probe.close()
        self._release_lock()

    def _drop_mark(self) -> None:
        """A clean stop gives the writer mark up, so the next writer need not wait for it to expire."""
        mark, self._mark = self._mark, b""
        if not mark:
            return
        try:
            self._drop_mark_script(keys=[self.writer_key], args=[mark], client=self._probe)
        except redis.RedisError as exc:
            log.warning("%s: the writer mark was not given up (%s); it expires in %d s", self.where, exc,
                        WRITER_TTL_MS // 1000)
