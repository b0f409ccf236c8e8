"""Tair's reply shapes over real HTTP: every Tair RPC, on success and on a failing call, carries
the fields Tair's gateway prints (protobuf's JSON printer with ``always_print_fields_with_no_presence``
and ``preserve_proto_field_names``): every field without presence, defaults included, int64 as
strings, enums by name; a singular message field when it is set. And the units of every Tair
field that carries one (seconds, milliseconds, microseconds, bytes)."""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Callable

import pytest
import requests

from kvcm.proto.tair import shapes
from kvcm.tair import translate
from kvcm.testing import serve_in_thread
from tests.helpers import TIME_FACTOR, wait_until

HEADERS = {"Content-Type": "application/json"}
META_HEADER = {"status", "request_id", "tracer_result"}
ADMIN_HEADER = {"status", "request_id"}


class Tair:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/api/"
        self.session = requests.Session()

    def raw(self, method: str, body: object) -> dict:
        reply = self.session.post(self.url + method, data=json.dumps(body), headers=HEADERS, timeout=10)
        assert reply.status_code == 200, (method, reply.status_code, reply.text)
        return reply.json()

    def call(self, method: str, body: object, code: str = "OK") -> dict:
        data = self.raw(method, body)
        assert data["header"]["status"]["code"] == code, (method, data["header"])
        return data


@pytest.fixture(scope="module")
def server():
    with serve_in_thread() as running:
        yield running


@pytest.fixture(scope="module")
def admin_server():
    with serve_in_thread(overrides={"http": {"admin_port": 0}}) as running:
        yield running


@pytest.fixture
def tair(server):
    client = Tair(server.http_port)
    yield client
    client.session.close()


def _tag() -> str:
    return uuid.uuid4().hex[:8]


def _register(tair: Tair, instance_id: str = "") -> str:
    instance_id = instance_id or f"i-{_tag()}"
    tair.call("registerInstance", {"instance_group": "default", "instance_id": instance_id, "block_size": 4,
                                   "location_spec_infos": [{"name": "tp0", "size": "64"}]})
    return instance_id


def _written(tair: Tair, instance_id: str, keys: list) -> None:
    started = tair.call("startWriteCache", {"instance_id": instance_id, "block_keys": keys})
    tair.call("finishWriteCache", {"instance_id": instance_id, "write_session_id": started["write_session_id"],
                                   "success_blocks": {"offset": len(started["locations"])}})


def _serving(tair: Tair, instance_id: str, keys: list) -> int:
    """How many of ``keys`` a Tair reader finds (a trimmed block is deleting: not found)."""
    reply = tair.call("getCacheLocation", {"instance_id": instance_id, "query_type": "QT_BATCH_GET",
                                           "block_keys": keys})
    return sum(loc["type"] != "ST_UNSPECIFIED" for loc in reply["locations"])


def _storage(tair: Tair) -> str:
    name = f"nfs-{_tag()}"
    root = tempfile.mkdtemp(prefix="kvcm-shapes-")
    tair.call("addStorage", {"storage": {"global_unique_name": name, "nfs": {"root_path": os.path.join(root, "n")}}})
    return name


def _group(tair: Tair) -> str:
    name = f"g-{_tag()}"
    tair.call("createInstanceGroup", {"instance_group": {"name": name, "storage_candidates": ["default-file"]}})
    return name


def _report_body(instance_id: str) -> dict:
    return {"instance_id": instance_id, "host_ip_port": "10.0.0.1:80", "storage_type": "ST_EVENT_REPORT_L1P5",
            "events": [{"event_type": "EVENT_NODE_REGISTER", "node_register": {"mediums": ["mem"]}}]}


#: Tair RPC -> a body that succeeds (made on the server as it needs: a storage to remove, ...).
Body = Callable[[Tair], dict]
SUCCEEDING: dict[str, Body] = {
    "registerInstance": lambda t: {"instance_group": "default", "instance_id": f"i-{_tag()}", "block_size": 4,
                                   "location_spec_infos": [{"name": "tp0", "size": 64}]},
    "getInstanceInfo": lambda t: {"instance_id": _register(t)},
    "getCacheLocation": lambda t: {"instance_id": _register(t), "query_type": "QT_PREFIX_MATCH", "block_keys": [1]},
    "getCacheLocationLen": lambda t: {"instance_id": _register(t), "query_type": "QT_BATCH_GET", "block_keys": [1]},
    "getCacheMeta": lambda t: {"instance_id": _register(t), "block_keys": [1]},
    "startWriteCache": lambda t: {"instance_id": _register(t), "block_keys": [1, 2]},
    "finishWriteCache": lambda t: (lambda i: {"instance_id": i, "success_blocks": {"offset": 1}, "write_session_id": t.call(
        "startWriteCache", {"instance_id": i, "block_keys": [5]})["write_session_id"]})(_register(t)),
    "removeCache": lambda t: {"instance_id": _register(t), "block_keys": [1]},
    "trimCache": lambda t: {"instance_id": _register(t), "strategy": "TS_REMOVE_ALL_CACHE"},
    "getClusterInfo": lambda t: {},
    "reportEvent": lambda t: _report_body(_register(t)),
    "getHostCacheState": lambda t: {"instance_id": _register(t), "block_cache_keys": [1]},
    "addStorage": lambda t: {"storage": {"global_unique_name": f"nfs-{_tag()}",
                                         "nfs": {"root_path": tempfile.mkdtemp(prefix="kvcm-shapes-")}}},
    "enableStorage": lambda t: {"storage_unique_name": _storage(t)},
    "disableStorage": lambda t: {"storage_unique_name": _storage(t)},
    "removeStorage": lambda t: {"storage_unique_name": _storage(t)},
    "updateStorage": lambda t: {"storage": {"global_unique_name": _storage(t),
                                            "nfs": {"root_path": tempfile.mkdtemp(prefix="kvcm-shapes-")}},
                                "force_update": True},
    "listStorage": lambda t: {},
    "createInstanceGroup": lambda t: {"instance_group": {"name": f"g-{_tag()}", "storage_candidates": ["default-file"]}},
    "updateInstanceGroup": lambda t: {"current_version": "1", "instance_group": {"name": _group(t), "user_data": "u"}},
    "removeInstanceGroup": lambda t: {"name": _group(t)},
    "getInstanceGroup": lambda t: {"name": "default"},
    "listInstanceGroup": lambda t: {},
    "removeInstance": lambda t: {"instance_group": "default", "instance_id": _register(t)},
    "listInstanceInfo": lambda t: {"instance_group_name": "default"},
    "addAccount": lambda t: {"user_name": f"u{_tag()}", "password": "a-long-password-1"},
    "deleteAccount": lambda t: (lambda u: t.call("addAccount", {"user_name": u, "password": "a-long-password-1"})
                                and {"user_name": u})(f"u{_tag()}"),
    "listAccount": lambda t: {},
    "genConfigSnapshot": lambda t: {},
    "loadConfigSnapshot": lambda t: {"config_snapshot": t.call("genConfigSnapshot", {})["config_snapshot"]},
    "getMetrics": lambda t: {},
    "checkHealth": lambda t: {},
    "getManagerClusterInfo": lambda t: {},
    "getLeaderElectorConfig": lambda t: {},
    "updateLeaderElectorConfig": lambda t: {"campaign_delay_time_ms": 5000},
}

#: Served, but with no success to try here: leaderDemote would stop this node leading (its
#: reply is the header alone, CommonResponse); kvcm lacks the others (UNSUPPORTED).
NO_SUCCESS = {"leaderDemote", *translate.UNSUPPORTED}


def _rpcs(table: dict) -> list[str]:
    return sorted(table)


def _expect_failed(reply: dict, message: str, header: set[str]) -> None:
    """An error reply: the header, and every field without presence at Tair's default."""
    assert set(reply["header"]) == header, reply["header"]
    assert reply["header"]["status"]["code"] != "OK" and reply["header"]["status"]["message"]
    assert set(reply) == {"header"} | shapes.printed(message), (message, sorted(reply))
    for name, kind in shapes.MESSAGES[message]:
        if kind != "message":
            assert reply[name] == shapes.default(kind), (message, name, reply[name])


def _expect_succeeded(reply: dict, message: str, header: set[str]) -> None:
    """A success: the header and every field of the message (the message fields are all set)."""
    assert set(reply["header"]) == header, reply["header"]
    assert set(reply) == {"header"} | {name for name, _ in shapes.MESSAGES[message]}, (message, sorted(reply))
    for name, kind in shapes.MESSAGES[message]:
        if kind in ("int64", "uint64"):
            assert isinstance(reply[name], str) and reply[name].lstrip("-").isdigit(), (name, reply[name])
        elif kind == "repeated":
            assert isinstance(reply[name], list), (name, reply[name])
        elif kind == "bool":
            assert isinstance(reply[name], bool), (name, reply[name])
        elif kind == "message":
            assert isinstance(reply[name], dict), (name, reply[name])


def test_every_served_rpc_has_a_response_message_and_a_success_here():
    for table, replies in ((translate.META, shapes.META_REPLIES), (translate.ADMIN, shapes.ADMIN_REPLIES)):
        for name in table:
            assert replies[name] in shapes.MESSAGES, name
            assert name in SUCCEEDING or name in NO_SUCCESS, name
    for name in translate.UNSUPPORTED:
        assert name in shapes.META_REPLIES or name in shapes.ADMIN_REPLIES, name


@pytest.mark.parametrize("name", _rpcs(SUCCEEDING))
def test_a_success_carries_every_field(tair, name):
    service = "meta" if name in translate.META else "admin"  # the side port alone: MetaService's shapes first
    reply = tair.call(name, SUCCEEDING[name](tair))
    _expect_succeeded(reply, shapes.REPLIES[service][name], META_HEADER if service == "meta" else ADMIN_HEADER)


@pytest.mark.parametrize("name", _rpcs({**translate.META, **translate.ADMIN, **translate.UNSUPPORTED}))
def test_a_failing_call_carries_every_field_at_its_default(tair, name):
    # an unknown field fails every RPC the same way, before anything runs
    service = "meta" if name in shapes.META_REPLIES else "admin"
    reply = tair.raw(name, {"trace_id": "bad", "no_such_field": 1})
    _expect_failed(reply, shapes.REPLIES[service][name], META_HEADER if service == "meta" else ADMIN_HEADER)


def test_a_failing_register_still_carries_storage_configs(tair):
    reply = tair.call("registerInstance", {"instance_group": f"nobody-{_tag()}", "instance_id": f"i-{_tag()}",
                                           "block_size": 4, "location_spec_infos": [{"name": "tp0", "size": 64}]},
                      code="INVALID_ARGUMENT")
    # written out from meta_service.proto, not from the table: a client reads these before the status
    assert reply["storage_configs"] == "" and reply["extra_info"] == ""
    assert set(reply) == {"header", "storage_configs", "extra_info"}
    assert set(reply["header"]) == {"status", "request_id", "tracer_result"} and reply["header"]["tracer_result"] == ""


def test_failures_from_kvcm_itself_carry_the_fields(tair):
    nobody = f"nobody-{_tag()}"
    info = tair.call("getInstanceInfo", {"instance_id": nobody}, code="INSTANCE_NOT_EXIST")
    assert set(info) == {"header", "instance_group"} and info["instance_group"] == ""  # instance_info unset
    length = tair.call("getCacheLocationLen", {"instance_id": nobody, "query_type": "QT_BATCH_GET",
                                               "block_keys": [1]}, code="INSTANCE_NOT_EXIST")
    assert length["cache_location_len"] == "0"
    started = tair.call("startWriteCache", {"instance_id": nobody, "block_keys": [1]}, code="INSTANCE_NOT_EXIST")
    assert started["write_session_id"] == "" and started["locations"] == [] and "block_mask" not in started
    group = tair.call("getInstanceGroup", {"name": nobody}, code="INVALID_ARGUMENT")
    assert set(group) == {"header"} and set(group["header"]) == {"status", "request_id"}
    report = tair.call("reportEvent", _report_body(nobody), code="INSTANCE_NOT_EXIST")
    assert (report["item_results"], report["retry_after_ms"], report["snapshot_required"]) == ([], "0", False)
    unsupported = tair.call("migrateCache", {}, code="UNSUPPORTED")
    assert (unsupported["accepted"], unsupported["rejected"]) == ("0", "0")


def test_instance_info_prints_every_field_of_instance_info_and_model_deployment(tair):
    instance_id = f"i-{_tag()}"
    tair.call("registerInstance", {"instance_group": "default", "instance_id": instance_id, "block_size": 4,
                                   "location_spec_infos": [{"name": "tp0", "size": 64}],
                                   "model_deployment": {"model_name": "m"}})
    info = tair.call("getInstanceInfo", {"instance_id": instance_id})["instance_info"]
    assert set(info) == {name for name, _ in shapes.MESSAGES["InstanceInfo"]}
    assert info["default_query_type"] == "QT_UNSPECIFIED" and info["quota_group_name"] == ""
    assert info["model_deployment"] == {"model_name": "m", "dtype": "", "use_mla": False, "tp_size": 0, "dp_size": 0,
                                        "lora_name": "", "pp_size": 0, "extra": "", "user_data": "",
                                        "use_eagle_pop": False}


def test_the_admin_port_prints_admin_shapes_for_the_shared_names(admin_server):
    admin, meta = Tair(admin_server.app.http.admin_port), Tair(admin_server.http_port)
    try:
        instance_id = f"i-{_tag()}"
        registered = admin.call("registerInstance", {"instance_group": "default", "instance_id": instance_id,
                                                     "block_size": 4, "location_spec_infos": [{"name": "tp0", "size": 64}]})
        assert set(registered) == {"header"} and set(registered["header"]) == ADMIN_HEADER  # CommonResponse
        got = admin.call("getInstanceInfo", {"instance_id": instance_id})
        _expect_succeeded(got, "admin.GetInstanceInfoResponse", ADMIN_HEADER)
        failed = admin.call("getInstanceInfo", {"instance_id": "nobody"}, code="INSTANCE_NOT_EXIST")
        _expect_failed(failed, "admin.GetInstanceInfoResponse", ADMIN_HEADER)
        _expect_succeeded(admin.call("getCacheMeta", {"instance_id": instance_id, "block_keys": [1]}),
                          "GetCacheMetaResponse", ADMIN_HEADER)
        _expect_failed(meta.call("registerInstance", {"instance_group": "nope", "instance_id": "x", "block_size": 4},
                                 code="INVALID_ARGUMENT"), "RegisterInstanceResponse", META_HEADER)
    finally:
        admin.session.close()
        meta.session.close()


# -- units ------------------------------------------------------------------------------------------


def test_trim_by_time_takes_tair_s_seconds(tair):
    instance_id = _register(tair)
    _written(tair, instance_id, [11, 12])
    now = int(time.time())
    # written after this window: nothing goes
    tair.call("trimCache", {"instance_id": instance_id, "strategy": "TS_TIMESTAMP",
                            "begin_timestamp": now - 3600, "end_timestamp": now - 1800})
    assert _serving(tair, instance_id, [11, 12]) == 2
    # a window around now, in seconds, holds both writes
    tair.call("trimCache", {"instance_id": instance_id, "strategy": "TS_TIMESTAMP",
                            "begin_timestamp": now - 60, "end_timestamp": now + 60})
    assert _serving(tair, instance_id, [11, 12]) == 0
    # microseconds do not fit Tair's int32: refused, not read as a time 50 years ahead
    reply = tair.call("trimCache", {"instance_id": instance_id, "strategy": "TS_TIMESTAMP",
                                    "begin_timestamp": now * 1_000_000}, code="INVALID_ARGUMENT")
    assert "begin_timestamp" in reply["header"]["status"]["message"]


def test_trim_by_a_begin_second_alone(tair):
    instance_id = _register(tair)
    _written(tair, instance_id, [21])
    tair.call("trimCache", {"instance_id": instance_id, "strategy": 3, "begin_timestamp": str(int(time.time()) + 600)})
    assert _serving(tair, instance_id, [21]) == 1
    tair.call("trimCache", {"instance_id": instance_id, "strategy": 3, "begin_timestamp": int(time.time()) - 600})
    assert _serving(tair, instance_id, [21]) == 0


def test_write_timeout_is_in_seconds(tair):
    instance_id = _register(tair)
    started = tair.call("startWriteCache", {"instance_id": instance_id, "block_keys": [31],
                                            "write_timeout_seconds": 1})
    # one second, not one millisecond: the session is alive at once and gone after a few seconds
    fresh = tair.call("startWriteCache", {"instance_id": instance_id, "block_keys": [31]})
    assert fresh["block_mask"] == {"offset": 1}  # still being written
    wait_until(lambda: tair.call("startWriteCache", {"instance_id": instance_id, "block_keys": [31]})[
        "block_mask"] == {"offset": 0}, timeout=10 * TIME_FACTOR)
    reply = tair.raw("finishWriteCache", {"instance_id": instance_id, "write_session_id": started["write_session_id"],
                                          "success_blocks": {"offset": 1}})
    assert reply["header"]["status"]["code"] == "INVALID_ARGUMENT"


def test_location_spec_size_is_bytes_in_the_uri(tair):
    instance_id = f"i-{_tag()}"
    tair.call("registerInstance", {"instance_group": "default", "instance_id": instance_id, "block_size": 4,
                                   "location_spec_infos": [{"name": "tp0", "size": "4096"}]})
    started = tair.call("startWriteCache", {"instance_id": instance_id, "block_keys": [41]})
    uri = urllib.parse.urlsplit(started["locations"][0]["location_specs"][0]["uri"])
    assert dict(urllib.parse.parse_qsl(uri.query))["size"] == "4096"
    info = tair.call("getInstanceInfo", {"instance_id": instance_id})["instance_info"]
    assert info["location_spec_infos"] == [{"name": "tp0", "size": "4096"}]


def test_millisecond_and_microsecond_clocks(tair):
    before_ms = int(time.time() * 1000)
    metrics = tair.call("getMetrics", {"trace_id": "clock"})
    after_ms = int(time.time() * 1000)
    assert before_ms - 1000 <= int(metrics["timestamp"]) <= after_ms + 1000  # Tair: GetCurrentTimeMs
    request_us = int(metrics["header"]["request_id"].rpartition("_")[2])
    assert before_ms * 1000 - 1_000_000 <= request_us <= after_ms * 1000 + 1_000_000
    cluster = tair.call("getManagerClusterInfo", {})
    assert int(cluster["info_updated_time"]) <= after_ms + 1000 and int(cluster["info_updated_time"]) > 10 ** 12
    assert tair.call("checkHealth", {})["elector_last_loop_time_ms"] == "0"


def test_durations_and_sizes_round_trip_in_tair_s_units(tair):
    tair.call("updateLeaderElectorConfig", {"campaign_delay_time_ms": "1234"})
    try:
        assert tair.call("getLeaderElectorConfig", {})["campaign_delay_time_ms"] == "1234"
    finally:
        tair.call("updateLeaderElectorConfig", {"campaign_delay_time_ms": 5000})
    name = f"g-{_tag()}"
    tair.call("createInstanceGroup", {"instance_group": {
        "name": name, "storage_candidates": ["default-file"], "quota": {"capacity": str(3 << 30)},
        "cache_config": {"reclaim_strategy": {"reclaim_policy": "POLICY_LRU", "delay_before_delete_ms": 750}}}})
    group = tair.call("getInstanceGroup", {"name": name})["instance_group"]
    assert group["quota"]["capacity"] == str(3 << 30)  # bytes
    assert group["cache_config"]["reclaim_strategy"]["delay_before_delete_ms"] == 750  # an int32 in ms
    own = requests.post(tair.url + "get_instance_group", json={"name": name}, timeout=10).json()["result"]
    assert own["instance_group"]["reclaim_strategy"]["delay_before_delete_ms"] == 750
    assert own["instance_group"]["quota"]["capacity"] == 3 << 30


def test_instance_groups_and_storages_print_every_nested_field(tair):
    """InstanceGroup, its quota, cache config, reclaim and trigger strategies, meta indexer
    config, and a storage's spec member: every field without presence printed, defaults
    included (``migration_config``, a message kvcm never sets, left out as Tair's printer does)."""
    name = f"g-{_tag()}"
    tair.call("createInstanceGroup", {"instance_group": {"name": name, "storage_candidates": ["default-file"],
                                                         "cache_config": {"meta_indexer_config": {"max_key_count": 16}}}})
    for group in (tair.call("getInstanceGroup", {"name": name})["instance_group"],
                  next(g for g in tair.call("listInstanceGroup", {})["instance_group"] if g["name"] == name)):
        assert set(group) == shapes.printed("InstanceGroup") | {"quota", "cache_config"}
        assert (group["extra_info"], group["event_report_storage_candidates"], group["revisit_interval_buckets"]) == \
            ("", [], "")
        assert set(group["quota"]) == shapes.printed("InstanceGroupQuota")
        cache = group["cache_config"]
        assert set(cache) == shapes.printed("CacheConfig") | {"reclaim_strategy", "meta_indexer_config"}
        assert cache["data_storage_strategy"] == "CPS_UNSPECIFIED"
        strategy = cache["reclaim_strategy"]
        assert set(strategy) == shapes.printed("CacheReclaimStrategy") | {"trigger_strategy"}
        assert set(strategy["trigger_strategy"]) == shapes.printed("TriggerStrategy")
        assert cache["meta_indexer_config"] == {"max_key_count": "16", "mutex_shard_num": "0", "batch_key_size": "0"}
    added = _storage(tair)  # an nfs spec with its root_path alone: key_count_per_file printed at 0
    storage = next(s for s in tair.call("listStorage", {})["storage"] if s["global_unique_name"] == added)
    assert set(storage["nfs"]) == shapes.printed("NfsStorageSpec")
