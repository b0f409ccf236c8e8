"""Soft pins end to end: ``pin_cache`` / ``unpin_cache`` over a real server (validation, caps,
expiry, persistence across a restart, instance removal), the event log's pin records read back by
the optimizer, and the replay keeping a pinned block while its pin lasts."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from typing import Any

import msgpack
import pytest
import zmq

from kvcm.backends.metastore.base import from_i64, from_u64, i64, u64
from kvcm.backends.metastore.memory import MemoryStore
from kvcm.cache.meta_index import namespace
from kvcm.cache.pins import DB as PINS
from kvcm.cache.pins import Pins
from kvcm.errors import KvcmError
from kvcm.node.stores import open_store
from kvcm.optimizer.replay import replay
from kvcm.optimizer.spec import Capacity, GroupSpec, ReplaySpec, TierSpec
from kvcm.optimizer.trace import Record
from kvcm.optimizer.trace_readers import dump_schema, read_trace
from kvcm.proto import wire
from kvcm.testing import make_test_config, serve_in_thread
from tests.helpers import TIME_FACTOR, error_code, locate, register, wait_for, write

pytestmark = pytest.mark.both_stores

CAP = 8
OVERRIDES: dict[str, dict[str, Any]] = {
    "cache": {"session_check_ms": 50, "max_pins_per_instance": CAP, "max_pin_ttl_s": 3600.0},
    "server": {"max_keys": 64},
}


def refusal(c, method: str, params: dict[str, Any]) -> KvcmError:
    with pytest.raises(KvcmError) as info:
        c.call(method, params, retry=False)
    return info.value


def pin(c, instance: str, keys: list[int], ttl: float = 600.0) -> dict[str, Any]:
    return c.call("pin_cache", {"instance_id": instance, "block_keys": keys, "ttl_seconds": ttl}, retry=False)


def unpin(c, instance: str, keys: list[int]) -> dict[str, Any]:
    return c.call("unpin_cache", {"instance_id": instance, "block_keys": keys}, retry=False)


def stored_pins(store, instance: str) -> dict[int, int]:
    """``{key: expiry ms}`` of the instance's rows in the pins database (not the mirror)."""
    ns = namespace(instance)
    with store.read() as view:
        return {from_i64(k[8:]): from_u64(v) for k, v in view.scan(PINS, prefix=ns)}


def deletes_done(srv) -> bool:
    """No delete left to do: no purge of a removed instance queued for the deleter thread, and
    no delete entry or queued free. A queued purge counts: until it commits, its marks are in no
    delete entry, and it runs a read-modify-write of the block index on the deleter thread
    (``check()`` asserts nothing writes), whenever that thread next wakes up. The purge queue is
    read first: a purge is popped from it only after its marks committed, so the entries are
    counted by the second read."""
    cache = srv.app.cache
    return not cache.purges and cache.deleter.pending() == 0


def check(srv) -> None:
    """The data plane's invariants, pins included (mirror == store), on a quiet server."""
    assert wait_for(lambda: deletes_done(srv), timeout=30)
    srv.app.cache.check()


@pytest.fixture(scope="module")
def server(kvcm_store):
    with serve_in_thread(overrides=OVERRIDES) as srv:
        yield srv


@pytest.fixture
def c(server):
    with server.client() as client:
        yield client


_n = iter(range(10_000))


@pytest.fixture
def inst(c):
    name = f"pinned{next(_n)}"
    register(c, name)
    return name


# -- round trips ----------------------------------------------------------------------------------


def test_pin_and_unpin_round_trip(server, c, inst):
    pins = server.app.cache.pins
    before = time.time()
    reply = pin(c, inst, [5, -7, 5, 9], ttl=120.0)  # a repeated key counts once; keys are signed
    assert reply["pinned"] == 3
    assert before + 120.0 - 0.01 <= reply["expires_at"] <= time.time() + 120.0 + 0.01
    assert pins.pinned(inst, time.time()) == {5, -7, 9}
    assert pins.is_pinned(inst, -7, time.time()) and not pins.is_pinned(inst, 8, time.time())
    assert not pins.is_pinned(inst, 5, reply["expires_at"])  # ends at its expiry
    assert stored_pins(server.app.store, inst) == {k: round(reply["expires_at"] * 1000) for k in (5, -7, 9)}
    assert unpin(c, inst, [5, 6, 5]) == {"unpinned": 1}  # 6 was never pinned
    assert unpin(c, inst, [5]) == {"unpinned": 0}
    assert pins.pinned(inst, time.time()) == {-7, 9}
    assert set(stored_pins(server.app.store, inst)) == {-7, 9}
    check(server)


def test_repinning_sets_the_new_expiry_earlier_or_later(server, c, inst):
    pins = server.app.cache.pins
    long = pin(c, inst, [1], ttl=600.0)["expires_at"]
    short = pin(c, inst, [1, 2], ttl=60.0)["expires_at"]
    assert short < long and pins.expiry(inst, 1) == short == pins.expiry(inst, 2)
    longer = pin(c, inst, [2], ttl=900.0)["expires_at"]
    assert pins.expiry(inst, 2) == longer and pins.expiry(inst, 1) == short
    assert pins.count(inst) == 2


def test_a_key_may_be_pinned_before_it_is_written(server, c, inst):
    pin(c, inst, [41, 42])
    assert len(locate(c, [41, 42], instance=inst)) == 0
    write(c, [41, 42], inst)  # the pin was there first and stays
    assert len(locate(c, [41, 42], instance=inst)) == 2
    assert server.app.cache.pins.pinned(inst, time.time()) == {41, 42}


def test_a_pin_does_not_stop_remove_cache(server, c, inst):
    write(c, [3], inst)
    pin(c, inst, [3])
    assert c.call("remove_cache", {"instance_id": inst, "block_keys": [3]})["removed"] == 1
    assert locate(c, [3], instance=inst) == []
    assert server.app.cache.pins.is_pinned(inst, 3, time.time())  # names the key, not the copy


# -- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("params", "words"), [
    ({"block_keys": [1], "ttl_seconds": 5, "ttl": 5}, "pin_cache: unknown field ttl"),
    ({"block_keys": [1], "ttl_second": 5}, "did you mean ttl_seconds?"),
    ({"block_keys": [1], "ttl_seconds": 0}, "ttl_seconds"),
    ({"block_keys": [1], "ttl_seconds": -1.5}, "ttl_seconds"),
    ({"block_keys": [1], "ttl_seconds": float("nan")}, "ttl_seconds"),
    ({"block_keys": [1], "ttl_seconds": float("inf")}, "must be a finite number"),
    ({"block_keys": [1], "ttl_seconds": 3600.5}, "over the limit of 3600 (cache.max_pin_ttl_s)"),
    ({"block_keys": [1], "ttl_seconds": "10"}, "ttl_seconds"),
    ({"block_keys": [1]}, "ttl_seconds"),
    ({"block_keys": [], "ttl_seconds": 5}, "block_keys"),
    ({"block_keys": [1 << 63], "ttl_seconds": 5}, "block_keys"),
    ({"ttl_seconds": 5}, "block_keys"),
])
def test_pin_cache_refuses_bad_requests(server, c, inst, params, words):
    error = refusal(c, "pin_cache", {"instance_id": inst, **params})
    assert error.code.name == "INVALID_ARGUMENT" and words in error.message, error.message
    assert server.app.cache.pins.count(inst) == 0


@pytest.mark.parametrize(("params", "words"), [
    ({"block_keys": [1], "ttl_seconds": 5}, "unpin_cache: unknown field ttl_seconds"),
    ({"block_key": [1]}, "did you mean block_keys?"),
    ({"block_keys": []}, "block_keys"),
])
def test_unpin_cache_refuses_bad_requests(server, c, inst, params, words):
    pin(c, inst, [1])
    error = refusal(c, "unpin_cache", {"instance_id": inst, **params})
    assert error.code.name == "INVALID_ARGUMENT" and words in error.message, error.message
    assert server.app.cache.pins.count(inst) == 1


def test_too_many_keys_and_unknown_instances(server, c, inst):
    assert refusal(c, "pin_cache", {"instance_id": inst, "block_keys": list(range(65)),
                                    "ttl_seconds": 5}).code.name == "TOO_MANY_KEYS"  # server.max_keys = 64
    assert refusal(c, "unpin_cache", {"instance_id": inst, "block_keys": list(range(65))}).code.name == "TOO_MANY_KEYS"
    assert error_code(pin, c, "nobody", [1]) == "INSTANCE_NOT_EXIST"
    assert error_code(unpin, c, "nobody", [1]) == "INSTANCE_NOT_EXIST"
    assert server.app.cache.pins.count("nobody") == 0


def test_the_per_instance_cap(server, c, inst):
    pins = server.app.cache.pins
    assert pin(c, inst, list(range(CAP)))["pinned"] == CAP
    error = refusal(c, "pin_cache", {"instance_id": inst, "block_keys": [100], "ttl_seconds": 5})
    assert error.code.name == "QUOTA_EXCEEDED"
    assert f"would hold {CAP + 1} pins; the limit is {CAP} (cache.max_pins_per_instance)" in error.message
    assert pin(c, inst, [0, 1], ttl=30)["pinned"] == 2  # re-pinning held keys adds none
    assert refusal(c, "pin_cache", {"instance_id": inst, "block_keys": [0, 100, 101],
                                    "ttl_seconds": 5}).code.name == "QUOTA_EXCEEDED"
    assert not pins.is_pinned(inst, 100, time.time()) and pins.expiry(inst, 0) is not None  # refused whole
    assert pins.count(inst) == CAP and len(stored_pins(server.app.store, inst)) == CAP
    unpin(c, inst, [7])
    assert pin(c, inst, [100])["pinned"] == 1
    other = f"{inst}-other"
    register(c, other)
    assert pin(c, other, list(range(CAP)))["pinned"] == CAP  # the cap is per instance
    check(server)


def test_requests_of_one_batch_never_overshoot_the_cap(server, inst):
    """Two pins sent back to back often share a group commit: the second must see the first."""
    pins = server.app.cache.pins
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        for attempt in range(4):
            keys = [[attempt * 100 + i for i in range(5)], [attempt * 100 + 50 + i for i in range(5)]]
            for msgid, batch in enumerate(keys):
                sock.send(msgpack.packb([0, msgid, "pin_cache", [{"instance_id": inst, "block_keys": batch,
                                                                   "ttl_seconds": 60}]]))
            errors = []
            for _ in keys:
                assert sock.poll(10_000), "no reply"
                _, err, _ = wire.parse_response(sock.recv())
                errors.append(None if err is None else err["name"])
            assert sorted(map(str, errors)) == ["None", "QUOTA_EXCEEDED"], errors
            assert pins.count(inst) == 5 and len(stored_pins(server.app.store, inst)) == 5
            unpin_all = list(pins.pinned(inst, time.time()))
            with server.client() as c:
                assert unpin(c, inst, unpin_all)["unpinned"] == 5
        check(server)
    finally:
        sock.close()


# -- expiry ---------------------------------------------------------------------------------------


def test_pins_expire_and_lapsed_pins_free_the_cap(server, c, inst):
    pins = server.app.cache.pins
    expires = pin(c, inst, [1, 2], ttl=0.3)["expires_at"]
    pin(c, inst, [3])
    # Asked at given times, not at time.time(): on a loaded machine 0.3 s may be gone already.
    assert pins.is_pinned(inst, 1, expires - 0.01) or not pins.count(inst)  # unless already swept
    assert not pins.is_pinned(inst, 1, expires + 0.001)
    # The pin-expiry timer deletes the lapsed rows and drops them from the mirror.
    assert wait_for(lambda: set(stored_pins(server.app.store, inst)) == {3})
    assert pins.count(inst) == 1 and pins.pinned(inst, time.time()) == {3}
    assert pin(c, inst, list(range(10, 10 + CAP - 1)))["pinned"] == CAP - 1  # 3 + 7 = the cap


def test_a_lapsed_pin_not_swept_yet_does_not_count(c):
    """Lazily, too: a pin request drops the instance's lapsed pins before counting (a unit of
    :class:`Pins` over a real store, with the clock in the test's hands)."""
    store = MemoryStore()
    pins = Pins(max_per_instance=2)
    with store.write() as txn:
        pins.pin(txn, "i", [1, 2], 10.0, now=100.0)
    with store.write() as txn:
        assert pins.pin(txn, "i", [3, 4], 10.0, now=110.0) == (2, 120.0)
    assert pins.pinned("i", 110.0) == {3, 4} and pins.count("i") == 2
    assert set(stored_pins(store, "i")) == {3, 4}


# -- persistence and instance removal -------------------------------------------------------------


def test_pins_survive_a_restart_on_the_same_data_dir():
    data = tempfile.mkdtemp(prefix="kvcm-pins-", dir="/tmp")
    try:
        with serve_in_thread(data_dir=data, overrides=OVERRIDES) as srv, srv.client() as c:
            register(c, "keep")
            kept = pin(c, "keep", [1, 2, -3], ttl=600)["expires_at"]
            pin(c, "keep", [4], ttl=0.2)
            unpin(c, "keep", [2])
        time.sleep(0.3 * TIME_FACTOR)  # the short pin lapses while the server is down (no server to poll)
        with serve_in_thread(data_dir=data, overrides=OVERRIDES) as srv, srv.client() as c:
            pins = srv.app.cache.pins
            assert pins.pinned("keep", time.time()) == {1, -3}
            assert pins.expiry("keep", 1) == kept == pins.expiry("keep", -3)
            assert wait_for(lambda: set(stored_pins(srv.app.store, "keep")) == {1, -3})  # swept after start
            assert unpin(c, "keep", [1, 4]) == {"unpinned": 1}
            check(srv)
    finally:
        shutil.rmtree(data, ignore_errors=True)


def test_removing_an_instance_removes_its_pins(server, c, inst):
    pins = server.app.cache.pins
    pin(c, inst, [1, 2, 3])
    write(c, [1], inst)
    c.call("remove_instance", {"instance_id": inst})
    assert not pins.is_pinned(inst, 1, time.time()) and pins.count(inst) == 0  # at once
    assert wait_for(lambda: stored_pins(server.app.store, inst) == {}, timeout=30)  # rows: at the next sweep
    register(c, inst)
    assert pins.count(inst) == 0
    # The old instance's purge runs on the deleter thread at its next wake-up; until it has, the
    # new instance's data plane answers SERVICE_NOT_READY (tests/control/test_reregistration.py).
    assert wait_for(lambda: not server.app.cache.purges, timeout=30)
    assert pin(c, inst, list(range(CAP)))["pinned"] == CAP  # nothing of the old instance counts
    # check() waits for the frees of the purge's deletes too (deletes_done), which happen inside
    # the deleter's transaction: a check that reads between that free and the commit sees a
    # deleting copy the storage no longer reserves.
    check(server)


@pytest.mark.store_independent
def test_a_reregistered_id_does_not_inherit_pins_before_the_sweep():
    """The same id registered again before the sweep ran: its first pin drops the old rows."""
    store = MemoryStore()
    pins = Pins(max_per_instance=3)
    with store.write() as txn:
        pins.pin(txn, "i", [1, 2, 3], 60.0, now=0.0)
    pins.forget("i")
    with store.write() as txn:
        assert pins.pin(txn, "i", [7, 8, 9], 60.0, now=1.0) == (3, 61.0)
    assert pins.pinned("i", 1.0) == {7, 8, 9} and set(stored_pins(store, "i")) == {7, 8, 9}
    with store.write() as txn:
        assert pins.expire(txn, 2.0) == 0  # nothing left to clean up
    assert pins.pinned("i", 2.0) == {7, 8, 9}


@pytest.mark.store_independent
def test_two_pins_of_one_group_commit_after_a_reregistration_both_stay():
    """The first pin of the batch clears the old rows; the second must not clear the first's."""
    store = MemoryStore()
    pins = Pins(max_per_instance=10)
    with store.write() as txn:
        pins.pin(txn, "i", [1, 2], 60.0, now=0.0)
    pins.forget("i")
    with store.group():
        with store.write() as txn:
            pins.pin(txn, "i", [3], 60.0, now=1.0)
        with store.write() as txn:
            pins.pin(txn, "i", [4], 60.0, now=1.0)
    assert set(stored_pins(store, "i")) == {3, 4} and pins.pinned("i", 1.0) == {3, 4}
    with store.read() as view:
        pins.check(view, ["i"])


def test_pins_of_an_instance_removed_while_down_are_dropped_at_start():
    data = tempfile.mkdtemp(prefix="kvcm-pins-", dir="/tmp")
    try:
        with serve_in_thread(data_dir=data, overrides=OVERRIDES) as srv, srv.client() as c:
            register(c, "alive")
            pin(c, "alive", [1])
        # Rows of an id the registry does not know, as a removal whose clean-up never ran leaves,
        # written to the store the servers use.
        store = open_store(make_test_config(data, "ipc://unused"))
        with store.write() as txn:
            txn.put(PINS, namespace("gone") + i64(5), u64(int((time.time() + 600) * 1000)))
        store.close()
        with serve_in_thread(data_dir=data, overrides=OVERRIDES) as srv:
            assert stored_pins(srv.app.store, "gone") == {}
            assert srv.app.cache.pins.pinned("alive", time.time()) == {1}
    finally:
        shutil.rmtree(data, ignore_errors=True)


# -- the event log and the optimizer --------------------------------------------------------------


def test_pins_are_logged_and_the_optimizer_reads_them_back(tmp_path):
    log = tmp_path / "events.jsonl"
    with serve_in_thread(overrides={**OVERRIDES, "publisher": {"event_log": str(log)}}) as srv, srv.client() as c:
        register(c, "i")
        expires = pin(c, "i", [11, 12], ttl=30.0)["expires_at"]
        unpin(c, "i", [12])
        refusal(c, "pin_cache", {"instance_id": "i", "block_keys": list(range(CAP + 1)), "ttl_seconds": 1})
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    pins = [x for x in lines if x["type"] in ("PinCache", "UnpinCache")]
    assert [x["type"] for x in pins] == ["PinCache", "UnpinCache"]  # a refused pin is not logged
    assert pins[0]["block_keys"] == [11, 12] and pins[0]["ttl_seconds"] == 30.0
    assert pins[0]["expires_at_us"] == int(expires * 1e6) and pins[0]["source"] == "i"
    assert pins[1]["block_keys"] == [12]
    trace = read_trace(log, "kvcm_events")
    records = [r for r in trace if r.op in ("pin", "unpin")]
    assert [(r.op, r.keys, r.ttl) for r in records] == [("pin", [11, 12], 30.0), ("unpin", [12], 0.0)]
    assert trace.counts["pin_events"] == 1 and trace.counts["unpin_events"] == 1


@pytest.mark.store_independent
def test_kvcm_events_refuse_a_pin_without_a_ttl(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "x", "source": "i", "type": "PinCache", "trigger_time_us": 1,
                                "block_keys": [1], "ttl_seconds": 0}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: ttl_seconds must be a finite number > 0"):
        list(read_trace(path, "kvcm_events"))


@pytest.mark.store_independent
def test_pin_records_round_trip_through_kvcm_schema(tmp_path):
    records = [Record(0.0, "i", "pin", [1, 2], ttl=5.0), Record(1.0, "i", "unpin", [2])]
    trace = read_trace(_schema_file(tmp_path, records), "kvcm_schema")
    again = list(trace)
    assert [(r.op, r.keys, r.ttl) for r in again] == [("pin", [1, 2], 5.0), ("unpin", [2], 0.0)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ts": 0, "instance": "i", "op": "pin", "keys": [1]}\n')
    with pytest.raises(ValueError, match="a pin needs a finite ttl"):
        list(read_trace(bad, "kvcm_schema"))


def _schema_file(tmp_path, records: list[Record]) -> str:
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    out = str(tmp_path / "schema.jsonl")
    dump_schema(read_trace(src, "kvcm_schema"), out)
    return out


def _spec(capacity: int = 2, policy: str = "lru", **options: Any) -> ReplaySpec:
    tier = TierSpec(capacity=Capacity(capacity, "blocks"), policy=policy, policy_options=options)
    return ReplaySpec(groups=(GroupSpec(tiers=(tier,)),))


def _hits(records: list[Record], spec: ReplaySpec) -> list[int]:
    """External hit blocks after each read of ``records`` (replayed one by one)."""
    from kvcm.optimizer.replay import Replayer

    player = Replayer(spec, lambda _i: 16)
    out = []
    for rec in records:
        player.feed(rec)
        if rec.op == "read":
            out.append(player.result().instances["i"].external_hit_blocks)
    return out


def _story(pin_ttl: float | None) -> list[Record]:
    """Capacity two blocks (LRU). Key 1 is written first, so LRU evicts it when 3 arrives —
    unless it is pinned. After t=20 two new blocks push out the two older ones."""
    pinned = [] if pin_ttl is None else [Record(0.0, "i", "pin", [1], ttl=pin_ttl)]
    return [*pinned,
            Record(1.0, "i", "write", [1]), Record(2.0, "i", "write", [2]), Record(3.0, "i", "write", [3]),
            Record(4.0, "i", "read", [1]),
            Record(20.0, "i", "write", [4]), Record(21.0, "i", "write", [5]),
            Record(22.0, "i", "read", [1])]


@pytest.mark.store_independent
def test_replay_keeps_a_pinned_block_while_its_pin_lasts():
    assert _hits(_story(None), _spec()) == [0, 0]  # unpinned: evicted at t=3
    assert _hits(_story(10.0), _spec()) == [1, 1]  # pinned: hit at t=4; evictable after t=10: miss at t=22
    assert _hits(_story(100.0), _spec()) == [1, 2]  # still pinned at t=22: 4 and 3 went instead
    result = replay(_story(100.0), _spec())
    assert result.instances["i"].evicted_blocks == 3 and result.groups[0].tiers[0]["blocks"] == 2


@pytest.mark.store_independent
def test_replay_unpin_ends_the_protection():
    story = _story(100.0)
    story.insert(5, Record(10.0, "i", "unpin", [1]))
    assert _hits(story, _spec()) == [1, 1]


@pytest.mark.store_independent
def test_replay_with_every_block_pinned_keeps_them_all_over_the_limit():
    records = [Record(0.0, "i", "pin", [1, 2, 3], ttl=50.0)] + \
        [Record(1.0 + k, "i", "write", [k]) for k in (1, 2, 3)] + [Record(5.0, "i", "read", [1])]
    result = replay(records, _spec())
    assert result.instances["i"].evicted_blocks == 0 and result.groups[0].tiers[0]["blocks"] == 3


@pytest.mark.store_independent
def test_replay_a_pin_outlasts_a_policys_ttl():
    records = [Record(0.0, "i", "pin", [1], ttl=100.0), Record(1.0, "i", "write", [1]),
               Record(1.0, "i", "write", [2]), Record(50.0, "i", "read", [1]), Record(50.0, "i", "read", [2]),
               Record(120.0, "i", "read", [1])]
    assert _hits(records, _spec(capacity=10, policy="ttl", ttl_seconds=10.0)) == [1, 1, 1]


def test_the_servers_own_log_replays_with_the_pin(tmp_path):
    """Against a real server: a pinned block the replay's LRU would evict is still a hit."""
    log = tmp_path / "events.jsonl"
    with serve_in_thread(overrides={**OVERRIDES, "publisher": {"event_log": str(log)}}) as srv, srv.client() as c:
        register(c, "i")
        pin(c, "i", [1], ttl=600.0)
        for key in (1, 2, 3):
            write(c, [key], "i")
        locate(c, [1], instance="i")
    spec = _spec(capacity=2)
    assert replay(read_trace(log, "kvcm_events"), spec).instances["i"].external_hit_blocks == 1
    unpinned = [r for r in read_trace(log, "kvcm_events") if r.op != "pin"]
    assert replay(unpinned, spec).instances["i"].external_hit_blocks == 0


def test_pin_requests_are_costed():
    """4 µs per key and 2 per pin held: over a 0.1 ms turn budget, 30 keys are refused before any
    work, 20 fit."""
    overrides = {"cache": {"max_pins_per_instance": 64}, "server": {"turn_budget_ms": 0.1}}
    with serve_in_thread(overrides=overrides) as srv, srv.client() as c:
        register(c, "i")
        error = refusal(c, "pin_cache", {"instance_id": "i", "block_keys": list(range(30)), "ttl_seconds": 5})
        assert error.code.name == "TOO_LARGE" and "server.turn_budget_ms" in error.message, error.message
        assert srv.app.cache.pins.count("i") == 0
        assert pin(c, "i", list(range(20)))["pinned"] == 20
        assert refusal(c, "unpin_cache", {"instance_id": "i", "block_keys": list(range(30))}).code.name == "TOO_LARGE"
        # 2 µs per pin held: 16 keys (64 µs) fit alone, not with the 20 pins held (+40 µs).
        assert refusal(c, "unpin_cache", {"instance_id": "i", "block_keys": list(range(16))}).code.name == "TOO_LARGE"
        assert unpin(c, "i", list(range(10))) == {"unpinned": 10}
