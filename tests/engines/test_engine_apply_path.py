"""The engine index's apply path internals: the collector paused while a drain is applied or
flushed (and always restored)."""

from __future__ import annotations

import gc
import random

import pytest

from kvcm.backends.metastore import LmdbStore
from kvcm.engines.index import EngineIndex
from kvcm.engines.sources import SourceSpec
from kvcm.proto.kv_events import BlockStored, DecodedBatch
from kvcm.threads import gc_paused

TOKENS = [random.Random(3).randrange(50_000) for _ in range(64)]


def _index(tmp_path, seen):
    store = LmdbStore(str(tmp_path / "engines"), map_size=1 << 24, sync=False)

    def block_size(_: str) -> int:
        seen.append(gc.isenabled())  # called while a drain is applied
        return 16

    index = EngineIndex(store, block_size)
    gen = index.add_source(SourceSpec("a", "inst", "tcp://h:1")).generation
    return store, index, gen


def test_apply_and_flush_pause_the_collector_and_restore_it(tmp_path):
    seen: list[bool] = []
    store, index, gen = _index(tmp_path, seen)
    try:
        assert gc.isenabled()
        index.apply_many([("a", gen, 0, DecodedBatch(1.0, [BlockStored([1, 2], None, TOKENS[:32], 16)])),
                          ("a", gen, 1, DecodedBatch(1.0, [BlockStored([3], 2, TOKENS[32:48], 16)]))])  # fmt: skip
        assert seen and not any(seen) and gc.isenabled()
        assert index.flush() == 2 and gc.isenabled()  # one log record, one source record
        again = EngineIndex(store, lambda _: 16)
        again.load()
        assert sorted(again.blocks_of("a")) == [1, 2, 3]
    finally:
        store.close()


def test_the_collector_is_restored_when_applying_fails(tmp_path):
    store = LmdbStore(str(tmp_path / "engines"), map_size=1 << 24, sync=False)

    def broken(_: str) -> int:
        raise RuntimeError("lookup failed")

    index = EngineIndex(store, broken)
    gen = index.add_source(SourceSpec("a", "inst", "tcp://h:1")).generation
    try:
        with pytest.raises(RuntimeError):
            index.apply("a", gen, 0, DecodedBatch(1.0, [BlockStored([1], None, TOKENS[:16], 16)]))
        assert gc.isenabled()
    finally:
        store.close()


def test_a_collector_turned_off_stays_off():
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with gc_paused():
        with gc_paused():  # nested: the inner one leaves it to the outer one
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_group_index_beyond_32_bits_is_a_broken_event_and_the_index_still_persists(tmp_path):
    """A hostile or buggy engine's ``group_idx`` out of range is dropped by the decoder (counted
    as an error), so it can never reach the index, whose persisted keys hold it in 32 bits."""
    from kvcm.proto.kv_events import AllBlocksCleared, BlockRemoved, decode_batch, encode_batch

    for bad in (1 << 32, 1 << 40, -1):
        for shape in ("array", "map", "mixed"):
            payload = encode_batch([BlockStored([9], None, TOKENS[:16], 16, group_idx=bad),
                                    BlockStored([1], None, TOKENS[:16], 16, group_idx=3),
                                    BlockRemoved([7], None, group_idx=bad), AllBlocksCleared()], 2.0, encoding=shape)
            batch = decode_batch(payload)
            assert [type(e).__name__ for e in batch.events] == ["BlockStored", "AllBlocksCleared"], (bad, shape)
            assert batch.events[0].group_idx == 3 and len(batch.errors) == 2
    seen: list[bool] = []
    store, index, gen = _index(tmp_path, seen)
    try:
        batch = decode_batch(encode_batch([BlockStored([9], None, TOKENS[:16], 16, group_idx=1 << 40),
                                           BlockStored([1], None, TOKENS[:16], 16)], 2.0))
        index.apply_many([("a", gen, 0, batch)])
        assert index.flush() >= 1  # persists: nothing out of range got in
        again = EngineIndex(store, lambda _: 16)
        again.load()
        assert sorted(again.blocks_of("a")) == [1]
    finally:
        store.close()
