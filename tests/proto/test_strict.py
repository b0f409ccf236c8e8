"""Strict request schemas against a real server: an unknown or misspelled field, at any depth, is
INVALID_ARGUMENT naming its dotted path (with a "did you mean" or a pointer from Tair's layout),
and the request changes nothing. Destructive requests never widen on a malformed mask or range.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

import msgpack
import msgspec
import pytest
import zmq

from kvcm.errors import InvalidArgument, KvcmError
from kvcm.proto import schema, wire
from kvcm.testing import serve_in_thread
from tests.helpers import register, start, write

pytestmark = pytest.mark.both_stores

KEYS = [11, 12, 13, 14]


@pytest.fixture(scope="module")
def server(kvcm_store):
    # No reclaimer: nothing may change between a refused request and the check that follows.
    with serve_in_thread(overrides={"reclaim": {"enabled": False}}) as running:
        with running.client() as c:
            register(c)
        yield running


@pytest.fixture
def c(server):
    with server.client() as client:
        yield client


def refused(c: Any, method: str, params: dict[str, Any]) -> str:
    """Call ``method``, expect INVALID_ARGUMENT, return its message."""
    with pytest.raises(InvalidArgument) as info:
        c.call(method, params)
    assert info.value.code.name == "INVALID_ARGUMENT", info.value
    return info.value.message


def statuses(c: Any, keys: list[int]) -> list[str]:
    metas = c.call("get_cache_meta", {"instance_id": "inst", "block_keys": keys})["metas"]
    return [m["status"] for m in metas]


def registry_state(c: Any) -> dict[str, Any]:
    snapshot = c.call("gen_config_snapshot")["config_snapshot"]
    snapshot.pop("created_time")
    return snapshot


def group(c: Any, name: str = "default") -> dict[str, Any]:
    out: dict[str, Any] = c.call("get_instance_group", {"name": name})["instance_group"]
    return out


# -- the typos found by testing: each refused, naming the path, changing nothing ------------------


def test_remove_cache_mask_typo_removes_nothing(c):
    write(c, KEYS)
    message = refused(c, "remove_cache", {"instance_id": "inst", "block_keys": KEYS, "block_mask": {"ofset": 3}})
    assert message == "remove_cache: unknown field block_mask.ofset (did you mean block_mask.offset?)"
    assert statuses(c, KEYS) == ["serving"] * 4
    assert c.call("remove_cache", {"instance_id": "inst", "block_keys": KEYS, "block_mask": {"offset": 3}}) == {
        "removed": 1}  # what the mask meant: the last key only
    assert statuses(c, KEYS) == ["serving"] * 3 + ["deleting"]


def test_trim_cache_range_typo_removes_nothing(c):
    keys = [21, 22]
    write(c, keys)
    message = refused(c, "trim_cache", {"instance_id": "inst", "strategy": "timestamp", "end_timestmp": 1})
    assert "unknown field end_timestmp (did you mean end_timestamp?)" in message
    assert statuses(c, keys) == ["serving"] * 2


def test_quota_typo_leaves_the_quota_alone(c):
    before = registry_state(c)
    message = refused(c, "create_instance_group", {"instance_group": {
        "name": "g-quota", "storage_candidates": ["default-file"], "quota": {"capcity": 1 << 30}}})
    assert "unknown field instance_group.quota.capcity (did you mean instance_group.quota.capacity?)" in message
    version = group(c)["version"]
    message = refused(c, "update_instance_group", {"instance_group": {"name": "default", "quota": {"capcity": 5}},
                                                   "current_version": version})
    assert "unknown field instance_group.quota.capcity (did you mean instance_group.quota.capacity?)" in message
    assert registry_state(c) == before


def test_used_percentage_typo_is_not_stored_as_the_default(c):
    before = registry_state(c)
    message = refused(c, "create_instance_group", {"instance_group": {
        "name": "g-typo", "storage_candidates": ["default-file"], "reclaim_strategy": {"used_precentage": 0.5}}})
    assert message == ("create_instance_group: unknown field instance_group.reclaim_strategy.used_precentage "
                       "(did you mean instance_group.reclaim_strategy.used_percentage?)")
    assert registry_state(c) == before


def test_tair_nested_cache_config_points_to_kvcm_field(c):
    tair = {"name": "g-tair", "storage_candidates": ["default-file"],
            "cache_config": {"reclaim_strategy": {"trigger_strategy": {"used_percentage": 0.5}}}}
    before = registry_state(c)
    message = refused(c, "create_instance_group", {"instance_group": tair})
    assert "unknown field instance_group.cache_config (Tair's layout" in message
    assert "instance_group.reclaim_strategy.used_percentage" in message
    assert "meta_indexer_config" in message
    # The half-translated shape gets its own pointer.
    message = refused(c, "create_instance_group", {"instance_group": {
        **{k: v for k, v in tair.items() if k != "cache_config"}, "reclaim_strategy": {"trigger_strategy": {}}}})
    assert "instance_group.reclaim_strategy.trigger_strategy (Tair's layout; kvcm's is " \
           "instance_group.reclaim_strategy.used_percentage" in message
    for field, words in [("data_storage_strategy", "no per-group setting in kvcm"),
                         ("meta_indexer_config", "instance_group.max_block_count")]:
        plain = {k: v for k, v in tair.items() if k != "cache_config"}
        message = refused(c, "create_instance_group", {"instance_group": {**plain, field: 1}})
        assert words in message, message
    assert registry_state(c) == before


def test_enabled_typo_leaves_the_storage_as_it_was(c, tmp_path):
    before = registry_state(c)
    storage = {"global_unique_name": "st-typo", "storage_type": "file", "storage_spec": {"root_path": str(tmp_path)}}
    message = refused(c, "add_storage", {"storage": {**storage, "enabld": False}})
    assert "unknown field storage.enabld (did you mean storage.enabled?)" in message
    current = c.call("list_storage")["storage"][0]
    message = refused(c, "update_storage", {"storage": {**current, "enabld": False}})
    assert "storage.enabld" in message
    assert registry_state(c) == before
    assert all(s["enabled"] for s in c.call("list_storage")["storage"])


def test_replay_endpoint_typo_adds_no_source(c):
    message = refused(c, "add_event_source", {"source_id": "s1", "instance_id": "inst",
                                              "endpoint": "tcp://127.0.0.1:1", "replay_endpiont": "tcp://127.0.0.1:2"})
    assert "unknown field replay_endpiont (did you mean replay_endpoint?)" in message
    assert c.call("list_event_sources") == {"sources": []}


def test_add_event_source_takes_credentials_but_never_as_a_source_setting(c):
    from kvcm.api import engines as engines_api

    class Recorder:  # the handler's only observable output is what it hands the engine service
        def add_source(self, params: dict[str, Any]) -> dict[str, Any]:
            self.params = params
            return {}

    recorder = Recorder()
    (add, *_) = engines_api.methods(recorder)  # type: ignore[arg-type]
    add.handler(msgspec.convert({"source_id": "s", "instance_id": "inst", "trace_id": "t",
                                 "auth": {"user": "u", "password": "p"}}, add.request))
    assert "auth" not in recorder.params and "trace_id" not in recorder.params
    assert recorder.params["source_id"] == "s"
    source = {"source_id": "s-auth", "instance_id": "inst", "endpoint": "tcp://127.0.0.1:9", "replay": False,
              "auth": {"user": "u", "password": "p"}}
    assert c.call("add_event_source", source)["source"]["source_id"] == "s-auth"
    c.call("remove_event_source", {"source_id": "s-auth"})


def test_read_and_write_typos_are_refused(c):
    message = refused(c, "get_cache_location", {"instance_id": "inst", "query_type": "batch_get", "block_keys": [1],
                                                "location_spec_name": ["tp0"]})
    assert "unknown field location_spec_name (did you mean location_spec_names?)" in message
    keys = [31, 32]
    message = refused(c, "start_write_cache", {"instance_id": "inst", "block_keys": keys, "write_timeout_second": 1})
    assert "unknown field write_timeout_second (did you mean write_timeout_seconds?)" in message
    assert statuses(c, keys) == ["not_found"] * 2  # no write session was opened


def test_auth_typo_names_the_credentials_field(c):
    message = refused(c, "check_health", {"auth": {"usr": "admin", "password": "x"}})
    assert message == "check_health: unknown field auth.usr (did you mean auth.user?)"
    assert c.call("check_health", {"trace_id": "t", "auth": {"user": "a", "password": "b"}})["status"] == "ok"


# -- every RPC ------------------------------------------------------------------------------------


def test_every_rpc_refuses_an_unknown_top_level_field(server, c):
    names = sorted(server.app.dispatcher.methods)
    assert len(names) >= 34
    before = registry_state(c)
    for name in names:
        message = refused(c, name, {"bogus_field_xyz": 1})
        assert message == f"{name}: unknown field bogus_field_xyz", message
    assert registry_state(c) == before


def test_both_decode_paths_word_errors_alike(server, c):
    """A bare params map (no ``[ ]`` around it) takes the dispatcher's slow path: same words."""
    params = {"instance_id": "inst", "block_keys": KEYS, "block_mask": {"ofset": 3}}
    fast = refused(c, "remove_cache", params)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        for msgid, (method, bare) in enumerate([("remove_cache", params), ("check_health", {"bogus_field_xyz": 1})]):
            sock.send(msgpack.packb([0, msgid, method, bare]))
            assert sock.poll(10_000), "no reply"
            got, err, _ = wire.parse_response(sock.recv())
            assert got == msgid and err["name"] == "INVALID_ARGUMENT", err
            assert err["message"] == (fast if method == "remove_cache" else "check_health: unknown field bogus_field_xyz")
    finally:
        sock.close()


def test_http_side_port_refuses_the_same(server):
    body = json.dumps({"instance_id": "inst", "block_keys": [1], "block_mask": {"ofset": 0}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/api/remove_cache", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    reply = json.loads(info.value.read())
    assert info.value.code == 400 and reply["error"]["name"] == "INVALID_ARGUMENT"
    assert "block_mask.ofset (did you mean block_mask.offset?)" in reply["error"]["message"]


def test_a_huge_field_name_is_quoted_short(c):
    message = refused(c, "list_storage", {"x" * 5000: 1})
    assert message.startswith("list_storage: unknown field 'xxx") and len(message) < 200


# -- masks ----------------------------------------------------------------------------------------


def test_proto_json_bool_masks_accepted_strictly(c):
    keys = [41, 42, 43]
    write(c, keys)
    proto_json = {"instance_id": "inst", "query_type": "batch_get", "block_keys": keys,
                  "block_mask": {"bool_masks": {"values": [True, False, True]}}}
    locations = c.call("get_cache_location", proto_json)["locations"]
    assert [loc["type"] for loc in locations] == ["unspecified", "file", "unspecified"]  # masked, found, masked
    extra = {**proto_json, "block_mask": {"bool_masks": {"values": [True, False, True], "offset": 1}}}
    assert "unknown field block_mask.bool_masks.offset" in refused(c, "get_cache_location", extra)
    typo = {**proto_json, "block_mask": {"bool_masks": {"valuez": [True]}}}
    assert "block_mask.bool_masks.valuez (did you mean block_mask.bool_masks.values?)" in refused(
        c, "get_cache_location", typo)
    wrong = {**proto_json, "block_mask": {"bool_masks": {"values": [1, 0, 1]}}}
    assert "block_mask.bool_masks.values[0]" in refused(c, "get_cache_location", wrong)
    remove = {"instance_id": "inst", "block_keys": keys, "block_mask": {"bool_masks": {"values": [True, True, False]}}}
    bad_remove = {**remove, "block_mask": {"bool_masks": {"values": [True, True, False], "x": 1}}}
    assert refused(c, "remove_cache", bad_remove) == "remove_cache: unknown field block_mask.bool_masks.x"
    assert statuses(c, keys) == ["serving"] * 3
    assert c.call("remove_cache", remove) == {"removed": 1}
    assert statuses(c, keys) == ["serving", "serving", "deleting"]


def test_empty_mask_on_a_deletion_is_refused(c):
    keys = [51, 52]
    write(c, keys)
    message = refused(c, "remove_cache", {"instance_id": "inst", "block_keys": keys, "block_mask": {}})
    assert "block_mask: give offset or bool_masks" in message
    assert statuses(c, keys) == ["serving"] * 2
    # On a read an empty mask still masks nothing.
    locations = c.call("get_cache_location", {"instance_id": "inst", "query_type": "batch_get", "block_keys": keys,
                                              "block_mask": {}})["locations"]
    assert [loc["type"] for loc in locations] == ["file", "file"]


@pytest.mark.parametrize("strategy, begin, end, words", [
    ("timestamp", 0, 0, "needs at least one"),
    ("timestamp", -1, 0, "must not be negative"),
    ("timestamp", 0, -1, "must not be negative"),
    ("timestamp", 10, 5, "begin < end"),
    ("timestamp", 10, 10, "begin < end"),
    ("remove_all_cache", 0, 5, "only for strategy 'timestamp'"),
    ("remove_all_meta", 5, 0, "only for strategy 'timestamp'"),
])
def test_malformed_trim_range_removes_nothing(c, strategy, begin, end, words):
    keys = [61, 62]
    write(c, keys)
    message = refused(c, "trim_cache", {"instance_id": "inst", "strategy": strategy,
                                        "begin_timestamp": begin, "end_timestamp": end})
    assert words in message
    assert statuses(c, keys) == ["serving"] * 2


# -- partial maps and snapshots --------------------------------------------------------------------


def test_update_instance_group_typos_at_depth(c):
    before = registry_state(c)
    version = group(c)["version"]
    cases = [
        ({"reclaim_strategy": {"used_precentage": 0.5}},
         "instance_group.reclaim_strategy.used_precentage (did you mean instance_group.reclaim_strategy.used_percentage?)"),
        ({"quota": {"quota_config": [{"storage_type": "file", "capacity": 1}, {"storage_type": "shm", "capcity": 1}]}},
         "instance_group.quota.quota_config[1].capcity (did you mean instance_group.quota.quota_config[1].capacity?)"),
        ({"max_instance_cnt": 3}, "instance_group.max_instance_cnt (did you mean instance_group.max_instance_count?)"),
        ({"cache_config": {}}, "instance_group.cache_config (Tair's layout"),
    ]
    for changes, words in cases:
        for current in (version, version + 7):  # a typo is a typo, whatever the version
            message = refused(c, "update_instance_group", {"instance_group": {"name": "default", **changes},
                                                           "current_version": current})
            assert words in message, message
    assert registry_state(c) == before
    updated = c.call("update_instance_group", {"instance_group": {"name": "default", "user_data": "ok"},
                                               "current_version": version})["instance_group"]
    assert updated["version"] == version + 1 and updated["reclaim_strategy"]["used_percentage"] == 0.9


def test_snapshot_typos_load_nothing(c):
    before = registry_state(c)
    snapshot = c.call("gen_config_snapshot")["config_snapshot"]
    cases: list[tuple[Any, str]] = [
        ({**snapshot, "storagess": []}, "config_snapshot.storagess (did you mean config_snapshot.storages?)"),
        ({**snapshot, "instance_groups": [{**snapshot["instance_groups"][0],
                                            "reclaim_strategy": {"used_precentage": 0.5}}]},
         "config_snapshot.instance_groups[0].reclaim_strategy.used_precentage (did you mean "),
        ({**snapshot, "instances": [{**snapshot["instances"][0], "instance_group": "default"}]},
         "config_snapshot.instances[0].instance_group (did you mean config_snapshot.instances[0].instance_group_name?)"),
        ({**snapshot, "storages": [{**snapshot["storages"][0], "enabld": True}]}, "config_snapshot.storages[0].enabld"),
    ]
    for bad, words in cases:
        for form in (bad, json.dumps(bad)):  # a map, or its JSON text
            message = refused(c, "load_config_snapshot", {"config_snapshot": form})
            assert words in message, message
    assert registry_state(c) == before


def test_unknown_storage_spec_field_is_refused_with_a_guess(c, tmp_path):
    storage = {"global_unique_name": "st-spec", "storage_type": "file",
               "storage_spec": {"root_path": str(tmp_path), "key_count_perfile": 2}}
    message = refused(c, "add_storage", {"storage": storage})
    assert "storage_spec.key_count_perfile unknown field (did you mean storage_spec.key_count_per_file?" in message
    assert not os.listdir(tmp_path)


def test_stored_records_still_decode_after_a_restart(tmp_path):
    data_dir = str(tmp_path / "data")
    with serve_in_thread(data_dir, overrides={"reclaim": {"enabled": False}}) as running, running.client() as c:
        register(c, "kept")
        c.call("create_instance_group", {"instance_group": {"name": "g2", "storage_candidates": ["default-file"]}})
        start(c, [1], instance="kept")  # an open write session is stored too
        before = registry_state(c)
    with serve_in_thread(data_dir, overrides={"reclaim": {"enabled": False}}) as running, running.client() as c:
        assert registry_state(c) == before


# -- the formatter on its own -------------------------------------------------------------------------


class _Inner(msgspec.Struct, forbid_unknown_fields=True):
    offset: int = 0


class _Outer(schema.RequestBase):
    by_name: dict[str, _Inner] = msgspec.field(default_factory=dict)
    pairs: tuple[_Inner, _Inner] | None = None
    renamed: _Inner | None = msgspec.field(default=None, name="wire_name")


@pytest.mark.parametrize("value, text", [
    ({"by_name": {"k": {"ofset": 1}}}, "m: unknown field by_name[...].ofset (did you mean by_name[...].offset?)"),
    ({"pairs": [{}, {"Offset": 1}]}, "m: unknown field pairs[1].Offset (did you mean pairs[1].offset?)"),
    ({"wire_name": {"offset": "3"}}, "m: Expected `int`, got `str` - at `wire_name.offset`"),
    ({"renamed": {}}, "m: unknown field renamed (did you mean wire_name?)"),
    ({"traceId": "x"}, "m: unknown field traceId (did you mean trace_id?)"),
    ({"zzz": 1}, "m: unknown field zzz"),
])
@pytest.mark.store_independent
def test_describe_walks_the_schema(value, text):
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.convert(value, _Outer, strict=True)
    assert str(schema.invalid("m", _Outer, info.value).message) == text


@pytest.mark.store_independent
def test_check_partial_follows_structs_lists_and_maps():
    schema.check_partial({"by_name": {"a": {"offset": 1}}, "pairs": [{"offset": 2}], "trace_id": 3}, _Outer, "x")
    with pytest.raises(KvcmError, match=r"x\.by_name\[\.\.\.\]\.ofset \(did you mean x\.by_name\[\.\.\.\]\.offset\?\)"):
        schema.check_partial({"by_name": {"a": {"ofset": 1}}}, _Outer, "x")
    with pytest.raises(KvcmError, match=r"x\.pairs\[0\]\.b"):
        schema.check_partial({"pairs": [{"b": 1}]}, _Outer, "x")
    with pytest.raises(KvcmError, match="field names must be strings"):
        schema.check_partial({1: 2}, _Outer, "x")
