"""Pending-delete entries that carry what the deleter needs (:mod:`kvcm.cache.deleter`): a record
every copy of which one marking made ``deleting`` is dropped by a byte compare, without decoding
it, and only while it is still the record that was marked; older entries (six and four fields)
and every other case take the decoding path. Real servers on every store (LMDB in a temp dir,
memory, a local redis-server) with a file storage."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from kvcm.backends.metastore import i64
from kvcm.cache.deleter import DB as DELETES
from kvcm.cache.meta_index import DB as BLOCKS
from kvcm.cache.meta_index import namespace
from kvcm.cache.record_codec import decode
from kvcm.testing import RunningServer, serve_in_thread
from tests.helpers import add_file_storage, add_group, register, write

BLOCK = 2048  # two specs of 1024 bytes (helpers.SPECS)
GRACE_S = 60  # the group's delay: the deleter runs only when a test says so (run_once(now=...))


@pytest.fixture(params=["lmdb", "memory", "redis"])
def server(request: Any, tmp_path: Any) -> Iterator[tuple[RunningServer, Any]]:
    overrides: dict[str, dict[str, Any]] = {"reclaim": {"enabled": False}, "cache": {"delete_poll_ms": 3_600_000}}
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
        overrides["store"] = {"backend": "redis", "redis_url": url, "redis_prefix": f"t{uuid.uuid4().hex[:12]}"}
    elif request.param == "memory":
        overrides["store"] = {"backend": "memory"}
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=overrides) as srv, srv.client() as c:
        add_group(c, "g", ["default-file"], delay_ms=GRACE_S * 1000)
        register(c, "a", group="g")
        yield srv, c


def entries(cache: Any) -> list[list[Any]]:
    with cache.store.read() as view:
        return [msgpack.unpackb(v) for _, v in view.scan(DELETES)]


def stored(cache: Any, key: int) -> bytes | None:
    with cache.store.read() as view:
        value: bytes | None = view.get(BLOCKS, namespace("a") + i64(key))
        return value


def free_all(cache: Any) -> int:
    freed: int = cache.deleter.run_once(now=cache.clock() + GRACE_S + 1)
    return freed


def test_a_dead_record_is_queued_with_its_stored_value(server):
    srv, c = server
    write(c, [1, 2], "a")
    cache = srv.app.cache
    c.call("remove_cache", {"instance_id": "a", "block_keys": [1, 2]})
    found = sorted(entries(cache), key=lambda f: f[2])
    assert [f[2] for f in found] == [1, 2]
    for f in found:
        assert len(f) == 10 and f[8] == stored(cache, f[2]) and f[9] == 1
        assert f[4] == BLOCK and f[5] == "file" and f[6] == "default-file"
    cache.check()
    assert free_all(cache) == 4  # two URIs (specs) per block
    assert stored(cache, 1) is None and stored(cache, 2) is None
    assert entries(cache) == [] and cache.usage("g")["bytes"] == 0
    cache.check()


def two_storages(srv: RunningServer, c: Any) -> None:
    """Group ``h`` over the default file storage and a second one, instance ``b`` in it."""
    add_file_storage(c, "f2", os.path.join(srv.data_dir, "f2"))
    add_group(c, "h", ["default-file", "f2"], delay_ms=GRACE_S * 1000)
    register(c, "b", group="h")


def storages_of(cache: Any, key: int) -> list[tuple[str, int]]:
    with cache.store.read() as view:
        raw = view.get(BLOCKS, namespace("b") + i64(key))
    return [] if raw is None else [(x.storage, x.status) for x in decode(raw).locs]


def test_a_block_rewritten_after_its_mark_keeps_its_new_copy(server):
    srv, c = server
    cache = srv.app.cache
    two_storages(srv, c)
    write(c, [1], "b")
    (first, _), = storages_of(cache, 1)
    c.call("remove_cache", {"instance_id": "b", "block_keys": [1]})
    assert entries(cache)[0][8] is not None  # the record as marked: the deleter's cheap drop
    c.call("disable_storage", {"storage_unique_name": first})
    write(c, [1], "b")  # its copy is on a storage no longer usable: the key is written again
    (_, old), (second, new) = storages_of(cache, 1)
    assert (old, new) == (4, 3) and second != first
    assert free_all(cache) == 2  # the old copy's two URIs, nothing of the new one
    assert storages_of(cache, 1) == [(second, 3)]
    assert cache.usage("h")["bytes"] == BLOCK
    located = c.call("get_cache_location", {"instance_id": "b", "query_type": "prefix_match", "block_keys": [1]})
    assert len(located["locations"]) == 1
    cache.check()


@pytest.mark.parametrize("chunk", [256, 1])
def test_a_record_of_two_copies_marked_at_once_frees_both(server, chunk):
    srv, c = server
    cache = srv.app.cache
    two_storages(srv, c)
    write(c, [1], "b")
    (first, _), = storages_of(cache, 1)
    c.call("disable_storage", {"storage_unique_name": first})
    write(c, [1], "b")
    c.call("enable_storage", {"storage_unique_name": first})
    assert len(storages_of(cache, 1)) == 2
    c.call("remove_cache", {"instance_id": "b", "block_keys": [1]})
    found = entries(cache)
    assert [f[9] for f in found] == [2, 2] and found[0][8] == found[1][8] is not None
    cache.deleter.chunk = chunk  # 1: the entries come in two chunks, neither has the whole record
    assert free_all(cache) == 4
    assert storages_of(cache, 1) == [] and cache.usage("h")["bytes"] == 0
    assert cache.being_freed.snapshot() == {}
    cache.check()


def test_entries_one_chunk_at_a_time_still_free_everything(server):
    srv, c = server
    cache = srv.app.cache
    write(c, [1, 2, 3], "a")
    c.call("remove_cache", {"instance_id": "a", "block_keys": [1, 2, 3]})
    cache.deleter.chunk = 1
    assert free_all(cache) == 6
    assert entries(cache) == [] and cache.usage("g")["bytes"] == 0
    cache.check()


@pytest.mark.parametrize("fields", [6, 4])
def test_old_format_entries_are_freed_the_old_way(server, fields):
    srv, c = server
    write(c, [1, 2], "a")
    cache = srv.app.cache
    c.call("remove_cache", {"instance_id": "a", "block_keys": [1, 2]})
    with cache.store.write() as txn:  # as a data dir written before entries carried the record
        for entry, value in list(txn.scan(DELETES)):
            txn.put(DELETES, entry, msgpack.packb(msgpack.unpackb(value)[:fields]))
    cache.check()
    assert free_all(cache) == 4
    assert stored(cache, 1) is None and stored(cache, 2) is None
    assert cache.usage("g")["bytes"] == 0 and cache.being_freed.snapshot() == {}
    cache.check()


def test_old_format_entries_of_a_closed_data_dir_run_after_restart(tmp_path):
    data = str(tmp_path / "data")
    overrides = {"reclaim": {"enabled": False}, "cache": {"delete_poll_ms": 3_600_000}}
    with serve_in_thread(data_dir=data, overrides=overrides) as srv, srv.client() as c:
        add_group(c, "g", ["default-file"], delay_ms=GRACE_S * 1000)
        register(c, "a", group="g")
        write(c, [1, 2, 3], "a")
        c.call("remove_cache", {"instance_id": "a", "block_keys": [1, 2]})
        cache = srv.app.cache
        with cache.store.write() as txn:
            for entry, value in list(txn.scan(DELETES)):
                txn.put(DELETES, entry, msgpack.packb(msgpack.unpackb(value)[:6]))
    assert os.path.isdir(data)
    with serve_in_thread(data_dir=data, overrides=overrides) as srv:
        cache = srv.app.cache
        assert cache.being_freed.snapshot() == {("g", "file"): 2 * BLOCK}
        assert free_all(cache) == 4
        assert stored(cache, 1) is None and stored(cache, 3) is not None
        assert cache.usage("g")["bytes"] == BLOCK and cache.being_freed.snapshot() == {}
        cache.check()


def test_an_entry_never_drops_a_record_other_than_the_one_it_marked(server):
    srv, c = server
    cache = srv.app.cache
    write(c, [1, 2], "a")
    c.call("remove_cache", {"instance_id": "a", "block_keys": [1]})
    before = stored(cache, 2)
    assert before is not None
    with cache.store.write() as txn:  # the entry now names block 2, whose bytes are not the marked ones
        entry, value = next(iter(txn.scan(DELETES)))
        fields = msgpack.unpackb(value)
        assert fields[8] is not None
        fields[2] = 2
        txn.put(DELETES, entry, msgpack.packb(fields))
    assert free_all(cache) == 0  # block 2 is serving: nothing of it is freed
    assert stored(cache, 2) == before and entries(cache) == []


def _record(locs: list[Any]) -> Any:
    from kvcm.cache.record_codec import Record

    return Record(12, 1_700_000_000.1, 1_700_000_000.2, locs, 777)


def _loc(loc_id: str, status: int, uri_tail: str = "1") -> Any:
    from kvcm.cache.record_codec import new_location

    loc = new_location(loc_id, status, "default-file", "file",
                       [("k", f"file://default-file/a/b_{uri_tail}.bin?off=0&size=1024"),
                        ("v", f"file://default-file/a/b_{uri_tail}.bin?off=1024&size=1024")], BLOCK, 1_700_000_000.123)
    loc.written = 1_700_000_000.5 if status == 3 else 0.0
    return loc


def test_marking_a_sole_copy_without_decoding_gives_the_bytes_encode_gives():
    from kvcm.cache.record_codec import Status, decode, encode, mark_sole

    for tail in ("1", "77", "123456789"):
        value = encode(_record([_loc("abcdefgh", Status.SERVING, tail)]))
        hit = mark_sole(value, 1_700_000_003.4567)
        assert hit is not None
        new, loc, run = hit
        record = decode(value)
        record.locs[0].status = Status.DELETING
        record.updated = 1_700_000_003.4567
        assert new == encode(record) and decode(new).locs == [loc] and run == 777
    # Anything else is left to the decoding path.
    assert mark_sole(encode(_record([_loc("a", Status.WRITING)])), 1.0) is None
    assert mark_sole(encode(_record([_loc("a", Status.SERVING), _loc("b", Status.DELETING, "2")])), 1.0) is None


def test_marking_sole_copies_tells_the_listeners_and_counts_as_before(server):
    from kvcm.cache.listeners import CacheListener

    srv, c = server
    cache = srv.app.cache
    heard: list[tuple[str, list[int]]] = []

    class Removed(CacheListener):
        def on_removed(self, instance_id: str, keys: list[int]) -> None:
            heard.append((instance_id, sorted(keys)))

    cache.add_listener(Removed())
    write(c, [1, 2, 3], "a")
    assert c.call("remove_cache", {"instance_id": "a", "block_keys": [1, 3, 9]})["removed"] == 2
    assert heard == [("a", [1, 3])]
    assert cache.being_freed.snapshot() == {("g", "file"): 2 * BLOCK}
    assert cache.usage("g")["bytes"] == 3 * BLOCK  # counted until the deleter frees them
    cache.check()
    free_all(cache)
    assert cache.usage("g")["bytes"] == BLOCK and cache.being_freed.snapshot() == {}
    cache.check()
