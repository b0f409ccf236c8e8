"""Optional capabilities are Protocols checked with ``isinstance``: which parts have which."""

from __future__ import annotations

from types import SimpleNamespace

from kvcm.backends.metastore.base import GrowableStore, SharedStore, WriteTxn
from kvcm.backends.metastore.lmdb import LmdbStore
from kvcm.backends.metastore.lmdb_txn import LmdbWriteTxn
from kvcm.backends.metastore.memory import MemoryStore, _WriteView
from kvcm.backends.metastore.redis import RedisStore, RedisWriteTxn
from kvcm.backends.storage.base import SlotStorage
from kvcm.backends.storage.external import MooncakeStorage, TairMemPoolStorage, ThreeFsStorage
from kvcm.backends.storage.file import FileStorage
from kvcm.backends.storage.shm import ShmStorage
from kvcm.blocks import CheckingHandler, ClosingHandler, FileHandler, ShmHandler
from kvcm.cache.manager import CacheManager
from kvcm.reclaimer.core import ExactUsage, PinnedCache


def test_storages_that_own_their_slots_and_those_that_do_not():
    for kind in (FileStorage, ShmStorage):
        assert issubclass(kind, SlotStorage), kind
    for kind in (ThreeFsStorage, MooncakeStorage, TairMemPoolStorage):
        assert not issubclass(kind, SlotStorage), kind


def test_stores_that_grow_and_stores_that_are_shared():
    assert issubclass(LmdbStore, GrowableStore) and not issubclass(LmdbStore, SharedStore)
    assert issubclass(RedisStore, SharedStore) and not issubclass(RedisStore, GrowableStore)
    assert not issubclass(MemoryStore, GrowableStore) and not issubclass(MemoryStore, SharedStore)


def test_every_write_transaction_takes_the_remember_hint():
    for kind in (LmdbWriteTxn, _WriteView, RedisWriteTxn):
        assert callable(getattr(kind, "remember", None)), kind
    assert "remember" in WriteTxn.__dict__


def test_block_handlers_that_close_and_check():
    assert issubclass(FileHandler, ClosingHandler) and issubclass(FileHandler, CheckingHandler)
    assert issubclass(ShmHandler, ClosingHandler) and issubclass(ShmHandler, CheckingHandler)

    class Plain:
        def write(self, block, spec, data): ...
        def read_into(self, block, spec, out): ...

    assert not isinstance(Plain(), ClosingHandler) and not isinstance(Plain(), CheckingHandler)


def test_the_cache_manager_has_pins_and_exact_usage():
    assert issubclass(CacheManager, ExactUsage)
    assert isinstance(SimpleNamespace(pins=object()), PinnedCache)  # CacheManager sets its pins in __init__
    assert not isinstance(SimpleNamespace(), PinnedCache) and not isinstance(SimpleNamespace(), ExactUsage)
