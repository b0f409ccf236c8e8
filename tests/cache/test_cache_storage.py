"""Write-target selection, quotas, unavailable storages, multi-copy reads, usage and restarts
(Tair KVCM's rules, and its estimate and restart weaknesses fixed), over ZMQ against a real server."""

from __future__ import annotations

import json

import msgpack
import pytest
import zmq

from kvcm.testing import serve_in_thread
from tests.helpers import (
    add_file_storage,
    add_group,
    add_shm_storage,
    error_code,
    finish,
    locate,
    register,
    remove_shm,
    shm_prefix,
    start,
    wait_for,
    write,
)

pytestmark = pytest.mark.both_stores

FAST = {"cache": {"session_check_ms": 50, "delete_poll_ms": 20}}


@pytest.fixture
def shm():
    prefix = shm_prefix()
    yield prefix
    remove_shm(prefix)


@pytest.fixture
def two_tiers(tmp_path, shm):
    """A server with a file storage and a shm storage, group ``tiers`` = [shm, file]."""
    with serve_in_thread(overrides=FAST) as srv, srv.client() as c:
        add_file_storage(c, "disk", tmp_path / "disk")
        add_shm_storage(c, "mem", shm)
        yield srv, c


def _types(locations):
    return [x["type"] for x in locations]


def test_first_usable_candidate_takes_writes(two_tiers):
    srv, c = two_tiers
    add_group(c, "tiers", ["mem", "disk"])
    register(c, "a", group="tiers")
    assert _types(write(c, [1], "a")["locations"]) == ["shm"]
    c.call("disable_storage", {"storage_unique_name": "mem"})
    assert _types(write(c, [2], "a")["locations"]) == ["file"]
    # reads skip copies on the disabled storage: key 1 lives on shm only
    assert locate(c, [1], instance="a") == []
    assert len(locate(c, [2], instance="a")) == 1
    # and a write re-creates key 1 on the next storage, as a second copy
    assert _types(write(c, [1], "a")["locations"]) == ["file"]
    c.call("enable_storage", {"storage_unique_name": "mem"})
    meta = c.call("get_cache_meta", {"instance_id": "a", "block_keys": [1], "detail_level": 1})["metas"][0]
    assert meta["location_count"] == 2
    # with both usable, the candidate order decides which copy a reader gets: shm first
    assert _types(locate(c, [1, 2], instance="a")) == ["shm", "file"]
    srv.app.cache.check()


def test_no_usable_storage(two_tiers):
    _, c = two_tiers
    add_group(c, "tiers", ["mem", "disk"])
    register(c, "a", group="tiers")
    for name in ("mem", "disk"):
        c.call("disable_storage", {"storage_unique_name": name})
    assert error_code(start, c, [1], "a") == "NO_STORAGE_AVAILABLE"


def test_unavailable_by_health_probe_is_skipped(two_tiers):
    srv, c = two_tiers
    add_group(c, "tiers", ["mem", "disk"])
    register(c, "a", group="tiers")
    srv.app.registry.set_storage_available("mem", False)  # what the health thread does
    assert _types(write(c, [1], "a")["locations"]) == ["file"]
    srv.app.registry.set_storage_available("mem", True)
    assert _types(write(c, [2], "a")["locations"]) == ["shm"]


def test_group_quota_is_a_hard_limit(two_tiers):
    """Without in-line eviction (its own tests: test_inline_eviction.py) a full group refuses."""
    srv, c = two_tiers
    srv.app.cache.set_room_maker(None)
    add_group(c, "small", ["disk"], capacity=3 * 2048)
    register(c, "a", group="small")
    write(c, [1, 2], "a")
    assert error_code(start, c, [3, 4], "a") == "QUOTA_EXCEEDED"  # 4 blocks > 3 blocks of quota
    session = start(c, [3], "a")  # exactly full is allowed
    assert error_code(start, c, [4], "a") == "QUOTA_EXCEEDED"  # writing blocks count too
    finish(c, session, {"offset": 0}, instance="a")  # failed: freed by the deleter
    wait_for(lambda: srv.app.cache.usage("small")["keys"] == 2)
    write(c, [4], "a")
    assert srv.app.cache.usage("small")["bytes"] == 3 * 2048


def test_type_quota_falls_over_to_next_candidate_type(two_tiers):
    srv, c = two_tiers
    add_group(c, "typed", ["mem", "disk"], per_type={"shm": 2 * 2048})
    register(c, "a", group="typed")
    assert _types(write(c, [1, 2], "a")["locations"]) == ["shm", "shm"]
    assert _types(write(c, [3], "a")["locations"]) == ["file"]
    usage = srv.app.cache.usage("typed")
    assert usage["by_type"] == {"shm": {"bytes": 4096, "keys": 2}, "file": {"bytes": 2048, "keys": 1}}
    assert usage["by_instance"]["a"]["bytes"] == 6144


def test_type_quota_without_fallback_is_a_clear_error(two_tiers):
    two_tiers[0].app.cache.set_room_maker(None)  # a hard limit without in-line eviction
    _, c = two_tiers
    add_group(c, "shmonly", ["mem"], per_type={"shm": 2048})
    register(c, "a", group="shmonly")
    write(c, [1], "a")
    assert error_code(start, c, [2], "a") == "QUOTA_EXCEEDED"


def test_usage_sessions_and_deletes_survive_restart(tmp_path):
    data = str(tmp_path / "data")
    with serve_in_thread(data_dir=data, overrides=FAST) as srv, srv.client() as c:
        add_group(c, "slow", ["default-file"], delay_ms=1500)
        register(c, "a", group="slow")
        write(c, [1, 2, 3], "a")
        pending = start(c, [4, 5], "a", write_timeout_seconds=60)
        c.call("remove_cache", {"instance_id": "a", "block_keys": [3]})
        before = srv.app.cache.usage("slow")
    with serve_in_thread(data_dir=data, overrides=FAST) as srv, srv.client() as c:
        assert srv.app.cache.usage("slow") == before  # persisted, not recomputed
        assert srv.app.cache.recount() == srv.app.cache.usage_book.snapshot()
        finish(c, pending, instance="a")  # the session survived the restart
        assert len(locate(c, [1, 2], instance="a")) == 2 and len(locate(c, [4, 5], instance="a")) == 2
        # the delete pending at shutdown is finished after the restart
        wait_for(lambda: srv.app.cache.usage("slow")["keys"] == 4)
        assert srv.app.cache.usage("slow")["keys"] == 4
        srv.app.cache.check()


def test_expired_session_after_restart_is_cleaned_up(tmp_path):
    data = str(tmp_path / "data")
    with serve_in_thread(data_dir=data, overrides=FAST) as srv, srv.client() as c:
        register(c, "a")
        session = start(c, [1, 2], "a", write_timeout_seconds=0.5)
    with serve_in_thread(data_dir=data, overrides=FAST) as srv, srv.client() as c:
        wait_for(lambda: srv.app.cache.sessions.was_expired(session["write_session_id"]))
        assert error_code(finish, c, session, instance="a") == "WRITE_SESSION_EXPIRED"
        wait_for(lambda: srv.app.cache.usage("default")["keys"] == 0)
        srv.app.cache.check()


def test_removed_instance_is_purged(two_tiers):
    srv, c = two_tiers
    add_group(c, "g", ["disk"])
    register(c, "gone", group="g")
    write(c, [1, 2], "gone")
    c.call("remove_instance", {"instance_id": "gone"})
    wait_for(lambda: srv.app.cache.usage("g")["keys"] == 0)
    assert srv.app.cache.usage("g")["keys"] == 0


def test_storage_space_is_freed_after_delete(two_tiers):
    srv, c = two_tiers
    add_group(c, "g", ["disk", "mem"])
    register(c, "a", group="g")
    write(c, [1, 2], "a")
    disk = srv.app.storages.get("disk")
    assert disk.usage()["bytes_used"] == 4096
    c.call("remove_cache", {"instance_id": "a", "block_keys": [1, 2]})
    wait_for(lambda: srv.app.cache.usage("g")["keys"] == 0)
    assert disk.usage()["bytes_used"] == 0


def test_failed_request_rolls_back_and_releases_space(tmp_path, shm):
    """Tair left orphan WRITING records and leaked storage when a batch failed half-way."""
    with serve_in_thread(overrides=FAST) as srv, srv.client() as c:
        add_shm_storage(c, "tiny", shm, segment_size=1024)  # smaller than one 2048-byte spec
        add_group(c, "g", ["tiny"])
        register(c, "a", group="g", specs=[{"name": "tp0", "size": 512}, {"name": "tp1", "size": 2048}])
        before = srv.app.storages.get("tiny").usage()["bytes_used"]
        assert error_code(start, c, [1, 2], "a") in ("INVALID_ARGUMENT", "CAPACITY_EXHAUSTED")  # tp1 cannot be placed
        assert srv.app.storages.get("tiny").usage()["bytes_used"] == before  # tp0's slots given back
        assert srv.app.cache.usage("g")["keys"] == 0
        meta = c.call("get_cache_meta", {"instance_id": "a", "block_keys": [1, 2]})["metas"]
        assert [m["status"] for m in meta] == ["not_found", "not_found"]
        srv.app.cache.check()


def _start_bursts(endpoint, rounds):
    """Pipelined bursts of 32 ``start_write_cache`` of 64 new keys each (the server drains them
    into few groups) until a burst has errors; returns (acknowledged requests, error names)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    ok, failed, key = 0, [], 1
    try:
        for _ in range(rounds):
            for msgid in range(32):
                request = {"instance_id": "a", "block_keys": list(range(key, key + 64))}
                sock.send(msgpack.packb([0, msgid, "start_write_cache", [request]]))
                key += 64
            for _ in range(32):
                reply = msgpack.unpackb(sock.recv())
                if reply[2] is None:
                    ok += 1
                else:
                    failed.append(reply[2]["name"])
            if failed:
                break
    finally:
        sock.close(0)
    return ok, failed


@pytest.mark.lmdb_only("grows the LMDB map")
def test_full_map_that_can_grow_fails_no_request(tmp_path):
    """A request too big for the map's headroom while the map is under its growth threshold:
    the map grows and the batch runs again, instead of failing with CAPACITY_EXHAUSTED."""
    # One request of 3000 keys is more than the default per-request budget allows: raised here.
    overrides = {**FAST, "store": {"map_size": 1 << 18, "map_size_max": 256 << 20},
                 "server": {"turn_budget_ms": 60_000}}
    with serve_in_thread(overrides=overrides) as srv, srv.client() as c:
        add_file_storage(c, "disk", tmp_path / "disk")
        add_group(c, "g", ["disk"])
        register(c, "a", group="g")
        session = start(c, list(range(1, 3001)), "a")  # about 400 kB of records
        assert len(session["locations"]) == 3000
        assert srv.app.store.stats()["map_size"] == 2 << 18
        assert srv.app.storages.get("disk").usage()["slots_used"] == 3000 * 2  # no leftovers of the failed run
        finish(c, session, instance="a")
        assert len(locate(c, list(range(1, 3001)), instance="a")) == 3000
        srv.app.cache.check()


@pytest.mark.lmdb_only("fills the LMDB map to make the group commit fail")
def test_group_that_cannot_commit_gives_its_storage_space_back(tmp_path):
    """Requests that succeeded inside a group whose shared commit then failed (here: the LMDB map
    is full and may not grow) are answered with the error, their storage space is released, and
    the event log records only acknowledged writes."""
    log_path = tmp_path / "events.jsonl"
    overrides = {**FAST, "store": {"map_size": 1 << 20, "map_size_max": 1 << 20},
                 "publisher": {"event_log": str(log_path)}}
    with serve_in_thread(overrides=overrides) as srv, srv.client() as c:
        add_file_storage(c, "disk", tmp_path / "disk")
        add_group(c, "g", ["disk"])
        register(c, "a", group="g")
        ok, failed = _start_bursts(srv.endpoint, rounds=100)
        assert failed and set(failed) == {"CAPACITY_EXHAUSTED"}
        # only the acknowledged requests hold space: 64 blocks x 2 specs each
        assert srv.app.storages.get("disk").usage()["slots_used"] == ok * 64 * 2
        assert srv.app.cache.usage("g")["keys"] == ok * 64
    started = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [e["type"] for e in started] == ["StartWriteCache"] * ok
