"""The data-format history of :mod:`kvcm.backends.migrations`: one test per past version's step or
refusal, on real files (LMDB in temp dirs, marker and snapshot files, a real redis-server), plus
checks that every version listed has its test and that docs/operations.md lists every format."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pathlib
import uuid

import lmdb
import msgpack
import pytest

from kvcm.backends import migrations
from kvcm.backends.metastore import LmdbStore
from kvcm.backends.migrations import (
    BLOCK_RECORD,
    ENGINE_INDEX,
    FORMATS,
    METASTORE,
    RECLAIM_SNAPSHOT,
    REGISTRY_SNAPSHOT,
    STORAGE_MARKER,
    TRACE,
    Fate,
    Format,
    Past,
)
from kvcm.backends.storage.host import machine_id
from kvcm.backends.storage.ownership import Owner, claim, marker_key, read_marker
from kvcm.cache import record_codec
from kvcm.cache.record_codec import Record, Status, new_location
from kvcm.control.records import parse_snapshot
from kvcm.control.registry import Registry
from kvcm.engines.entries import BLOCK_KEY, BLOCKS_DB, M64, SOURCES_DB
from kvcm.engines.index import EngineIndex
from kvcm.engines.sources import SourceSpec
from kvcm.errors import Code, InvalidArgument, KvcmError
from kvcm.optimizer.trace import TraceError
from kvcm.optimizer.trace_readers import read_trace
from kvcm.proto.kv_events import AllBlocksCleared, BlockStored, DecodedBatch
from kvcm.reclaimer.persist import RecencyFile

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "operations.md"
SCHEMA_KEY = b"registry.schema"


def _schema(store) -> bytes | None:
    with store.read() as view:
        return view.get("meta", SCHEMA_KEY)


@pytest.fixture
def lmdb_store(tmp_path):
    s = LmdbStore(str(tmp_path / "data"), map_size=1 << 24, sync=False)
    yield s
    s.close()


@pytest.fixture
def redis_store(redis_server, tmp_path):
    from kvcm.backends.metastore.redis import RedisStore

    s = RedisStore(redis_server.url, str(tmp_path / "data"), prefix=f"m{uuid.uuid4().hex[:10]}")
    yield s
    s.close()


# -- the metadata store: schema key, LMDB layout --------------------------------------------------


@pytest.mark.parametrize("kind", ["lmdb", "redis"])
def test_metastore_v0_a_store_without_the_schema_key_gets_it_and_keeps_its_data(kind, request):
    store = request.getfixturevalue(f"{kind}_store")
    with store.write() as txn:  # a store an older kvcm wrote before the key: data, no key
        txn.put("blocks", b"k", b"v")
    assert _schema(store) is None
    Registry(store)
    assert _schema(store) == METASTORE.marker == b"1"
    with store.read() as view:
        assert view.get("blocks", b"k") == b"v"
    Registry(store)  # and it opens again as it is
    assert _schema(store) == b"1"


@pytest.mark.parametrize("kind", ["lmdb", "redis"])
@pytest.mark.parametrize("found", [b"2", b"17"])
def test_metastore_newer_schema_is_refused_naming_both_versions(kind, found, request):
    store = request.getfixturevalue(f"{kind}_store")
    with store.write() as txn:
        txn.put("meta", SCHEMA_KEY, found)
    with pytest.raises(KvcmError) as info:
        Registry(store)
    message = info.value.message
    assert info.value.code is Code.UNSUPPORTED
    assert f"version {found.decode()}" in message and "supports (1)" in message and "newer" in message
    assert "data dir" in message  # what to do
    assert _schema(store) == found  # nothing rewritten


def test_metastore_unreadable_schema_is_refused(lmdb_store):
    with lmdb_store.write() as txn:
        txn.put("meta", SCHEMA_KEY, b"one")
    with pytest.raises(KvcmError) as info:
        Registry(lmdb_store)
    assert info.value.code is Code.UNSUPPORTED and "b'one'" in info.value.message and "writes 1" in info.value.message


def test_lmdb_layout_access_moves_into_runs_and_engine_hashes_is_dropped(tmp_path):
    path = tmp_path / "data"
    os.makedirs(path / "meta")
    env = lmdb.open(str(path / "meta"), max_dbs=16, subdir=True)
    access, hashes = env.open_db(b"access"), env.open_db(b"engine_hashes")
    with env.begin(write=True) as txn:  # the layout an older kvcm left
        txn.put(b"r1", b"one", db=access)
        txn.put(b"r2", b"two", db=access)
        txn.put(b"h", b"x", db=hashes)
    env.close()
    store = LmdbStore(str(path), map_size=1 << 24, sync=False)
    try:
        with store.read() as view:
            assert dict(view.scan("runs")) == {b"r1": b"one", b"r2": b"two"}
    finally:
        store.close()
    env = lmdb.open(str(path / "meta"), max_dbs=16, subdir=True)
    with env.begin() as txn:
        names = {bytes(k) for k, _ in txn.cursor()}
    env.close()
    assert b"access" not in names and b"engine_hashes" not in names and b"runs" in names
    again = LmdbStore(str(path), map_size=1 << 24, sync=False)  # the steps are no-ops now
    try:
        with again.read() as view:
            assert dict(view.scan("runs")) == {b"r1": b"one", b"r2": b"two"}
    finally:
        again.close()


# -- block records ----------------------------------------------------------------------------------


def _format_1(record: Record) -> bytes:
    """A record as format 1 stored it (``SLOW``: float seconds, the wire per location)."""
    locs = [[x.id, x.status, x.storage, x.type, x.nbytes, x.created, x.written, x.session, x.wire]
            for x in record.locs]
    return bytes((record_codec.SLOW,)) + msgpack.packb([record.parent, record.created, record.updated, locs,
                                                        record.run])


def test_block_record_v1_is_read_and_written_in_the_current_format(lmdb_store):
    loc = new_location("a1b2c3d4", Status.SERVING, "disk", "file",
                       [("tp0", "file:///data/a1b2c3d4-1.kv?blkid=3&size=4096")], 4096, 1764590000.5)
    loc.written = 1764590000.75
    old = Record(7, 1764590000.5, 1764590001.25, [loc], run=None)
    with lmdb_store.write() as txn:
        txn.put("blocks", b"key", _format_1(old))
    with lmdb_store.read() as view:
        value = view.get("blocks", b"key")
    assert value is not None and not record_codec.is_current(value)
    back = record_codec.decode(value)
    assert (back.parent, back.created, back.updated) == (7, 1764590000.5, 1764590001.25)
    assert back.locs[0].wire == loc.wire and back.locs[0].written == 1764590000.75
    with lmdb_store.write() as txn:  # the block changes: written as this kvcm writes
        txn.put("blocks", b"key", record_codec.encode(back))
    with lmdb_store.read() as view:
        value = view.get("blocks", b"key")
    assert value is not None and record_codec.is_current(value) and BLOCK_RECORD.current == 2
    assert record_codec.decode(value).locs[0].wire == loc.wire


# -- the engine index -------------------------------------------------------------------------------


def test_engine_index_v1_is_loaded_and_moves_to_the_log_on_the_next_rewrite(lmdb_store):
    old = EngineIndex(None, lambda _: 16)  # the index an older kvcm had persisted
    gen = old.add_source(SourceSpec("a", "inst", "tcp://h:1")).generation
    old.apply("a", gen, 0, DecodedBatch(1.0, [BlockStored([1, 2, 3], None, list(range(48)), 16)]))
    state = old.get("a")
    with lmdb_store.write() as txn:  # one engine_blocks record per block, no log
        txn.put(SOURCES_DB, b"a", state.record())
        for bid, blk in old.blocks_of("a").items():
            txn.put(BLOCKS_DB, BLOCK_KEY.pack(state.number, bid >> 64, bid & M64), blk.pack())
    index = EngineIndex(lmdb_store, lambda _: 16)
    index.load()
    assert index.blocks_of("a") == old.blocks_of("a") and ENGINE_INDEX.current == 2
    again = index.get("a")
    assert again is not None
    index.apply_many([("a", again.generation, 1, DecodedBatch(2.0, [AllBlocksCleared(),
                                                                    BlockStored([9], None, list(range(16)), 16)]))])
    index.flush()  # a cleared source is rewritten: its engine_blocks go
    with lmdb_store.read() as view:
        assert list(view.scan(BLOCKS_DB)) == []
    reloaded = EngineIndex(lmdb_store, lambda _: 16)
    reloaded.load()
    assert reloaded.blocks_of("a") == index.blocks_of("a")


# -- storage ownership markers ----------------------------------------------------------------------


def _owner(tmp_path) -> Owner:
    return Owner("0000abcd", "dd-1", str(tmp_path / "data"), key=marker_key(str(tmp_path / "data")), recorded=True)


def test_storage_marker_v1_unsigned_is_taken_and_signed_on_open(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    path = str(root / ".kvcm-storage")
    with open(path, "w") as f:  # as an earlier kvcm left it: no signature
        json.dump({"kvcm_marker": 1, "storage_id": "0000abcd", "storage": "disk", "data_dir_id": "dd-1",
                   "data_dir": "", "adopted": []}, f)
    owner = _owner(tmp_path)
    assert claim(path, owner, "disk", str(root), 0) is None
    with open(path) as f:
        body = json.load(f)
    assert body["kvcm_marker"] == STORAGE_MARKER.current == 3 and body["mac"] and body["host"]
    marker = read_marker(path, owner.key)
    assert marker is not None and marker.authentic


def test_storage_marker_newer_is_read_for_the_fields_this_kvcm_knows(tmp_path):
    path = str(tmp_path / ".kvcm-storage")
    with open(path, "w") as f:
        json.dump({"kvcm_marker": 4, "storage_id": "0000abcd", "storage": "disk", "data_dir_id": "dd-1",
                   "future": True}, f)
    marker = read_marker(path)
    assert marker is not None and marker.storage_id == "0000abcd" and STORAGE_MARKER.fate(4) is Fate.READ


def test_storage_marker_v2_gains_the_host_and_its_signature_at_the_owners_open(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCM_STATE_DIR", str(tmp_path / "state"))
    root = tmp_path / "root"
    root.mkdir()
    path = str(root / ".kvcm-storage")
    owner = _owner(tmp_path)
    body = {"kvcm_marker": 2, "storage_id": "0000abcd", "storage": "disk", "data_dir_id": "dd-1",
            "data_dir": owner.data_dir, "adopted": []}
    signed = json.dumps({**body, "path": path}, sort_keys=True).encode()  # as version 2 signed it
    body["mac"] = hmac.new(owner.key, signed, hashlib.sha256).hexdigest()
    with open(path, "w") as f:
        json.dump(body, f)
    old = read_marker(path, owner.key)
    assert old is not None and old.authentic and not old.host_signed and STORAGE_MARKER.fate(2) is Fate.UPGRADE
    assert claim(path, owner, "disk", str(root), 0) is None
    new = read_marker(path, owner.key)
    assert new is not None and new.authentic and new.host_signed and new.host == machine_id()


# -- the reclaimer's snapshot -----------------------------------------------------------------------


@pytest.mark.parametrize("found", [0, 2])
def test_reclaim_snapshot_of_another_version_is_set_aside_and_rebuilt(tmp_path, found):
    state = tmp_path / "reclaim"
    state.mkdir()
    (state / "snapshot").write_bytes(msgpack.packb({"version": found, "gen": 0, "groups": {"g": []}}))
    groups, rounds = RecencyFile(str(state)).load()
    assert groups is None and list(rounds) == []
    assert (state / "snapshot.bad").exists() and not (state / "snapshot").exists()
    assert f"version {found}" in (RECLAIM_SNAPSHOT.refusal(found) or "")


def test_reclaim_snapshot_of_the_current_version_is_loaded(tmp_path):
    state = tmp_path / "reclaim"
    state.mkdir()
    (state / "snapshot").write_bytes(msgpack.packb({"version": 1, "gen": 0, "groups": {"g": []}}))
    groups, _ = RecencyFile(str(state)).load()
    assert groups == {"g": []}


# -- registry snapshots and traces ------------------------------------------------------------------


def test_registry_snapshot_newer_is_refused_older_read():
    with pytest.raises(InvalidArgument) as info:
        parse_snapshot(json.dumps({"format": "kvcm-registry", "version": 2}))
    assert "version 2" in info.value.message and "(1)" in info.value.message
    assert parse_snapshot({"format": "kvcm-registry", "version": 0}).version == 0
    assert REGISTRY_SNAPSHOT.fate(0) is Fate.READ


def test_trace_newer_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"kvcm_schema": 2, "block_size": 16}) + "\n")
    with pytest.raises(TraceError) as info:
        list(read_trace(str(path), "kvcm_schema").records)
    assert "version 2" in str(info.value) and "(1)" in str(info.value) and "--dump-schema" in str(info.value)
    path.write_text(json.dumps({"kvcm_schema": 1, "block_size": 16}) + "\n")
    assert list(read_trace(str(path), "kvcm_schema").records) == []
    assert TRACE.fate(0) is Fate.READ


# -- the module itself ------------------------------------------------------------------------------


def test_a_past_version_marked_refuse_names_found_expected_and_what_to_do():
    fmt = Format("thing", "somewhere", current=3, past=(Past(2, "old", Fate.REFUSE, "convert it with X"),))
    assert fmt.refusal(3) is None and fmt.refusal(b"3") is None
    assert fmt.refusal(2) == "thing: version 2 is not read by this kvcm (it reads 3); convert it with X"
    assert "version 1 is not read" in (fmt.refusal(1) or "")  # an unknown older one
    assert "newer than this kvcm supports (3)" in (fmt.refusal(4) or "")
    assert "not one kvcm writes" in (fmt.refusal(True) or "") and "not one kvcm writes" in (fmt.refusal(None) or "")


#: The test of each past version of each format (and of its newer versions' fate).
STEP_TESTS = {
    (METASTORE.name, 0): test_metastore_v0_a_store_without_the_schema_key_gets_it_and_keeps_its_data,
    (METASTORE.name, "newer"): test_metastore_newer_schema_is_refused_naming_both_versions,
    (BLOCK_RECORD.name, 1): test_block_record_v1_is_read_and_written_in_the_current_format,
    (BLOCK_RECORD.name, "newer"): test_a_past_version_marked_refuse_names_found_expected_and_what_to_do,
    (ENGINE_INDEX.name, 1): test_engine_index_v1_is_loaded_and_moves_to_the_log_on_the_next_rewrite,
    (ENGINE_INDEX.name, "newer"): test_a_past_version_marked_refuse_names_found_expected_and_what_to_do,
    (STORAGE_MARKER.name, 1): test_storage_marker_v1_unsigned_is_taken_and_signed_on_open,
    (STORAGE_MARKER.name, 2): test_storage_marker_v2_gains_the_host_and_its_signature_at_the_owners_open,
    (STORAGE_MARKER.name, "newer"): test_storage_marker_newer_is_read_for_the_fields_this_kvcm_knows,
    (RECLAIM_SNAPSHOT.name, "newer"): test_reclaim_snapshot_of_another_version_is_set_aside_and_rebuilt,
    (REGISTRY_SNAPSHOT.name, "newer"): test_registry_snapshot_newer_is_refused_older_read,
    (TRACE.name, "newer"): test_trace_newer_is_refused_with_what_to_do,
}


def test_every_past_version_has_its_test():
    listed = {(f.name, p.version) for f in FORMATS for p in f.past} | {(f.name, "newer") for f in FORMATS}
    assert listed == set(STEP_TESTS)


def test_operations_doc_lists_every_format_and_its_current_version():
    text = DOCS.read_text()
    assert "## Data format versions" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    for fmt in FORMATS:
        row = next((r for r in rows if r.startswith(f"| {fmt.name} |")), None)
        assert row is not None, f"docs/operations.md has no row for {fmt.name}"
        assert f"| {fmt.current} |" in row, row
    assert "kvcm.backends.migrations" in text and migrations.__doc__
