"""The engine index's log-structured persistence (``engine_log``, :mod:`kvcm.engines.entries`):
one record per flush and source, tombstones, rewrites of a source whose log outgrew its blocks,
and data dirs written in the older one-record-per-block format. Real LMDB in temp dirs."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvcm.backends.metastore import LmdbStore
from kvcm.cache.keys import token_ids_to_block_keys
from kvcm.engines import entries
from kvcm.engines.entries import (
    BLOCK_KEY,
    BLOCKS_DB,
    LOG_DB,
    LOG_KEY,
    M64,
    SOURCES_DB,
    EngineBlock,
    block_id,
    decode_log,
    encode_log,
)
from kvcm.engines.index import EngineIndex
from kvcm.engines.sources import SourceSpec
from kvcm.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch

TOKENS = [random.Random(11).randrange(50_000) for _ in range(64 * 16)]
KEYS = token_ids_to_block_keys(TOKENS, 16)


@pytest.fixture
def store(tmp_path):
    s = LmdbStore(str(tmp_path / "engines"), map_size=1 << 26, sync=False)
    yield s
    s.close()


def _index(store, sources=("a",)):
    index = EngineIndex(store, lambda _: 16)
    gens = {s: index.add_source(SourceSpec(s, "inst", f"tcp://h:{i + 1}")).generation for i, s in enumerate(sources)}
    seqs: Counter[str] = Counter()

    def apply(source, *events):
        seqs[source] += 1
        return index.apply(source, gens[source], seqs[source] - 1, DecodedBatch(1.0, list(events)))

    return index, apply


def _store(hashes, first, parent=None, medium="GPU", group=None):
    toks = TOKENS[first * 16 : (first + len(hashes)) * 16]
    return BlockStored(list(hashes), parent, toks, 16, medium=medium, group_idx=group)


def _records(store, db):
    with store.read() as txn:
        return list(txn.scan(db))


def _same(restored: EngineIndex, index: EngineIndex) -> None:
    """Every source's blocks, position and answers are those of the index that was persisted."""
    assert sorted(s.spec.source_id for s in restored.sources()) == sorted(s.spec.source_id for s in index.sources())
    for state in index.sources():
        again = restored.get(state.spec.source_id)
        assert again is not None and restored.blocks_of(state.spec.source_id) == index.blocks_of(state.spec.source_id) and again.last_seq == state.last_seq
        assert restored.blocks_held(state.spec.source_id) == index.blocks_held(state.spec.source_id)
    for n in (1, 5, 64):
        assert restored.match("inst", KEYS[:n]) == index.match("inst", KEYS[:n])
        assert _holders(restored, KEYS[:n]) == _holders(index, KEYS[:n])


def _holders(index: EngineIndex, keys: list[int]) -> list[list[tuple[str, str, int]]]:
    """Per key its holders, in a fixed order (slot ids, hence the listed order, follow load order)."""
    return [sorted((h["source_id"], h["medium"], h["group_idx"]) for h in held) for held in index.locations("inst", keys)]


def _reloaded(store) -> EngineIndex:
    again = EngineIndex(store, lambda _: 16)
    again.load()
    return again


def test_a_record_round_trips_with_groups_and_tombstones():
    blk = EngineBlock("", 5, 16, (7,), {"GPU": 1})
    ids = [3, M64, block_id(1, 4), block_id((1 << 32) - 1, M64)]
    record = decode_log(encode_log(ids, [blk, None, blk, None]))
    assert record.ids() == ids and record.blocks == [blk, None, blk, None]
    plain = decode_log(encode_log([1, 2], [blk, blk]))
    assert plain.groups == [] and plain.ids() == [1, 2]
    assert decode_log(encode_log([], [])).ids() == []


@pytest.mark.parametrize("raw", [
    encode_log([1, 2], [EngineBlock("", 1, 16, (1,))]),  # fewer blocks than ids
    entries.ENC.encode(([1, 2], [5], [None, None])),  # groups of another length
])  # fmt: skip
def test_a_record_of_inconsistent_lengths_is_refused(raw):
    with pytest.raises(ValueError):
        decode_log(raw).ids()


def test_a_flush_writes_one_log_record_per_changed_source_and_no_block_records(store):
    index, apply = _index(store, ("a", "b", "c"))
    apply("a", _store(range(1, 65), 0))
    apply("a", _store(range(65, 129), 0))
    apply("b", _store([1, 2], 0), BlockRemoved([2], "GPU"))
    assert index.flush() == 2 + 2  # a and b: a log record and the source record each; c: unchanged
    assert len(_records(store, LOG_DB)) == 2 and _records(store, BLOCKS_DB) == []
    (akey, araw), (bkey, braw) = _records(store, LOG_DB)
    assert LOG_KEY.unpack(akey) == (index.get("a").number, 0) and LOG_KEY.unpack(bkey) == (index.get("b").number, 0)
    assert sorted(decode_log(araw).ids()) == list(range(1, 129))
    b = decode_log(braw)
    assert dict(zip(b.ids(), b.blocks)) == {1: index.blocks_of("b")[1], 2: None}  # 2: a tombstone
    apply("a", BlockRemoved([5], "GPU"))
    index.flush()
    assert [LOG_KEY.unpack(k)[1] for k, _ in _records(store, LOG_DB) if LOG_KEY.unpack(k)[0] == 1] == [0, 1]
    _same(_reloaded(store), index)


def test_replaying_the_log_gives_the_index_that_was_persisted(store):
    index, apply = _index(store, ("a", "b"))
    apply("a", _store([1, 2, 3], 0), _store([9], 0, medium="CPU"), _store([1 << 63 | 5], 0, group=2))
    index.flush()
    apply("a", _store([4], 3, parent=3), BlockRemoved([2, 3], "GPU"), _store([1, 2], 0))  # a store twice
    apply("b", _store([1, 2], 0))
    index.flush()
    apply("a", BlockRemoved([1], "GPU"))  # one of the two holdings
    index.flush()
    restored = _reloaded(store)
    _same(restored, index)
    assert restored.blocks_of("a")[1].refs == {"GPU": 1} and block_id(2, 1 << 63 | 5) in restored.blocks_of("a")
    assert restored.get("a").serial == index.get("a").serial == 3 and restored.get("a").logged == index.get("a").logged


def test_a_cleared_source_is_rewritten_and_the_others_untouched(store):
    index, apply = _index(store, ("a", "b"))
    apply("a", _store([1, 2], 0))
    apply("b", _store([1, 2], 0))
    index.flush()
    apply("a", _store([3], 2, parent=2))
    index.flush()
    apply("a", AllBlocksCleared(), _store([7], 0))
    index.flush()
    a, b = index.get("a").number, index.get("b").number
    keys = [LOG_KEY.unpack(k) for k, _ in _records(store, LOG_DB)]
    assert keys == [(a, 0), (b, 0)]  # a's two records replaced by one holding its live block
    assert index.get("a").logged == 1
    _same(_reloaded(store), index)
    index.remove_source("a")
    assert [LOG_KEY.unpack(k)[0] for k, _ in _records(store, LOG_DB)] == [b]
    _same(_reloaded(store), index)


def test_a_log_that_outgrew_its_blocks_is_rewritten(store, monkeypatch):
    monkeypatch.setattr(entries, "COMPACT_SLACK", 16)
    index, apply = _index(store)
    apply("a", _store(range(1, 9), 0))
    index.flush()
    for round_ in range(40):  # churn: the same 8 blocks stored and removed over and over
        apply("a", BlockRemoved(list(range(1, 9)), "GPU"))
        index.flush()
        apply("a", _store(range(1, 9), 0))
        index.flush()
        state = index.get("a")
        assert state.logged <= 2 * len(index.blocks_of("a")) + 16, round_  # what a flush leaves, at most
        held = sum(len(decode_log(raw).hashes) for _, raw in _records(store, LOG_DB))
        assert held == state.logged
    assert len(_records(store, LOG_DB)) < 10  # 81 flushes, a few records left
    _same(_reloaded(store), index)


def test_fresh_stores_count_towards_the_rewrite(store, monkeypatch):
    """A flush that appends tombstones and new blocks together counts both against the live
    blocks: the log it leaves is never over twice the live blocks plus the slack."""
    monkeypatch.setattr(entries, "COMPACT_SLACK", 16)
    index, apply = _index(store)
    for _ in range(2):  # logged: 4, 8, 12, 16 with 0 or 4 live
        apply("a", _store([1, 2, 3, 4], 0))
        index.flush()
        apply("a", BlockRemoved([1, 2, 3, 4], "GPU"))
        index.flush()
    apply("a", _store([1, 2, 3, 4], 0))
    index.flush()
    assert (index.get("a").logged, len(index.blocks_of("a"))) == (20, 4)
    apply("a", BlockRemoved([1, 2, 3], "GPU"), _store([5, 6, 7], 4))  # 3 tombstones, 3 new: 26 > 2 * 4 + 16
    index.flush()
    assert index.get("a").logged == len(index.blocks_of("a")) == 4
    _same(_reloaded(store), index)


def test_a_large_rewrite_is_split_into_chunks(store, monkeypatch):
    monkeypatch.setattr(entries, "CHUNK", 5)
    index, apply = _index(store)
    apply("a", _store(range(1, 13), 0))
    index.flush()
    assert [LOG_KEY.unpack(k)[1] for k, _ in _records(store, LOG_DB)] == [0, 1, 2]
    apply("a", AllBlocksCleared(), _store(range(1, 7), 0))
    index.flush()
    assert [LOG_KEY.unpack(k)[1] for k, _ in _records(store, LOG_DB)] == [0, 1]
    _same(_reloaded(store), index)


def test_a_failed_flush_rewrites_every_source_next_time(store, monkeypatch):
    index, apply = _index(store, ("a", "b"))
    apply("a", _store([1, 2], 0))
    apply("b", _store([1], 0))
    index.flush()
    apply("a", _store([3], 2, parent=2))
    real = entries.encode_log
    monkeypatch.setattr(entries, "encode_log", lambda *a: (_ for _ in ()).throw(OSError("disk")))
    with pytest.raises(OSError):
        index.flush()
    monkeypatch.setattr(entries, "encode_log", real)
    assert all(s.cleared for s in index.sources())
    index.flush()
    assert sorted(LOG_KEY.unpack(k)[1] for k, _ in _records(store, LOG_DB)) == [0, 0]
    _same(_reloaded(store), index)


# --- data dirs of the older format: one engine_blocks record per block ------------------------------


def _write_old_format(store, index: EngineIndex) -> None:
    """What kvcm wrote before the log: per source its record and one record per block, keyed
    ``number | group | hash`` (``BLOCK_KEY``), valued the block's msgpack array."""
    with store.write() as txn:
        for state in index.sources():
            txn.put(SOURCES_DB, state.spec.source_id.encode(), state.record())
            for bid, blk in index.blocks_of(state.spec.source_id).items():
                txn.put(BLOCKS_DB, BLOCK_KEY.pack(state.number, bid >> 64, bid & M64), blk.pack())


def test_a_data_dir_of_the_older_format_loads_and_moves_to_the_log(store):
    old, apply = _index(None, ("a", "b"))  # the index an older kvcm had persisted
    apply("a", _store([1, 2, 3], 0), _store([1, 2], 0), _store([9], 0, medium="CPU"), _store([4], 0, group=3))
    apply("b", _store([5, 6], 0))
    _write_old_format(store, old)
    assert len(_records(store, BLOCKS_DB)) == 7 and _records(store, LOG_DB) == []
    index = _reloaded(store)
    _same(index, old)
    assert index.get("a").logged == 5 and index.get("a").serial == 0
    gens = {s: index.get(s).generation for s in ("a", "b")}
    # later changes are logged over the old records: a tombstone hides an old block, a new
    # version replaces one
    index.apply_many([("a", gens["a"], 1, DecodedBatch(1.0, [BlockRemoved([3], "GPU"), BlockRemoved([1], "GPU"),
                                                               _store([10], 3, parent=2)]))])  # fmt: skip
    index.flush()
    assert len(_records(store, BLOCKS_DB)) == 7 and len(_records(store, LOG_DB)) == 1
    restored = _reloaded(store)
    _same(restored, index)
    assert 3 not in restored.blocks_of("a") and restored.blocks_of("a")[1].refs == {"GPU": 1}
    # a rewrite (here: the source cleared) drops its old records; the other source keeps its own
    index.apply_many([("a", gens["a"], 2, DecodedBatch(1.0, [AllBlocksCleared(), _store([1], 0)]))])
    index.flush()
    assert [BLOCK_KEY.unpack(k)[0] for k, _ in _records(store, BLOCKS_DB)] == [index.get("b").number] * 2
    _same(_reloaded(store), index)


# --- randomized: what is loaded is what was in memory at the last flush -------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_randomized_flushes_reload_to_the_same_index(store, monkeypatch, seed):
    monkeypatch.setattr(entries, "COMPACT_SLACK", 6)  # rewrites happen often
    monkeypatch.setattr(entries, "CHUNK", 7)
    rng = random.Random(seed)
    index, apply = _index(store, ("a", "b", "c"))
    for _ in range(120):
        source = rng.choice("abc")
        events = []
        for _ in range(rng.randint(1, 4)):
            roll = rng.random()
            first = rng.randrange(8)
            hashes = [rng.randrange(1, 40) for _ in range(rng.randint(1, 4))]
            if roll < 0.55:
                events.append(_store(hashes, first, medium=rng.choice(["GPU", "CPU"]), group=rng.choice([None, 0, 5])))
            elif roll < 0.95:
                events.append(BlockRemoved(hashes, rng.choice(["GPU", "CPU"]), rng.choice([None, 5])))
            else:
                events.append(AllBlocksCleared())
        apply(source, *events)
        if rng.random() < 0.4:
            index.flush()
            _same(_reloaded(store), index)
            for state in index.sources():  # what a flush leaves: garbage within the live blocks + slack
                assert state.logged <= 2 * len(index.blocks_of(state.spec.source_id)) + 6
        if rng.random() < 0.03:
            index.remove_source(source)
            index, apply = _reopen(store, index)
    index.flush()
    _same(_reloaded(store), index)


def _reopen(store, index: EngineIndex):
    """The persisted index loaded as a restarted kvcm would, sources re-added where removed."""
    index.flush()
    again = _reloaded(store)
    gens = {}
    for i, s in enumerate("abc"):
        state = again.get(s) or again.add_source(SourceSpec(s, "inst", f"tcp://h:{i + 1}"))
        gens[s] = state.generation
    seqs = Counter({s: again.get(s).last_seq + 1 for s in "abc"})

    def apply(source, *events):
        seqs[source] += 1
        return again.apply(source, gens[source], seqs[source] - 1, DecodedBatch(1.0, list(events)))

    return again, apply
