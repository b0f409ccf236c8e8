"""What the server keeps in memory per block stays bounded: the wire cache's byte budget bounds
its real memory (measured with tracemalloc), and finished write sessions do not stay in the
expiry heap until their deadline."""

from __future__ import annotations

import gc
import os
import tracemalloc

import pytest

from kvcm.backends.metastore import MemoryStore
from kvcm.cache.locations import BuiltCache
from kvcm.cache.sessions import Sessions
from tests.helpers import Clock


@pytest.mark.heavy
def test_wire_cache_budget_bounds_its_real_memory():
    # Sizes of real entries: a compact address of two specs (~19 B) -> its wire (~204 B), and
    # a shorter pair; the budget must hold whatever the dict's fill when the peak is read.
    for capacity in (1 << 20, 8 << 20):
        for key_len, value_len in ((19, 204), (12, 120)):
            cache = BuiltCache(capacity)
            gc.collect()
            tracemalloc.start()
            try:
                peak = 0
                for i in range(capacity // 100):
                    key, value = os.urandom(key_len), os.urandom(value_len)
                    cache.put(key, value, len(key) + len(value) + BuiltCache.ENTRY)
                    if i % 499 == 0:
                        peak = max(peak, tracemalloc.get_traced_memory()[0])
            finally:
                tracemalloc.stop()
            assert len(cache) > capacity // 1000  # it did hold entries (not a cache that refuses all)
            assert peak <= capacity, (capacity, key_len, value_len, peak / capacity)
            del cache


def _open(store: MemoryStore, sessions: Sessions, timeout: float) -> str:
    with store.write() as txn:
        return sessions.create(txn, "inst", "g", [1, 2], ["a", "b"], timeout).id


def _finish(store: MemoryStore, sessions: Sessions, sid: str) -> None:
    with store.write() as txn:
        session = sessions.get(txn, sid)
        assert session is not None
        sessions.consume(txn, session)


def test_finished_sessions_leave_the_expiry_heap_before_their_deadline():
    store, mono = MemoryStore(), Clock()
    sessions = Sessions(monotonic=mono)
    kept = [_open(store, sessions, timeout=30) for _ in range(5)]  # stay open: they must still expire
    for _ in range(5000):
        _finish(store, sessions, _open(store, sessions, timeout=600))
        assert sessions.heap_size() <= 2 * len(sessions) + 64 + 1
    assert len(sessions) == len(kept)
    mono.now += 29
    assert sessions.due() == []
    mono.now += 2
    assert sorted(sessions.due()) == sorted(kept)  # each once, none of the finished ones
    assert sessions.due() == []


def test_a_session_whose_expiry_is_under_way_is_not_due_twice_after_a_compaction():
    store, mono = MemoryStore(), Clock()
    sessions = Sessions(monotonic=mono)
    late = _open(store, sessions, timeout=1)
    others = [_open(store, sessions, timeout=600) for _ in range(200)]
    mono.now += 2
    assert sessions.due() == [late]  # popped: its expiry transaction would run now
    for sid in others:  # finishing these compacts the heap, which puts ``late`` back
        _finish(store, sessions, sid)
    sessions.requeue([late])  # the expiry failed: put back once more
    assert sessions.due() == [late]
