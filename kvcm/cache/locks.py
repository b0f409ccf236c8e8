"""Sharded in-memory locks for block keys, and Tair's shard-aligned batch splitting.

``shard(key) = int32(key) & (n - 1)`` (Tair ``GetShardIndex``: the low 32 bits, two's
complement), with ``n`` a power of two. A batch locks all of its shards in ascending order, so
two batches can never wait on each other in a cycle.

Lock order across the process (see :mod:`kvcm.backends.metastore.base`): open the store's write
transaction first, then take shard locks. Never call out (storage IO, listeners, network) while
holding a shard.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


def check_shard_count(n: int) -> int:
    """``n`` if it is a positive power of two, else ValueError."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"shard count must be a positive power of two, got {n}")
    return n


def make_batches(keys: Sequence[int], shards: int, batch_size: int) -> list[list[int]]:
    """Request *indices* grouped into batches of whole shards (Tair ``MakeBatches``).

    Indices are grouped by shard; shards are visited in ascending order and each shard's
    indices appended (in request order) to the current batch, which is closed once it holds at
    least ``batch_size`` indices (``batch_size <= 0``: one batch per shard). A shard is never
    split across batches, so each batch can lock its shards independently.
    """
    mask = shards - 1
    by_shard: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        by_shard.setdefault(key & mask, []).append(i)
    batches: list[list[int]] = []
    current: list[int] = []
    for shard in sorted(by_shard):
        current.extend(by_shard[shard])
        if len(current) >= batch_size:
            batches.append(current)
            current = []
    if current:
        batches.append(current)
    return batches


class ShardedLocks:
    """``n`` mutexes; :meth:`hold` takes those of a set of keys in ascending shard order.

    Thread-safe; any thread may hold shards. Locks are not re-entrant: a thread must not call
    :meth:`hold` again while it holds shards (the index never nests batches).
    """

    def __init__(self, n: int = 64) -> None:
        self.n = check_shard_count(n)
        self._mask = n - 1
        self._locks = [threading.Lock() for _ in range(n)]

    def shard(self, key: int) -> int:
        return key & self._mask

    def shards_of(self, keys: Sequence[int]) -> list[int]:
        """Distinct shards of ``keys``, ascending: the acquisition order."""
        mask = self._mask
        return sorted({k & mask for k in keys})

    @contextmanager
    def hold(self, keys: Sequence[int]) -> Iterator[list[int]]:
        """Hold the shards of ``keys`` (ascending) for the block; yields the shard ids."""
        shards = self.shards_of(keys)
        taken: list[threading.Lock] = []
        try:
            for s in shards:
                lock = self._locks[s]
                lock.acquire()
                taken.append(lock)
            yield shards
        finally:
            for lock in reversed(taken):
                lock.release()

    def acquire(self, keys: Sequence[int]) -> list[threading.Lock]:
        """Take the shards of ``keys`` (ascending); returns them for :meth:`release`.
        The hot-path twin of :meth:`hold`, without a generator frame per batch."""
        mask, locks = self._mask, self._locks
        taken = [locks[s] for s in sorted({k & mask for k in keys})]
        for i, lock in enumerate(taken):
            try:
                lock.acquire()
            except BaseException:
                for held in reversed(taken[:i]):
                    held.release()
                raise
        return taken

    @staticmethod
    def release(taken: list[threading.Lock]) -> None:
        for lock in reversed(taken):
            lock.release()

    def held(self) -> list[int]:
        """Shards currently locked by any thread (diagnostics and ``check()``)."""
        return [i for i, lock in enumerate(self._locks) if lock.locked()]
