"""Data-plane RPCs against a real server over ZMQ: one scenario per Tair test fact
(the block-key test vectors included) and per fixed weakness of Tair's that concerns the data plane."""

from __future__ import annotations

import itertools
import json
import time

import pytest

from kvcm.cache.keys import token_ids_to_block_keys
from kvcm.cache.listeners import CacheListener
from kvcm.errors import KvcmError
from kvcm.testing import serve_in_thread
from tests.helpers import (
    TIME_FACTOR,
    add_group,
    error_code,
    finish,
    locate,
    register,
    start,
    uris,
    wait_for,
    write,
)

pytestmark = pytest.mark.both_stores

_ids = itertools.count()


@pytest.fixture(scope="module")
def server(kvcm_store):
    with serve_in_thread(overrides={"cache": {"session_check_ms": 50, "delete_poll_ms": 20}}) as srv:
        with srv.client() as c:
            add_group(c, "g0", ["default-file"], delay_ms=0)
        yield srv


@pytest.fixture
def c(server):
    with server.client() as client:
        yield client


@pytest.fixture
def inst(c):
    """A fresh instance (group g0: deletes without delay) per test."""
    name = f"inst{next(_ids)}"
    register(c, name, group="g0")
    return name


def _check(server):
    wait_for(lambda: server.app.cache.deleter.pending() == 0)
    server.app.cache.check()


# -- block keys -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tokens", "bs", "expected"), [
    (list(range(1, 9)), 4, [455111481605203084, 6902853672176602142]),
    ([456], 1, [-7046029254386352675]),
    ([-1, 0, 2**63 - 1], 3, [-1198892853929587214]),
])
@pytest.mark.store_independent
def test_hash_vectors(tokens, bs, expected):
    assert token_ids_to_block_keys(tokens, bs) == expected


def test_token_ids_become_tair_keys_over_rpc(c):
    register(c, "tok", group="g0", block_size=4)
    session = start(c, instance="tok", tokens=list(range(1, 11)))  # 2 full blocks, 2 tokens ignored
    assert len(session["locations"]) == 2
    finish(c, session, instance="tok")
    assert len(locate(c, [455111481605203084, 6902853672176602142], instance="tok")) == 2
    assert len(locate(c, instance="tok", tokens=list(range(1, 9)))) == 2


def test_block_keys_win_over_token_ids(c, inst):
    write(c, [7, 8], inst)
    assert len(locate(c, [7, 8], instance=inst, tokens=list(range(1, 9)))) == 2


# -- get_cache_location -----------------------------------------------------------------------------


def test_writing_blocks_are_invisible_until_finished(c, inst):
    session = start(c, [1, 2, 3], inst)
    assert locate(c, [1, 2, 3], instance=inst) == []
    finish(c, session, instance=inst)
    assert locate(c, [1, 2, 3], instance=inst) == session["locations"]


def test_prefix_stops_at_first_missing_key(c, inst):
    write(c, [1, 2, 3], inst)
    assert len(locate(c, [1, 2, 4, 3], instance=inst)) == 2


def test_all_true_bool_mask_matches_nothing(c, inst):
    write(c, [1, 2, 3], inst)
    assert locate(c, [1, 2, 3], instance=inst, block_mask={"bool_masks": [True] * 3}) == []


def test_prefix_mask_compacts_keys(c, inst):
    written = write(c, [1, 2, 3], inst)["locations"]
    got = locate(c, [99, 2, 3], instance=inst, block_mask={"offset": 1})
    assert got == written[1:]
    got = locate(c, [1, 99, 3], instance=inst, block_mask={"bool_masks": {"values": [False, True, False]}})
    assert got == [written[0], written[2]]


def test_unknown_instance(c):
    assert error_code(locate, c, [1], instance="nobody") == "INSTANCE_NOT_EXIST"


def test_bad_query_type_and_mask(c, inst):
    assert error_code(locate, c, [1], query="qt_unspecified", instance=inst) == "INVALID_ARGUMENT"
    assert error_code(locate, c, [1, 2], instance=inst, block_mask={"offset": 3}) == "INVALID_ARGUMENT"
    assert error_code(locate, c, [1, 2], instance=inst, block_mask={"bool_masks": [True]}) == "INVALID_ARGUMENT"
    assert locate(c, [1], query="QT_PREFIX_MATCH", instance=inst) == []


def test_batch_get_fills_missing_and_honours_mask(c, inst):
    written = write(c, [1, 3], inst)["locations"]
    got = locate(c, [1, 2, 3], query="batch_get", instance=inst)
    assert got[0] == written[0] and got[2] == written[1]
    assert got[1] == {"type": "unspecified", "spec_size": 2,
                      "location_specs": [{"name": "tp0", "uri": ""}, {"name": "tp1", "uri": ""}]}
    masked = locate(c, [1, 2, 3], query="batch_get", instance=inst, block_mask={"offset": 1})
    assert masked[0]["location_specs"][0]["uri"] == "" and masked[2] == written[1]


def test_reverse_roll_sliding_window(c, inst):
    write(c, [1, 2, 4, 5, 6], inst)
    got = locate(c, [1, 2, 3, 4, 5, 6, 7], query="reverse_roll_sw_match", instance=inst, sw_size=2)
    assert len(got) == 7
    assert [bool(uris(x)[0]) for x in got] == [False, False, False, False, True, True, False]
    got = locate(c, [1, 2, 3, 4, 5, 6, 7], query="reverse_roll_sw_match", instance=inst, sw_size=3)
    assert [bool(uris(x)[0]) for x in got] == [False, False, False, True, True, True, False]
    got = locate(c, [1, 2, 3, 4], query="reverse_roll_sw_match", instance=inst, sw_size=3)
    assert not any(uris(x)[0] for x in got)
    # the mask: a masked key cannot be part of the window
    got = locate(c, [4, 5, 6], query="reverse_roll_sw_match", instance=inst, sw_size=2,
                 block_mask={"bool_masks": [False, False, True]})
    assert [bool(uris(x)[0]) for x in got] == [True, True, False]


@pytest.mark.parametrize("sw", [0, -1, 4])
def test_sliding_window_size_is_validated(c, inst, sw):
    # Tair looped forever on sw_size == 0
    assert error_code(locate, c, [1, 2, 3], query="reverse_roll_sw_match", instance=inst, sw_size=sw) == "INVALID_ARGUMENT"


def test_location_len_counts_what_get_cache_location_answers(c, inst):
    write(c, [1, 2, 3, 5], inst)
    cases = [
        ({"query_type": "prefix_match", "block_keys": [1, 2, 4, 3]}, 2),  # stops at the first gap
        ({"query_type": "QT_PREFIX_MATCH", "block_keys": [1, 2, 3, 5]}, 4),
        ({"query_type": "prefix_match", "block_keys": [99, 2, 3], "block_mask": {"offset": 1}}, 2),
        ({"query_type": "prefix_match", "block_keys": [1, 2], "block_mask": {"bool_masks": [True, True]}}, 0),
        ({"query_type": "prefix_match", "block_keys": [1, 2], "location_spec_names": ["tp1"]}, 2),
        ({"query_type": "batch_get", "block_keys": [1, 9, 3]}, 3),  # fillers count, as in the reply
        ({"query_type": "reverse_roll_sw_match", "block_keys": [1, 2, 3, 4], "sw_size": 2}, 4),
    ]
    for params, expected in cases:
        assert len(c.call("get_cache_location", {"instance_id": inst, **params})["locations"]) == expected
        assert c.call("get_cache_location_len", {"instance_id": inst, **params}) == {"cache_location_len": expected}


def test_location_len_refuses_what_get_cache_location_refuses(c, inst):
    def length(**params):
        return c.call("get_cache_location_len", {"instance_id": inst, "query_type": "prefix_match",
                                                 "block_keys": [1], **params})
    assert error_code(length, instance_id="nobody") == "INSTANCE_NOT_EXIST"
    assert error_code(length, query_type="qt_unspecified") == "INVALID_ARGUMENT"
    assert error_code(length, block_mask={"offset": 2}) == "INVALID_ARGUMENT"
    assert error_code(length, query_type="reverse_roll_sw_match", sw_size=0) == "INVALID_ARGUMENT"
    with pytest.raises(KvcmError, match="include_engines") as info:  # engine holders have no count of their own
        length(include_engines=True)
    assert info.value.code.name == "INVALID_ARGUMENT"


def test_location_spec_names_filter_keeps_spec_size_consistent(c, inst):
    write(c, [1, 2], inst)
    for query in ("prefix_match", "batch_get"):
        got = locate(c, [1, 2], query=query, instance=inst, location_spec_names=["tp1"])
        assert all(x["spec_size"] == 1 and [s["name"] for s in x["location_specs"]] == ["tp1"] for x in got)


def test_cache_hit_after_many_reads_stays_consistent(c, inst, server):
    write(c, [1, 2], inst)
    for _ in range(3):
        assert len(locate(c, [1, 2], instance=inst)) == 2
    c.call("remove_cache", {"instance_id": inst, "block_keys": [2]})
    assert len(locate(c, [1, 2], instance=inst)) == 1  # the search cache was invalidated


# -- get_cache_meta ---------------------------------------------------------------------------------


def test_get_cache_meta_levels(c, inst):
    session = start(c, [1, 2], inst)
    finish(c, session, {"offset": 1}, instance=inst)
    start(c, [3], inst)
    base = c.call("get_cache_meta", {"instance_id": inst, "block_keys": [1, 2, 3, 4]})
    assert [m["status"] for m in base["metas"]] in (
        ["serving", "deleting", "writing", "not_found"], ["serving", "not_found", "writing", "not_found"])
    assert "id" in base["metas"][0] and "id" not in base["metas"][3]  # no leaked id
    assert base["locations"][0] == session["locations"][0]
    assert "storage" not in base["metas"][0]
    one = c.call("get_cache_meta", {"instance_id": inst, "block_keys": [1], "detail_level": 1})["metas"][0]
    assert one["storage"] == "default-file" and one["nbytes"] == 2048 and one["written"] > 0
    two = c.call("get_cache_meta", {"instance_id": inst, "block_keys": [1], "detail_level": 2})["metas"][0]
    assert two["all"][0]["location"] == session["locations"][0]
    masked = c.call("get_cache_meta", {"instance_id": inst, "block_keys": [1, 2], "block_mask": {"offset": 1}})
    assert masked["metas"][0]["status"] == "masked" and len(masked["metas"]) == 2
    assert error_code(c.call, "get_cache_meta", {"instance_id": inst, "block_keys": [1], "detail_level": 9}) \
        == "INVALID_ARGUMENT"


# -- start_write_cache ------------------------------------------------------------------------------


def test_start_write_masks_existing_prefix_then_scattered(c, inst):
    write(c, [1, 2], inst)
    s = start(c, [1, 2, 3, 4], inst)
    assert s["block_mask"] == {"offset": 2} and len(s["locations"]) == 2
    s = start(c, [1, 11, 12, 2], inst)
    assert s["block_mask"] == {"bool_masks": [True, False, False, True]} and len(s["locations"]) == 2


def test_start_write_with_nothing_new(c, inst, server):
    write(c, [1, 2], inst)
    s = start(c, [1, 2], inst)
    assert s["block_mask"] == {"offset": 2} and s["locations"] == [] and s["write_session_id"]
    assert finish(c, s, instance=inst)["served"] == 0


def test_writing_and_deleting_keys_count_as_existing(c, inst):
    start(c, [5], inst)
    assert start(c, [5, 6], inst)["block_mask"] == {"offset": 1}  # concurrent writer of key 5


def test_duplicate_keys_in_one_request_allocate_once(c, inst, server):
    s = start(c, [5, 5, 6, 5], inst)
    assert s["block_mask"] == {"bool_masks": [False, True, False, True]} and len(s["locations"]) == 2
    finish(c, s, instance=inst)
    assert len(locate(c, [5, 6], instance=inst)) == 2
    _check(server)  # no orphaned writing record


def test_concurrent_writers_in_one_group_commit(server, inst):
    """Two clients' start_write of the same key drained in one wake-up: one allocation."""
    import zmq

    from kvcm.proto import wire

    ctx = zmq.Context.instance()
    socks = [ctx.socket(zmq.DEALER) for _ in range(2)]
    try:
        for s in socks:
            s.connect(server.endpoint)
        for i, s in enumerate(socks):
            s.send(wire.pack_request(i, "start_write_cache", {"instance_id": inst, "block_keys": [42]}))
        replies = [wire.parse_response(s.recv()) for s in socks]
    finally:
        for s in socks:
            s.close(0)
    allocated = [len(r[2]["locations"]) for r in replies]
    assert sorted(allocated) == [0, 1]


def test_spec_groups_for_hybrid_attention(c):
    specs = [{"name": n, "size": 512} for n in ("tp0_F0", "tp1_F0", "tp0_L1", "tp1_L1")]
    groups = [{"name": "F0", "spec_names": ["tp0_F0", "tp1_F0"]},
              {"name": "F0L1", "spec_names": ["tp0_F0", "tp1_F0", "tp0_L1", "tp1_L1"]}]
    register(c, "hybrid", group="g0", specs=specs, spec_groups=groups)
    s = start(c, [1, 2, 3], "hybrid", location_spec_group_names=["F0", "F0", "F0L1"])
    assert [x["spec_size"] for x in s["locations"]] == [2, 2, 4]
    assert [len(x["location_specs"]) for x in s["locations"]] == [2, 2, 4]
    # counted against the derived keys, so token_ids work too
    s = start(c, instance="hybrid", tokens=list(range(8)), location_spec_group_names=["F0", "F0L1"])
    assert [x["spec_size"] for x in s["locations"]] == [2, 4]
    assert error_code(start, c, [7, 8], "hybrid", location_spec_group_names=["F0"]) == "INVALID_ARGUMENT"
    assert error_code(start, c, [7], "hybrid", location_spec_group_names=["nope"]) == "INVALID_ARGUMENT"


def test_start_write_validation(c, inst):
    assert error_code(start, c, [], inst) == "INVALID_ARGUMENT"
    assert error_code(start, c, [1], "nobody") == "INSTANCE_NOT_EXIST"
    assert error_code(start, c, [1], inst, write_timeout_seconds=-1) == "INVALID_ARGUMENT"
    assert error_code(start, c, [2**63], inst) == "INVALID_ARGUMENT"


# -- finish_write_cache -----------------------------------------------------------------------------


def test_finish_with_offset_and_bool_masks(c, inst):
    s = start(c, [1, 2, 3], inst)
    finish(c, s, {"offset": 2}, instance=inst)
    assert len(locate(c, [1, 2, 3], instance=inst)) == 2
    s = start(c, [11, 12, 13, 14], inst)
    finish(c, s, {"bool_masks": [True, True, False, True]}, instance=inst)
    assert len(locate(c, [11, 12, 13, 14], instance=inst)) == 2


def test_finish_validates_before_consuming_the_session(c, inst, server):
    s = start(c, [1, 2], inst)
    assert error_code(finish, c, s, {"offset": 3}, instance=inst) == "INVALID_ARGUMENT"
    assert error_code(finish, c, s, {"bool_masks": [True]}, instance=inst) == "INVALID_ARGUMENT"
    assert error_code(c.call, "finish_write_cache", {"instance_id": inst, "write_session_id": s["write_session_id"]}) \
        == "INVALID_ARGUMENT"
    register(c, inst + "-other", group="g0")
    assert error_code(finish, c, s, instance=inst + "-other") == "INVALID_ARGUMENT"
    finish(c, s, instance=inst)  # still intact after all the bad attempts
    assert len(locate(c, [1, 2], instance=inst)) == 2
    assert error_code(finish, c, s, instance=inst) == "WRITE_SESSION_UNKNOWN"
    _check(server)


def test_unknown_session(c, inst):
    assert error_code(finish, c, {"write_session_id": "x" * 32, "locations": []}, instance=inst) \
        == "WRITE_SESSION_UNKNOWN"


def test_write_session_expires(c, inst, server):
    s = start(c, [1, 2], inst, write_timeout_seconds=0.3)
    wait_for(lambda: server.app.cache.sessions.was_expired(s["write_session_id"]))
    assert error_code(finish, c, s, instance=inst) == "WRITE_SESSION_EXPIRED"
    meta = c.call("get_cache_meta", {"instance_id": inst, "block_keys": [1, 2]})["metas"]
    assert {m["status"] for m in meta} <= {"deleting", "not_found"}
    _check(server)


def test_all_due_sessions_expire_in_one_tick():
    # The expiry timer never fires on its own here, so the one tick below is the only one (a
    # tick on the RPC thread racing this thread's could leave its batch uncommitted at the assert).
    with serve_in_thread(overrides={"cache": {"session_check_ms": 3_600_000}}) as srv, srv.client() as c:
        add_group(c, "g0", ["default-file"], delay_ms=0)
        register(c, "solo", group="g0")
        sessions = [start(c, [100 + i], "solo", write_timeout_seconds=0.2) for i in range(20)]
        time.sleep(0.25 * TIME_FACTOR)  # past the 0.2 s write timeout on the server's real clocks
        assert srv.app.cache.expire_sessions() == 20
        assert all(srv.app.cache.sessions.was_expired(s["write_session_id"]) for s in sessions)


def test_finish_never_resurrects_a_removed_block(c, inst, server):
    s = start(c, [1, 2], inst)
    c.call("remove_cache", {"instance_id": inst, "block_keys": [1]})
    finish(c, s, instance=inst)
    assert locate(c, [1, 2], instance=inst) == []  # block 1 stays deleting
    assert len(locate(c, [2], instance=inst)) == 1
    _check(server)


# -- remove_cache / trim_cache -----------------------------------------------------------------


def test_remove_cache_honours_mask_and_frees(c, inst, server):
    write(c, [1, 2, 3], inst)
    c.call("remove_cache", {"instance_id": inst, "block_keys": [1, 2, 3], "block_mask": {"offset": 1}})
    assert len(locate(c, [1], instance=inst)) == 1
    assert locate(c, [2], instance=inst) == [] and locate(c, [3], instance=inst) == []
    wait_for(lambda: server.app.cache.usage("g0")["by_instance"].get(inst, {}).get("keys") == 1)
    assert server.app.cache.usage("g0")["by_instance"][inst]["keys"] == 1
    _check(server)


def test_remove_cache_unknown_instance_is_an_error(c):
    # Tair answered OK for block_keys requests of an unknown instance
    assert error_code(c.call, "remove_cache", {"instance_id": "nobody", "block_keys": [1]}) == "INSTANCE_NOT_EXIST"


def test_remove_waits_for_the_group_delay(c, server):
    add_group(c, "slow", ["default-file"], delay_ms=600)
    register(c, "slowinst", group="slow")
    write(c, [1], "slowinst")
    c.call("remove_cache", {"instance_id": "slowinst", "block_keys": [1]})
    meta = c.call("get_cache_meta", {"instance_id": "slowinst", "block_keys": [1]})["metas"][0]
    assert meta["status"] == "deleting"  # the deleter polls every 20 ms but waits for the delay
    wait_for(lambda: server.app.cache.usage("slow")["keys"] == 0)
    assert server.app.cache.usage("slow")["keys"] == 0


def test_trim_remove_all_cache(c, inst, server):
    write(c, [1, 2, 3], inst)
    c.call("trim_cache", {"instance_id": inst, "strategy": "remove_all_cache"})
    assert locate(c, [1, 2, 3], query="batch_get", instance=inst)[0]["location_specs"][0]["uri"] == ""
    wait_for(lambda: not server.app.cache.usage("g0")["by_instance"].get(inst))
    assert not server.app.cache.usage("g0")["by_instance"].get(inst)
    _check(server)


def test_trim_remove_all_meta(c, inst, server):
    write(c, [1, 2], inst)
    start(c, [3], inst)
    assert c.call("trim_cache", {"instance_id": inst, "strategy": "TS_REMOVE_ALL_META"})["removed"] == 3
    assert not server.app.cache.usage("g0")["by_instance"].get(inst)
    assert locate(c, [1], instance=inst) == []
    _check(server)


def test_trim_by_timestamp(c, inst, server):
    write(c, [1], inst)
    time.sleep(0.01)  # three distinct wall-clock microsecond stamps
    middle = int(time.time() * 1e6)
    time.sleep(0.01)
    write(c, [2], inst)
    c.call("trim_cache", {"instance_id": inst, "strategy": "timestamp", "begin_timestamp": middle})
    assert len(locate(c, [1], instance=inst)) == 1 and locate(c, [2], instance=inst) == []
    c.call("trim_cache", {"instance_id": inst, "strategy": "timestamp", "begin_timestamp": 0, "end_timestamp": middle})
    assert locate(c, [1], instance=inst) == []
    _check(server)


def test_trim_validation(c, inst):
    assert error_code(c.call, "trim_cache", {"instance_id": inst, "strategy": "ts_unspecified"}) == "INVALID_ARGUMENT"
    assert error_code(c.call, "trim_cache", {"instance_id": inst, "strategy": "timestamp", "begin_timestamp": 5,
                                             "end_timestamp": 3}) == "INVALID_ARGUMENT"
    assert error_code(c.call, "trim_cache", {"instance_id": "nobody", "strategy": "remove_all_cache"}) \
        == "INSTANCE_NOT_EXIST"


# -- runs: one read per written sequence -----------------------------------------------------------


def _runs(server):
    with server.app.store.read() as view:
        return view.count("runs")


def test_runs_answer_prefixes_and_follow_every_change(c, inst, server):
    base = _runs(server)
    written = write(c, [1, 2, 3, 4, 5, 6], inst)["locations"]
    assert _runs(server) == base + 1
    assert locate(c, [1, 2, 3, 4, 5, 6, 7], instance=inst) == written
    assert locate(c, [1, 2, 3], instance=inst) == written[:3]
    assert locate(c, [2, 3], instance=inst) == written[1:3]  # not a run start: block by block
    # the request leaves the run: the run answers its part, blocks the rest
    extra = write(c, [1, 2, 9], inst)["locations"]
    assert locate(c, [1, 2, 9], instance=inst) == written[:2] + extra
    assert locate(c, [1, 2, 3], instance=inst, location_spec_names=["tp0"])[2]["spec_size"] == 1
    assert locate(c, [1, 2, 3], instance=inst, block_mask={"offset": 1}) == written[1:3]
    server.app.cache.check()
    c.call("remove_cache", {"instance_id": inst, "block_keys": [4]})
    assert _runs(server) == base  # any change to a member drops its run
    assert locate(c, [1, 2, 3, 4, 5, 6], instance=inst) == written[:3]
    _check(server)


def test_runs_skip_failed_and_removed_blocks(c, inst, server):
    s = start(c, [1, 2, 3, 4, 5], inst)
    c.call("remove_cache", {"instance_id": inst, "block_keys": [2]})
    finish(c, s, {"bool_masks": [True, True, True, False, True]}, instance=inst)
    assert locate(c, [1, 2, 3], instance=inst) == s["locations"][:1]
    assert locate(c, [3, 4], instance=inst) == s["locations"][2:3]
    _check(server)


def test_kvcm_call_covers_the_data_plane(server, inst, capsys):
    from kvcm.cli import main

    def call(method, params):
        assert main(["call", method, json.dumps(params), "--endpoint", server.endpoint]) == 0
        return json.loads(capsys.readouterr().out)

    started = call("start_write_cache", {"instance_id": inst, "block_keys": [1, 2]})
    assert call("finish_write_cache", {"instance_id": inst, "write_session_id": started["write_session_id"],
                                       "success_blocks": {"offset": 2}}) == {"served": 2, "failed": 0}
    assert len(call("get_cache_location", {"instance_id": inst, "query_type": "prefix_match",
                                           "block_keys": [1, 2]})["locations"]) == 2
    assert call("get_cache_meta", {"instance_id": inst, "block_keys": [1]})["metas"][0]["status"] == "serving"
    assert call("remove_cache", {"instance_id": inst, "block_keys": [2]}) == {"removed": 1}
    assert call("trim_cache", {"instance_id": inst, "strategy": "remove_all_cache"}) == {"removed": 1}


# -- hooks for the reclaimer and the event publisher --------------------------------------------------


class Recorder(CacheListener):
    def __init__(self):
        self.calls = []

    def on_serving(self, instance_id, key, nbytes, storage_type, parent, now):
        self.calls.append(("serving", instance_id, key, nbytes, storage_type, parent))

    def on_read(self, instance_id, keys, now):
        self.calls.append(("read", instance_id, tuple(keys)))

    def on_removed(self, instance_id, keys):
        self.calls.append(("removed", instance_id, tuple(keys)))

    def on_stored(self, instance_id, keys, parent, token_ids):
        self.calls.append(("stored", instance_id, tuple(keys), parent))

    def on_cleared(self, instance_id):
        self.calls.append(("cleared", instance_id))


class Broken(CacheListener):
    def on_read(self, instance_id, keys, now):
        raise RuntimeError("a listener bug")

    def on_stored(self, instance_id, keys, parent, token_ids):
        raise RuntimeError("a listener bug")


def test_a_failing_listener_fails_neither_the_request_nor_other_listeners(c, inst, server):
    cache = server.app.cache
    broken, rec = Broken(), Recorder()
    cache.add_listener(broken)
    cache.add_listener(rec)
    try:
        write(c, [11, 12], inst)
        assert len(locate(c, [11, 12], instance=inst)) == 2
        assert ("stored", inst, (11, 12), None) in rec.calls
        assert ("read", inst, (11, 12)) in rec.calls
    finally:
        cache.remove_listener(broken)
        cache.remove_listener(rec)
    _check(server)


def test_only_typed_listeners_are_accepted(server):
    class Untyped:
        def on_read(self, instance_id, keys, now):
            pass

    with pytest.raises(TypeError, match="Untyped is not a CacheListener"):
        server.app.cache.add_listener(Untyped())


def test_listeners_and_reclaimer_hooks(c, inst, server):
    cache = server.app.cache
    rec = Recorder()
    cache.add_listener(rec)
    try:
        write(c, [1, 2], inst)
        locate(c, [1, 2, 3], instance=inst)
        writing = start(c, [3], inst)
        assert ("serving", inst, 2, 2048, "file", 1) in rec.calls
        assert ("stored", inst, (1, 2), None) in rec.calls
        assert ("read", inst, (1, 2)) in rec.calls
        assert sorted(k for k, *_ in cache.serving_keys(inst)) == [1, 2]
        assert inst in cache.instances_of_group("g0")
        assert cache.usage("g0")["by_instance"][inst]["keys"] == 3
        assert cache.evict(inst, [1, 2, 3], storage_type="shm") == 0  # no copy of that type
        assert cache.evict(inst, [1, 2, 3]) == 2 * 2048  # serving only: the writing block 3 stays
        assert ("removed", inst, (1, 2)) in rec.calls
        finish(c, writing, instance=inst)
        assert len(locate(c, [3], instance=inst)) == 1
        c.call("trim_cache", {"instance_id": inst, "strategy": "remove_all_cache"})
        assert ("cleared", inst) in rec.calls
    finally:
        cache.remove_listener(rec)
    _check(server)
