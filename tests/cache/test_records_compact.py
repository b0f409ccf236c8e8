"""Compact block records: exact URI round trips, skeletons persisted with the records that use
them, the old record and run formats still read, runs deflated but exact."""

from __future__ import annotations

import os
import uuid

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcm.backends.metastore import LmdbStore, i64
from kvcm.cache import locations
from kvcm.cache import record_codec as records
from kvcm.cache.locations import address, addresses, pack_wire, uris, wire
from kvcm.cache.meta_index import DB as BLOCKS
from kvcm.cache.record_codec import (
    RUNS_DB,
    Record,
    Status,
    check_value,
    decode,
    encode,
    encode_run,
    fast_wire,
    new_location,
    run_match,
    run_members,
)
from kvcm.cache.uricodec import join, matcher, split
from kvcm.node.app import App
from kvcm.testing import make_test_config

# -- URIs -----------------------------------------------------------------------------------------

SHAPES = [
    "file://disk/s4096/{a:08d}.kv?blkid={b}&size=4096",
    "file://disk/s4096/{h}-{a:08d}.kv?blkid={b}&size=4096",
    "shm://seg/s8192/{a:06d}.seg?blkid={b}&size=8192",
    "mooncake://mc/?key=kvcm/{u}&size=65536",
    "hf3fs://fs/mnt/3fs/root/{u}?blkid={b}&size=4096",
    "pace://pool/{a}?media_type=1&node_id={b}&range_id=7&size=4096",
    "s3://bucket/100%25/{a}/x%d?v={b}",
]


def _uri(shape: str, a: int, b: int, h: str = "ab12", u: str = "") -> str:
    return shape.format(a=a, b=b, h=h, u=u or uuid.UUID(int=a * 7919 + b).hex)


@given(st.text())
@settings(max_examples=400, deadline=None)
def test_any_text_comes_back_exactly_or_is_refused(text):
    got = split(text)
    if got is not None:
        skeleton, ints = got
        assert join(skeleton, ints) == text
        assert all(0 <= i < 1 << 64 for i in ints)
        assert matcher(skeleton)(text) == ints


@given(st.sampled_from(SHAPES), st.integers(0, 10**9), st.integers(0, 16383),
       st.text(alphabet="0123456789abcdef", min_size=1, max_size=40))
@settings(max_examples=300, deadline=None)
def test_storage_uris_split_and_rebuild_byte_for_byte(shape, a, b, h):
    uri = _uri(shape, a, b, h)
    got = split(uri)
    assert got is not None and join(*got) == uri
    specs = [("tp0", uri), ("tp1", _uri(shape, a + 1, b))]
    addr = address("file", "disk", 8192, specs)
    assert uris(addr) == [u for _, u in specs]
    assert wire(addr) == pack_wire("file", specs)


@given(st.integers(0, 1 << 64 - 1), st.integers(0, 1 << 64 - 1))
@settings(max_examples=200, deadline=None)
def test_deltas_wrap_modulo_2_64(x, y):
    first = [("tp0", f"mc://m/?key={x:016x}{y:016x}")]
    address("mooncake", "m", 1, first)
    other = [("tp0", f"mc://m/?key={y:016x}{x:016x}")]
    addr = address("mooncake", "m", 1, other)
    assert uris(addr) == [other[0][1]]
    assert wire(addr) == pack_wire("mooncake", other)  # a delta below -2**63 keeps the wire itself


def test_matcher_refuses_what_it_could_not_write_back():
    skeleton, _ = split("file://d/s4096/00000012.kv?blkid=3")
    assert matcher(skeleton)("file://d/s4096/00000013.kv?blkid=30") == [4096, 13, 30]
    assert matcher(skeleton)("file://d/s4096/0000013.kv?blkid=3") is None  # padding width
    assert matcher(skeleton)("file://d/s4096/00000013.kv?blkid=03") is None  # a leading zero


def test_a_batch_of_one_shape_and_a_mixed_batch_give_the_same_addresses():
    batch = [[_uri(SHAPES[0], i, i % 5), _uri(SHAPES[0], i + 64, 0)] for i in range(40)]
    fewer = [*batch[:10], [_uri(SHAPES[0], 5, 0), "file://disk/other/07.kv"], *batch[10:]]
    odd = "file://disk/s4096/0000005.kv?blkid=0&size=4096"  # as many numbers, another padding
    padded = [*batch[:20], [odd, odd], *batch[20:]]
    for lists in (batch, fewer, padded):
        got = addresses("file", "disk", 8192, ["tp0", "tp1"], lists)
        assert got == [address("file", "disk", 8192, list(zip(["tp0", "tp1"], u))) for u in lists]
        assert [uris(a) for a in got] == lists


@pytest.mark.parametrize("sid", ["a3f9c2d1", "12345678", "deadbeef"])
def test_a_batch_of_packed_file_uris_is_read_in_one_pass(sid):
    """The packed ``file`` storage's URIs carry a hex storage id: the whole batch is still read by
    the batch path (one translate, one slice per integer), not URI by URI."""
    def uri(i: int, spec: int) -> str:
        return f"file:///data/blocks/s8192/{sid}-{i // 16:08d}.kv?off={(i % 16) * 8192 + spec * 4096}&len=4096"

    batch = [[uri(i, 0), uri(i, 1)] for i in range(1, 24)]
    storage = f"packed-{sid}"
    address("file", storage, 8192, list(zip(["tp0", "tp1"], [uri(0, 0), uri(0, 1)])))  # the skeleton
    sid_int = locations._last[("file", storage, 8192, ("tp0", "tp1"))]
    plan = locations._columns(sid_int)
    assert plan is not None
    ints = locations._batch_ints(locations._by_id[sid_int], plan, batch)
    assert ints == [n for u in batch for one in u for n in split(one)[1]]
    got = addresses("file", storage, 8192, ["tp0", "tp1"], batch)
    assert [uris(a) for a in got] == batch


def test_past_the_table_limit_locations_are_stored_verbatim(monkeypatch):
    monkeypatch.setattr(locations, "MAX_SKELETONS", 0)
    specs = [("tp0", f"brand-new-shape-{os.getpid()}://x/1")]
    addr = address("file", "nowhere", 1, specs)
    assert not locations.is_compact(addr) and addr == pack_wire("file", specs)
    loc = new_location("abcdefgh", Status.SERVING, "nowhere", "file", specs, 1, 5.0)
    value = encode(Record(None, 5.0, 5.0, [loc]))
    assert decode(value) == Record(None, 5.0, 5.0, [loc]) and fast_wire(value) == addr
    check_value(value)


# -- records --------------------------------------------------------------------------------------


def _two_spec_location(i: int, status: int = Status.SERVING) -> records.Location:
    specs = [("tp0", _uri(SHAPES[1], i, i % 16384)), ("tp1", _uri(SHAPES[1], i + 64, i % 16384))]
    loc = new_location("a1b2c3d4", status, "disk2", "file", specs, 8192, 1764590000.123)
    loc.written = 1764590000.456 if status == Status.SERVING else 0.0
    loc.session = "s" * 32 if status == Status.WRITING else ""
    return loc


def test_a_serving_record_with_two_specs_is_small_and_exact():
    loc = _two_spec_location(123456)
    record = Record(-(1 << 62), 1764590000.123, 1764590000.789, [loc], run=1 << 62)
    value = encode(record)
    assert len(value) <= 72  # format 1 took about 300 bytes for this record
    assert decode(value) == record and encode(decode(value)) == value
    assert fast_wire(value) == loc.wire
    check_value(value)


def test_times_are_kept_to_the_millisecond():
    loc = _two_spec_location(1)
    record = Record(None, 1000.0006, 1000.0016, [loc])
    loc.created, loc.written = 1000.0004, 999.9
    back = decode(encode(record))
    assert (back.created, back.updated) == (1000.001, 1000.002)  # rounded, not truncated
    assert (back.locs[0].created, back.locs[0].written) == (1000.0, 999.9)


def test_records_with_several_or_no_serving_copies():
    a, b, c = _two_spec_location(1), _two_spec_location(2, Status.WRITING), _two_spec_location(3, Status.DELETING)
    b.id, c.id = "zzzzzzzz", "yyyyyyyy"
    for locs in ([a, b], [b], [a, c], [a, b, c]):
        record = Record(7, 1.0, 2.0, list(locs))
        value = encode(record)
        assert decode(value) == record
        check_value(value)


# -- format 1 (what older kvcm wrote) -------------------------------------------------------------


class _V1Location(msgspec.Struct, array_like=True):
    id: str
    status: int
    storage: str
    type: str
    nbytes: int
    created: float
    written: float
    session: str
    wire: bytes


class _V1Record(msgspec.Struct, array_like=True):
    parent: int | None
    created: float
    updated: float
    locs: list[_V1Location]
    run: int | None = None


def encode_v1(record: Record) -> bytes:
    """Format 1 as kvcm wrote it: the serving wire in a FAST header, float seconds."""
    v1 = _V1Record(record.parent, record.created, record.updated,
                   [_V1Location(x.id, x.status, x.storage, x.type, x.nbytes, x.created, x.written, x.session, x.wire)
                    for x in record.locs], record.run)
    serving = [x for x in v1.locs if x.status == Status.SERVING]
    if len(serving) != 1:
        return bytes((records.SLOW,)) + msgspec.msgpack.encode(v1)
    head = serving[0].wire
    serving[0].wire = b""
    return bytes((records.FAST,)) + len(head).to_bytes(2, "big") + head + msgspec.msgpack.encode(v1)


def encode_run_v1(storage: str, keys: list[int], wires: list[bytes]) -> bytes:
    offsets = [0]
    for w in wires:
        offsets.append(offsets[-1] + len(w))
    name = storage.encode()
    return b"".join((len(name).to_bytes(2, "big"), name, len(wires).to_bytes(4, "big"), records.pack_keys(keys),
                     b"".join(o.to_bytes(4, "big") for o in offsets), *wires))


def test_format_1_values_decode_to_the_same_record():
    loc = _two_spec_location(9)
    record = Record(3, 10.5, 11.25, [loc], run=3)
    old = encode_v1(record)
    back = decode(old)
    assert back.locs[0].wire == loc.wire and back.locs[0].uris() == loc.uris()
    assert (back.parent, back.created, back.updated, back.run) == (3, 10.5, 11.25, 3)
    assert fast_wire(old) == loc.wire
    check_value(old)
    again = encode(back)  # rewritten in format 2 (verbatim address: no store to intern into)
    assert records.is_current(again) and decode(again).locs[0].wire == loc.wire


def test_runs_of_both_formats_match_alike():
    wires = [_two_spec_location(i).wire for i in range(50)]
    keys = list(range(100, 150))
    for value in (encode_run("disk", keys, wires), encode_run_v1("disk", keys, wires)):
        assert run_members(value) == ("disk", keys, wires)
        storage, m, body = run_match(value, records.pack_keys([*keys[:20], 7]), b"k" * 16)
        assert (storage, m, body) == ("disk", 20, b"".join(wires[:20]))
    assert len(encode_run("disk", keys, wires)) < 8 * 50 + 25 * 50  # the wires deflated


def test_the_run_body_cache_never_serves_another_run_under_the_same_key():
    keys = [1, 2, 3]
    first = encode_run("disk", keys, [_two_spec_location(i).wire for i in keys])
    second = encode_run("disk", keys, [_two_spec_location(i + 10).wire for i in keys])
    slot = os.urandom(16)
    assert run_match(first, records.pack_keys(keys), slot)[2] == b"".join(_two_spec_location(i).wire for i in keys)
    assert run_match(second, records.pack_keys(keys), slot)[2] == b"".join(_two_spec_location(i + 10).wire for i in keys)


# -- a data dir -----------------------------------------------------------------------------------


def _app(tmp_path) -> App:
    return App(make_test_config(str(tmp_path / "data"), f"ipc://{tmp_path}/s.sock", {"store": {"sync": False}}))


def _write(app: App, keys: list[int], instance: str = "i") -> None:
    call = app.dispatcher.call
    started = call("start_write_cache", {"instance_id": instance, "block_keys": keys})
    call("finish_write_cache", {"instance_id": instance, "write_session_id": started["write_session_id"],
                                "success_blocks": {"offset": len(keys)}})


def _register(app: App) -> None:
    app.dispatcher.call("register_instance", {
        "instance_group": "default", "instance_id": "i", "block_size": 16,
        "location_spec_infos": [{"name": "tp0", "size": 4096}, {"name": "tp1", "size": 4096}]})


def _locate(app: App, keys: list[int], query: str = "prefix_match") -> object:
    return app.dispatcher.call("get_cache_location", {"instance_id": "i", "query_type": query, "block_keys": keys})


def _forget_skeletons() -> None:
    """What a fresh process knows: nothing until a store is loaded."""
    locations._by_id.clear()
    locations._packed.clear()
    locations._by_shape.clear()
    locations._last.clear()
    locations.wires.clear()
    records.bodies.clear()


def test_skeletons_are_persisted_and_loaded_with_the_data_dir(tmp_path):
    app = _app(tmp_path)
    try:
        _register(app)
        _write(app, list(range(1, 9)))
        before = {q: _locate(app, list(range(1, 9)), q) for q in ("prefix_match", "batch_get")}
        meta = app.dispatcher.call("get_cache_meta", {"instance_id": "i", "block_keys": [1, 2], "detail_level": 2})
    finally:
        app.stop()
    _forget_skeletons()
    app = _app(tmp_path)
    try:
        assert {q: _locate(app, list(range(1, 9)), q) for q in before} == before
        assert app.dispatcher.call("get_cache_meta", {"instance_id": "i", "block_keys": [1, 2],
                                                      "detail_level": 2}) == meta
        app.cache.check()
    finally:
        app.stop()


def test_a_rolled_back_write_leaves_no_skeleton_behind_and_the_next_one_stores_it(tmp_path):
    store = LmdbStore(str(tmp_path / "d"), map_size=8 << 20, sync=False)
    try:
        specs = [("tp0", f"file://rolled-{os.getpid()}/x/{n}.kv") for n in (1, 2)]
        addr = address("file", "rolled", 2, specs)
        with pytest.raises(RuntimeError), store.write() as txn:
            locations.persist(txn, store, [addr])
            raise RuntimeError("the request failed")
        with store.read() as view:
            assert view.get(locations.DB, addr[:4]) is None
        with store.write() as txn:
            locations.persist(txn, store, [addr])
        with store.read() as view:
            assert view.get(locations.DB, addr[:4]) is not None
            locations.check(view, [addr])
    finally:
        store.close()


def test_a_data_dir_written_in_format_1_keeps_working(tmp_path):
    app = _app(tmp_path)
    try:
        _register(app)
        _write(app, list(range(1, 33)))
        _write(app, [40])
        keys = [*range(1, 33), 40]
        before = {q: _locate(app, keys, q) for q in ("prefix_match", "batch_get")}
        with app.store.write() as txn:  # rewrite every record and run as older kvcm stored them
            for dbkey, value in list(txn.scan(BLOCKS)):
                txn.put(BLOCKS, dbkey, encode_v1(decode(value)))
            for dbkey, value in list(txn.scan(RUNS_DB)):
                storage, run_keys, wires = run_members(value)
                txn.put(RUNS_DB, dbkey, encode_run_v1(storage, run_keys, wires))
    finally:
        app.stop()
    _forget_skeletons()
    app = _app(tmp_path)
    try:
        with app.store.read() as view:
            assert all(not records.is_current(v) for _, v in view.scan(BLOCKS))
        assert {q: _locate(app, keys, q) for q in before} == before
        app.cache.check()  # accepts format 1 values and runs
        _write(app, [41, 42])  # new writes: format 2
        assert app.dispatcher.call("remove_cache", {"instance_id": "i", "block_keys": [1, 2]})["removed"] == 2
        app.cache.background_once()
        with app.store.read() as view:
            assert records.is_current(view.get(BLOCKS, app.cache.namespace_of("i") + i64(41)))
        assert len(_locate(app, [3, 4, 5], "batch_get")["locations"]) == 3
        app.cache.check()
    finally:
        app.stop()


@given(st.lists(st.text(min_size=1, max_size=300), min_size=1, max_size=3), st.text(max_size=5))
@settings(max_examples=150, deadline=None)
def test_built_wires_equal_packed_ones_whatever_the_names_and_lengths(texts, name):
    specs = [(f"{name}{i}", f"x://{t}/{i}") for i, t in enumerate(texts)]
    addr = address("t", f"built-{len(texts)}", 3, specs)
    locations.wires.clear()
    assert wire(addr) == pack_wire("t", specs)
