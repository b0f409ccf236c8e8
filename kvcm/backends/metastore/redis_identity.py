"""The Redis store's identity: which deployment it belongs to, and who writes it.

``{P}:deployment`` holds the id of the deployment that created the store, recorded in each data
dir that serves it (:class:`StoreRecord`). Every commit checks it, a writer watches it
(:meth:`Identity.watch`) and a follower reads it with the versions: a Redis that lost it (a
restart without persistence, a flush) lost the metadata, and the store turns lost
(:class:`~kvcm.backends.metastore.redis_errors.StoreLost`) instead of answering from memory or
writing into an empty store; a start on such a store, or on another deployment's, is refused
naming the remedy. Without the lease the writer holds ``{P}:writer`` (:class:`WriterMark`), so a
second deployment on the prefix is refused.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass

import redis

from kvcm.backends.metastore.redis_conn import redact
from kvcm.backends.metastore.redis_errors import StoreLost, call, text
from kvcm.backends.metastore.redis_layout import DROP_MARK, WATCH, Keys
from kvcm.errors import StartRefused

log = logging.getLogger("kvcm.backends.metastore")

#: The file in the data dir naming the store it belongs to (:class:`StoreRecord`).
RECORD_FILE = "redis-store.json"
#: How long a writer's mark outlives its last refresh (a kvcm killed without a clean stop).
WRITER_TTL_MS = 10_000
#: How often a writer checks that the store is still its deployment's and refreshes its mark.
WATCH_EVERY_S = 1.0


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
    def decode(cls, raw: object) -> WriterMark | None:
        if not isinstance(raw, (str, bytes)):
            return None
        try:
            obj = json.loads(raw)
            return cls(str(obj["host"]), str(obj["data_dir"]), int(obj["pid"]), str(obj["run"]))
        except (ValueError, TypeError, KeyError):
            return None

    def same_place(self, other: WriterMark | None) -> bool:
        return other is not None and (other.host, other.data_dir) == (self.host, self.data_dir)

    def describe(self) -> str:
        return f"host {self.host}, data dir {self.data_dir}, pid {self.pid}"


class Identity:
    """One store's hold on its identity: the deployment it checks (``deployment``, "" =
    unchecked: a store opened by a tool or a test, never claimed), why it is lost (``lost``, ""
    = it is not: then every read, commit and readiness probe is refused), and this process's
    writer mark. ``client`` is the data-plane connection, ``probe`` the short-timeout one the
    watcher uses; ``run`` names this process in its mark."""

    def __init__(self, client: redis.Redis, probe: redis.Redis, keys: Keys, prefix: str, url: str,
                 run: str) -> None:
        self._client = client
        self._keys = keys
        self._prefix = prefix
        self._url = url
        self._where = f"Redis {redact(url)} (prefix {prefix})"
        self._run = run
        self.deployment = ""
        self.lost = ""
        self._mark = b""  # this process's writer mark while it holds one (check_start)
        self._adopt_into: str | None = None  # the data dir that records the deployment once one exists
        self._lock = threading.Lock()
        self._watch_script = probe.register_script(WATCH)
        self._drop_mark_script = probe.register_script(DROP_MARK)
        self._probe = probe

    def stored(self) -> str | None:
        """The deployment id the store holds (None: no key, a new or lost store)."""
        raw = call(self._client.get, self._keys.deployment)
        return None if raw is None else text(raw)

    def check_start(self, data_dir: str, writer: bool) -> None:
        """Before a start serves this store from ``data_dir``: refuse (:class:`StartRefused`)
        a store that lost the data dir's deployment or holds another's, and, for a ``writer``
        without the lease, a prefix another kvcm writes or an HA deployment leads; then hold
        the writer mark until :meth:`drop_mark`. Changes nothing in Redis on a refusal."""
        refusal = identity_refusal(self.stored(), StoreRecord.read(data_dir), self._prefix, self._where, data_dir)
        if refusal is not None:
            raise refusal
        if writer:
            self._hold_writer(data_dir)

    def _hold_writer(self, data_dir: str) -> None:
        leader = call(self._client.get, self._keys.leader)
        if leader is not None:
            raise StartRefused(
                f"store.redis_prefix {self._prefix} on {self._where} is led by a node under the leader lease "
                f"({text(leader)}): a kvcm without ha.enabled would write beside it; start this one with "
                "ha.enabled and its own ha.node_id, or give it its own store.redis_prefix")
        mine = WriterMark(socket.gethostname(), data_dir, os.getpid(), self._run)
        for _ in range(3):  # a mark that expires between the SET and the GET: try again
            if call(self._client.set, self._keys.writer, mine.encode(), px=WRITER_TTL_MS, nx=True):
                break
            raw = call(self._client.get, self._keys.writer)
            if raw is None:
                continue
            held = WriterMark.decode(raw)
            if not mine.same_place(held):
                raise self._writer_refusal(held.describe() if held is not None else text(raw))
            # The same host and data dir: its last process, gone (this one holds the data dir's lock).
            call(self._client.set, self._keys.writer, mine.encode(), px=WRITER_TTL_MS)
            break
        self._mark = mine.encode()

    def _writer_refusal(self, who: str) -> StartRefused:
        return StartRefused(
            f"store.redis_prefix {self._prefix} on {self._where} is written by another kvcm ({who}): two "
            f"deployments must not share a prefix; give this one its own store.redis_prefix (several nodes "
            f"of one deployment share it under ha.enabled). If that kvcm is gone, its mark expires "
            f"within {WRITER_TTL_MS // 1000} s")

    def claim(self, data_dir: str, create: bool = True) -> None:
        """Make this store the data dir's: the deployment id it holds (created now on a store
        without one, when ``create``: a new store, or one from before deployment ids) is
        recorded in ``data_dir`` and checked by every commit from now on. Without ``create`` (a
        follower) a store without an id is adopted once its leader created one
        (:meth:`check_deployment`).
        :raises StartRefused: the store lost the data dir's deployment, or holds another's."""
        stored = self.stored()
        refusal = identity_refusal(stored, StoreRecord.read(data_dir), self._prefix, self._where, data_dir)
        if refusal is not None:
            raise refusal
        if stored is None and create:
            new = uuid.uuid4().hex
            if not call(self._client.set, self._keys.deployment, new, nx=True):
                return self.claim(data_dir, create)  # another node created it first: check that one
            log.info("%s: a new store, deployment %s", self._where, new)
            stored = new
        if stored is None:
            self._adopt_into = data_dir
            return None
        self._adopt(stored, data_dir)
        return None

    def _adopt(self, deployment: str, data_dir: str) -> None:
        record = StoreRecord(self._prefix, deployment)
        if StoreRecord.read(data_dir) != record:
            try:
                record.write(data_dir, redact(self._url))
            except OSError as exc:
                raise StartRefused(f"cannot write {StoreRecord.path(data_dir)} ({exc.strerror or exc}): the data "
                                   "dir must record the store it serves") from None
        self.deployment = deployment
        self._adopt_into = None

    def watch(self) -> None:
        """A writer's check: the store still holds this deployment (else it is lost: every
        request is refused from now on, before a read is answered from memory or a write lands
        in an empty store) and the writer mark is still this process's (refreshed). Redis away
        changes nothing here: the readiness probe says so."""
        if not self.deployment or self.lost:
            return
        try:
            stored, held = self._watch_script(keys=[self._keys.deployment, self._keys.writer],
                                              args=[self.deployment, self._mark, WRITER_TTL_MS],
                                              client=self._probe)
        except redis.RedisError:
            return
        if text(stored) != self.deployment:
            self.lose(text(stored))
        elif self._mark and text(held) != self._mark.decode():
            other = WriterMark.decode(held)
            self._set_lost(f"another kvcm ({other.describe() if other is not None else text(held)}) writes "
                           f"the metadata store {self._where} now")

    def lose(self, stored: str) -> StoreLost:
        """Mark the store lost (its deployment key is gone or names another); returns the error."""
        why = "is gone (Redis restarted without persistence, or was flushed)" if not stored else \
            f"names deployment {stored}"
        return self._set_lost(f"the metadata store {self._where} lost this deployment's data: its key "
                              f"{self._keys.deployment.decode()} {why}, not deployment {self.deployment}")

    def _set_lost(self, why: str) -> StoreLost:
        with self._lock:
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

    def check_deployment(self, stored: str | None) -> None:
        """A reader's check of the deployment key it just read (each ``versions``)."""
        if self.deployment:
            if stored != self.deployment:
                raise self.lose(stored or "")
        elif stored is not None and self._adopt_into is not None:
            try:
                self._adopt(stored, self._adopt_into)  # the leader created the store since
            except StartRefused as exc:  # checked in memory all the same; the next stage writes it
                log.warning("%s", exc.message)
                self.deployment, self._adopt_into = stored, None

    def drop_mark(self) -> None:
        """A clean stop gives the writer mark up, so the next writer need not wait for it to expire."""
        mark, self._mark = self._mark, b""
        if not mark:
            return
        try:
            self._drop_mark_script(keys=[self._keys.writer], args=[mark], client=self._probe)
        except redis.RedisError as exc:
            log.warning("%s: the writer mark was not given up (%s); it expires in %d s", self._where, exc,
                        WRITER_TTL_MS // 1000)
