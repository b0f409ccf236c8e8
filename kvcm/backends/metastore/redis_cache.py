"""What the writer of a Redis store knows the store holds, so it need not read it back.

The leader is the only process that writes a deployment's keys (its commits carry the lease's
fencing token; without the lease it holds the writer mark), so every value it committed or read
stays true until it commits again. Reading those back cost a round trip each: a write pair read a
session it had just written, the block records it had just written and the usage row it keeps
adding to (seven round trips per start+finish pair where two commits are the only ones needed).

A key is filled on a read and on a commit (a deletion is kept as "absent"), and served to write
transactions (:class:`~kvcm.backends.metastore.redis_txn.RedisReadTxn` says why not to plain
reads) until it is evicted (least recently used, within :data:`DEFAULT_BYTES`). A read fills only if no commit
began or ran since it was sent: a value read while another thread's commit was in flight may be
older than the commit, and is not kept. A commit whose outcome is in doubt forgets everything.
Followers and tools never cache: another process writes what they read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping

#: The most bytes (keys and values, plus :data:`_ENTRY` each) the cache holds by default.
DEFAULT_BYTES = 64 << 20
#: What one entry costs besides its key and value bytes (the tuple key, the dict slot).
_ENTRY = 120


class Miss:
    """Not in the cache (a cached ``None`` means: known absent)."""


MISS = Miss()


class CommittedCache:
    """Values of (database, key) this writer knows are stored; thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES) -> None:
        self.max_bytes = max_bytes
        self._data: OrderedDict[tuple[str, bytes], bytes | None] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._generation = 0  # moves when a commit begins and when it ends
        self._committing = 0  # commits between begin_commit and their end

    def get(self, db: str, key: bytes) -> bytes | Miss | None:
        with self._lock:
            value = self._data.get((db, key), MISS)
            if value is not MISS:
                self._data.move_to_end((db, key))
            return value

    def before_read(self) -> int:
        """A token for :meth:`fill`, taken before the read is sent (-1: a commit is in flight,
        the read will not be kept)."""
        with self._lock:
            return -1 if self._committing else self._generation

    def fill(self, token: int, db: str, items: Iterable[tuple[bytes, bytes | None]]) -> None:
        """Keep what a read sent after :meth:`before_read` returned ``token`` found."""
        with self._lock:
            if token < 0 or token != self._generation or self._committing:
                return
            for key, value in items:
                self._set(db, key, value)

    def begin_commit(self) -> None:
        with self._lock:
            self._committing += 1
            self._generation += 1

    def end_commit(self, overlay: Mapping[str, Mapping[bytes, bytes | None]] | None) -> None:
        """A commit ended: applied (``overlay``: what it wrote, kept), or not applied (None)."""
        with self._lock:
            if overlay is not None:
                for db, layer in overlay.items():
                    for key, value in layer.items():
                        self._set(db, key, value)
            self._committing -= 1
            self._generation += 1

    def clear(self) -> None:
        """Forget everything (a commit in doubt: what Redis holds is not known)."""
        with self._lock:
            self._data.clear()
            self._bytes = 0
            self._generation += 1

    def __len__(self) -> int:
        return len(self._data)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def _set(self, db: str, key: bytes, value: bytes | None) -> None:
        slot = (db, key)
        old = self._data.pop(slot, MISS)
        if not isinstance(old, Miss):
            self._bytes -= _cost(key, old)
        cost = _cost(key, value)
        if cost > self.max_bytes:
            return
        self._data[slot] = value
        self._bytes += cost
        while self._bytes > self.max_bytes:
            (_, gone_key), gone = self._data.popitem(last=False)
            self._bytes -= _cost(gone_key, gone)


def _cost(key: bytes, value: bytes | None) -> int:
    return len(key) + (len(value) if value is not None else 0) + _ENTRY
