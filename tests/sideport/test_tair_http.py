"""Tair KVCM's HTTP/JSON surface, driven by a plain ``requests`` client written from Tair's protos
(meta_service.proto, admin_service.proto) and never from kvcm's client: every MetaService and
AdminService RPC, every enum by Tair's name, error statuses by name, int64 above 2^53 as strings,
and the port layout with ``http.admin_port``."""

from __future__ import annotations

import json
import os
import tempfile
import uuid

import pytest
import requests

from kvcm import Client
from kvcm.blocks import BlockIO
from kvcm.errors import AccessDenied, Code, ServerError, Unavailable
from kvcm.tair import translate
from kvcm.tair.uris import Roots
from kvcm.testing import serve_in_thread

BIG = (1 << 53) + 1  # the first integer a double cannot hold
HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


class Tair:
    """POST /api/<lowerCamelName> with proto3 JSON, as Tair's clients do."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/api/"
        self.session = requests.Session()

    def raw(self, method: str, body: object) -> requests.Response:
        return self.session.post(self.url + method, data=json.dumps(body), headers=HEADERS, timeout=10)

    def call(self, method: str, body: object, code: str = "OK") -> dict:
        reply = self.raw(method, body)
        assert reply.status_code == 200, (method, reply.status_code, reply.text)
        data = reply.json()
        status = data["header"]["status"]
        assert status["code"] == code, (method, status)
        return data


@pytest.fixture(scope="module")
def server():
    with serve_in_thread() as running:
        yield running


@pytest.fixture
def tair(server):
    client = Tair(server.http_port)
    yield client
    client.session.close()


def _instance(tair: Tair, **extra) -> str:
    instance_id = f"i-{uuid.uuid4().hex[:8]}"
    tair.call("registerInstance", {
        "trace_id": "reg", "instance_group": "default", "instance_id": instance_id, "block_size": 4,
        "location_spec_infos": [{"name": "tp0", "size": "64"}, {"name": "tp1", "size": 64}],
        "model_deployment": {"model_name": "m", "dtype": "FP16", "tp_size": 2, "use_mla": False,
                             "user_data": "u", "use_eagle_pop": False},
        "default_query_type": "QT_PREFIX_MATCH", **extra})
    return instance_id


def _write(tair: Tair, instance_id: str, keys: list) -> dict:
    started = tair.call("startWriteCache", {"instance_id": instance_id, "block_keys": keys,
                                            "write_timeout_seconds": 30, "min_replica_count": 1})
    tair.call("finishWriteCache", {"instance_id": instance_id, "write_session_id": started["write_session_id"],
                                   "success_blocks": {"offset": len(started["locations"])},
                                   "locations": started["locations"]})
    return started


def _found(tair: Tair, instance_id: str, keys: list, query_type: object = "QT_PREFIX_MATCH", **extra) -> int:
    reply = tair.call("getCacheLocation", {"instance_id": instance_id, "query_type": query_type,
                                           "block_keys": keys, **extra})
    return sum(loc["type"] != "ST_UNSPECIFIED" for loc in reply["locations"])


# -- the data plane ----------------------------------------------------------------------------


def test_register_start_finish_prefix_match_remove_trim(tair):
    instance_id = _instance(tair)
    keys = [str(BIG), str(BIG + 1), 3, "4"]
    reply = tair.raw("startWriteCache", {"trace_id": "t-1", "instance_id": instance_id, "block_keys": keys})
    assert reply.status_code == 200
    started = reply.json()
    assert started["header"]["status"] == {"code": "OK", "message": ""}
    assert started["header"]["request_id"].startswith("t-1_") and started["header"]["request_id"][4:].isdigit()
    assert started["block_mask"] == {"offset": 0} and len(started["locations"]) == 4
    first = started["locations"][0]
    assert first["type"] == "ST_NFS" and first["spec_size"] == 2
    assert [s["name"] for s in first["location_specs"]] == ["tp0", "tp1"]
    assert first["location_specs"][0]["uri"].startswith("file://default-file/")
    # Before the finish nothing is visible; a second writer gets every key masked.
    assert _found(tair, instance_id, keys) == 0
    again = tair.call("startWriteCache", {"instance_id": instance_id, "block_keys": keys})
    assert again["block_mask"] == {"offset": 4} and again["locations"] == []
    tair.call("finishWriteCache", {"instance_id": instance_id, "write_session_id": started["write_session_id"],
                                   "success_blocks": {"bool_masks": {"values": [True, True, True, False]}}})
    assert _found(tair, instance_id, keys) == 3
    assert _found(tair, instance_id, keys, block_mask={"offset": 1}) == 2
    assert tair.call("getCacheLocationLen", {"instance_id": instance_id, "query_type": "QT_PREFIX_MATCH",
                                             "block_keys": keys})["cache_location_len"] == "3"
    # Keys that exist are masked: a prefix as an offset, holes as a bool mask.
    partial = tair.call("startWriteCache", {"instance_id": instance_id, "block_keys": [keys[0], 99]})
    assert partial["block_mask"] == {"offset": 1}
    holes = tair.call("startWriteCache", {"instance_id": instance_id, "block_keys": [keys[0], 77, 3]})
    assert holes["block_mask"] == {"bool_masks": {"values": [True, False, True]}} and len(holes["locations"]) == 1
    tair.call("removeCache", {"instance_id": instance_id, "block_keys": keys,
                              "block_mask": {"bool_masks": {"values": [True, False, True, True]}}})  # true: kept
    assert _found(tair, instance_id, keys) == 1
    tair.call("trimCache", {"instance_id": instance_id, "strategy": "TS_REMOVE_ALL_CACHE"})
    assert _found(tair, instance_id, keys, query_type="QT_BATCH_GET") == 0


def test_int64_above_2_53_round_trips_as_strings(tair):
    instance_id = _instance(tair, location_spec_infos=[{"name": "tp0", "size": "64"}])
    keys = [str((1 << 63) - 1), str(-(1 << 63)), str(BIG), BIG + 2]  # numbers too: JSON holds them
    _write(tair, instance_id, keys)
    meta = tair.call("getCacheMeta", {"instance_id": instance_id, "block_keys": keys, "detail_level": 1})
    assert [json.loads(m)["key"] for m in meta["metas"]] == [int(k) for k in keys]
    assert [json.loads(m)["status"] for m in meta["metas"]] == ["serving"] * 4
    info = tair.call("getInstanceInfo", {"instance_id": instance_id})
    assert info["instance_info"]["location_spec_infos"] == [{"name": "tp0", "size": "64"}]
    group = tair.call("getInstanceGroup", {"name": "default"})["instance_group"]
    assert group["version"] == str(int(group["version"])) and group["quota"]["capacity"] == "0"
    reply = tair.call("getCacheLocation", {"instance_id": instance_id, "query_type": "QT_BATCH_GET",
                                           "block_keys": [str(1 << 63)]}, code="INVALID_ARGUMENT")
    assert "does not fit in int64" in reply["header"]["status"]["message"]


def test_every_query_and_trim_enum_by_name_and_number(tair):
    instance_id = _instance(tair)
    _write(tair, instance_id, [1, 2, 3])
    assert _found(tair, instance_id, [1, 2, 9, 3], "QT_BATCH_GET") == 3
    assert _found(tair, instance_id, [1, 2, 9, 3], 1) == 3
    assert _found(tair, instance_id, [1, 2, 9, 3], "QT_PREFIX_MATCH") == 2
    assert _found(tair, instance_id, [1, 2, 9, 3], 2) == 2
    assert _found(tair, instance_id, [9, 1, 2, 3], "QT_REVERSE_ROLL_SW_MATCH", sw_size=2) == 2
    assert _found(tair, instance_id, [9, 1, 2, 3], 3, sw_size="2") == 2
    for unusable in ("QT_UNSPECIFIED", "QT_PREFIX_MATCH_WITH_MAMBA", "prefix_match", 7):
        tair.call("getCacheLocation", {"instance_id": instance_id, "query_type": unusable, "block_keys": [1]},
                  code="INVALID_ARGUMENT")
    tair.call("trimCache", {"instance_id": instance_id, "strategy": "TS_TIMESTAMP",
                            "begin_timestamp": "0", "end_timestamp": 1})
    assert _found(tair, instance_id, [1, 2, 3]) == 3  # nothing was written before 1 µs
    tair.call("trimCache", {"instance_id": instance_id, "strategy": 3, "begin_timestamp": 1})
    assert _found(tair, instance_id, [1, 2, 3]) == 0
    _write(tair, instance_id, [1, 2, 3])
    tair.call("trimCache", {"instance_id": instance_id, "strategy": "TS_REMOVE_ALL_META"})
    assert _found(tair, instance_id, [1, 2, 3]) == 0
    _write(tair, instance_id, [1])
    tair.call("trimCache", {"instance_id": instance_id, "strategy": 1})
    assert _found(tair, instance_id, [1]) == 0
    tair.call("trimCache", {"instance_id": instance_id, "strategy": "TS_UNSPECIFIED"}, code="INVALID_ARGUMENT")


def test_meta_fields_and_cluster_info(tair, server):
    instance_id = _instance(tair)
    _write(tair, instance_id, [5])
    meta = tair.call("getCacheMeta", {"instance_id": instance_id, "block_keys": [5, 6], "block_mask": {"offset": 0}})
    assert [loc["type"] for loc in meta["locations"]] == ["ST_NFS", "ST_UNSPECIFIED"]
    located = tair.call("getCacheLocation", {"instance_id": instance_id, "query_type": "QT_BATCH_GET",
                                             "block_keys": [5], "location_spec_names": ["tp1"]})
    assert [s["name"] for s in located["locations"][0]["location_specs"]] == ["tp1"]
    info = tair.call("getInstanceInfo", {"instance_id": instance_id})
    assert info["instance_group"] == "default" and info["instance_info"]["instance_group_name"] == "default"
    assert info["instance_info"]["model_deployment"]["tp_size"] == 2
    cluster = tair.call("getClusterInfo", {"trace_id": "leader_discovery_1", "instance_id": instance_id})
    leader = cluster["leader_endpoint"]
    assert cluster["self_node_id"] == cluster["leader_node_id"] == leader["node_id"] != ""
    assert leader["host"] == "127.0.0.1" and leader["meta_http_port"] == server.http_port
    # The same token ids give the same keys as kvcm's own hashing (Tair's chained hash).
    tokens = [str(t) for t in range(1, 9)]
    by_tokens = tair.call("startWriteCache", {"instance_id": instance_id, "token_ids": tokens})
    assert len(by_tokens["locations"]) == 2


# -- errors --------------------------------------------------------------------------------------


def test_error_statuses_by_name_with_http_200(tair):
    instance_id = _instance(tair)
    reply = tair.call("getCacheLocation", {"instance_id": "nobody", "query_type": "QT_PREFIX_MATCH",
                                           "block_keys": [1]}, code="INSTANCE_NOT_EXIST")
    assert "nobody" in reply["header"]["status"]["message"]
    tair.call("registerInstance", {"instance_group": "default", "instance_id": instance_id, "block_size": 8,
                                   "location_spec_infos": [{"name": "tp0", "size": 64}]}, code="DUPLICATE_ENTITY")
    reply = tair.call("getCacheLocation", {"instance_id": instance_id, "query_type": "QT_PREFIX_MATCH",
                                           "block_keys": [1], "block_mask": {"ofset": 1}}, code="INVALID_ARGUMENT")
    assert "unknown field block_mask.ofset (did you mean block_mask.offset?)" in reply["header"]["status"]["message"]
    reply = tair.call("startWriteCache", {"instance_id": instance_id, "block_keys": [1], "shiny": 1},
                      code="INVALID_ARGUMENT")
    assert "unknown field shiny" in reply["header"]["status"]["message"]
    # kvcm's strict validation applies to the translated request, and names kvcm's field.
    reply = tair.call("getCacheLocation", {"instance_id": instance_id, "query_type": "QT_BATCH_GET",
                                           "block_keys": [True]}, code="INVALID_ARGUMENT")
    assert "block_keys[0]" in reply["header"]["status"]["message"]
    reply = tair.call("finishWriteCache", {"instance_id": instance_id, "write_session_id": "nope",
                                           "success_blocks": {"offset": 1}}, code="INVALID_ARGUMENT")
    assert reply["header"]["status"]["message"].startswith("WRITE_SESSION_UNKNOWN: ")
    tair.call("getCacheLocation", {"instance_id": instance_id, "query_type": "QT_PREFIX_MATCH",
                                   "block_keys": [1], "block_mask": {"offset": 1, "bool_masks": {"values": [True]}}},
              code="INVALID_ARGUMENT")
    tair.call("startWriteCache", {"instance_id": instance_id, "block_keys": [1], "min_replica_count": 2},
              code="INVALID_ARGUMENT")
    tair.call("registerInstance", {"instance_group": "default", "instance_id": "eagle", "block_size": 4,
                                   "location_spec_infos": [{"name": "tp0", "size": 64}],
                                   "model_deployment": {"use_eagle_pop": True}}, code="INVALID_ARGUMENT")
    reply = tair.call("checkHealth", {"trace_id": 5}, code="INVALID_ARGUMENT")
    assert "trace_id: expected a string" in reply["header"]["status"]["message"]
    # lowerCamel JSON names are proto3 JSON too
    assert tair.call("getCacheLocationLen", {"instanceId": instance_id, "queryType": "QT_PREFIX_MATCH",
                                             "blockKeys": [1]})["cache_location_len"] == "0"


def test_server_not_leader_and_the_follower_s_leader_endpoint():
    """A follower's SERVER_NOT_LEADER keeps its name; its getClusterInfo names the leader at the
    leader's RPC host and the HTTP port the leader reports (the two-node run is in
    tests/sideport/test_tair_manager_client.py)."""
    exc = Unavailable("node n2 is not the leader", Code.SERVER_NOT_LEADER)
    assert translate.failure(exc, "t")["header"]["status"]["code"] == "SERVER_NOT_LEADER"
    info = {"leader": False, "self_node_id": "n2", "leader_node_id": "n1",
            "leader_endpoint": {"node_id": "n1", "endpoint": "tcp://10.0.0.1:6381", "leader": True}}
    asked = []

    def ask(endpoint):
        asked.append(endpoint)
        return {"self": {"http_port": 7382}}

    ctx = translate.Context(http_port=6382, admin_port=None, local_host="10.0.0.2", ask=ask)
    assert translate.leader_endpoint(info, ctx) == {"node_id": "n1", "host": "10.0.0.1", "meta_rpc_port": 6381,
                                                    "meta_http_port": 7382, "custom_info": ""}
    assert asked == ["tcp://10.0.0.1:6381"]
    silent = translate.Context(http_port=6382, admin_port=None, local_host="10.0.0.2")
    assert translate.leader_endpoint(info, silent)["meta_http_port"] == 6382
    assert translate.leader_endpoint({"leader": False, "leader_node_id": ""}, ctx) is None


def test_every_kvcm_code_has_a_tair_name():
    tair_names = {"OK", "UNSUPPORTED", "INTERNAL_ERROR", "SERVICE_NOT_READY", "INVALID_ARGUMENT", "DUPLICATE_ENTITY",
                  "REACH_MAX_ENTITY_CAPACITY", "INSTANCE_NOT_EXIST", "SERVER_NOT_LEADER", "IO_ERROR"}
    assert set(translate.TAIR_CODES) == set(Code)
    assert set(translate.TAIR_CODES.values()) <= tair_names
    assert all(translate.TAIR_CODES[Code[name]] == name for name in tair_names)


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"instance_id": ', b"\xff\xfe"])
def test_a_body_that_does_not_parse_is_400_with_an_empty_object(server, body):
    reply = requests.post(f"http://127.0.0.1:{server.http_port}/api/getCacheLocation", data=body,
                          headers=HEADERS, timeout=10)
    assert reply.status_code == 400 and reply.json() == {}


def test_the_leader_elector_rpcs_on_a_single_node(tair):
    assert tair.call("getLeaderElectorConfig", {"trace_id": "x"})["campaign_delay_time_ms"] == "5000"
    tair.call("updateLeaderElectorConfig", {"trace_id": "x", "campaign_delay_time_ms": "10"})
    assert tair.call("getLeaderElectorConfig", {})["campaign_delay_time_ms"] == "10"  # int64 as a string
    tair.call("updateLeaderElectorConfig", {"campaign_delay_time_ms": 5000})  # numbers accepted too
    bad = tair.call("updateLeaderElectorConfig", {"campaign_delay_time_ms": "-1"}, code="INVALID_ARGUMENT")
    assert "campaign_delay_time_ms" in bad["header"]["status"]["message"]
    # leaderDemote stops this shared server leading for a while: tests/node/test_demote_single.py


def test_unknown_and_unsupported_rpcs(tair):
    for name in ("updateLogger", "migrateCache"):
        reply = tair.call(name, {"trace_id": "x"}, code="UNSUPPORTED")
        assert reply["header"]["status"]["message"].startswith(f"{name}: not supported by kvcm")
    reply = tair.raw("noSuchRpc", {})
    assert reply.status_code == 404 and reply.json()["header"]["status"]["code"] == "UNSUPPORTED"
    # kvcm's own routes are untouched next to Tair's
    own = requests.post(tair.url + "get_instance_info", json={"instance_id": "nobody"}, timeout=10)
    assert own.status_code == 404 and own.json()["error"]["name"] == "INSTANCE_NOT_EXIST"


# -- the admin service -----------------------------------------------------------------------------


def _storages(tair: Tair) -> dict[str, dict]:
    return {s["global_unique_name"]: s for s in tair.call("listStorage", {})["storage"]}


def test_storages_of_every_type_both_ways(tair):
    root = tempfile.mkdtemp(prefix="kvcm-tair-")
    tag = uuid.uuid4().hex[:6]
    configs = {
        f"nfs-{tag}": {"nfs": {"root_path": os.path.join(root, "nfs"), "key_count_per_file": 8},
                       "storage_type": "ST_NFS"},
        f"3fs-{tag}": {"threefs": {"mountpoint": "/3fs/stage", "root_dir": "kv", "key_count_per_file": "4"},
                       "storage_type": 1},
        f"vcns-{tag}": {"vcnsthreefs": {"mountpoint": "/3fs/vcns", "root_dir": "kv"}, "storage_type": "ST_VCNS_3FS"},
        f"mc-{tag}": {"mooncake": {"protocol": "tcp", "master_service_entry": "10.0.0.9:50051"},
                      "storage_type": "ST_MOONCAKE"},
        f"pace-{tag}": {"tair_mem_pool": {"domain": "pace.example", "timeout": 200, "media_type": 2},
                        "storage_type": "ST_TAIRMEMPOOL"},
        f"ssd-{tag}": {"tair_mem_pool": {"domain": "pace.example", "media_type": 5}, "storage_type": "ST_TAIRMEMPOOL_SSD"},
        f"shm-{tag}": {"shm": {"segment_size": str(1 << 20), "prefix": f"kvcm.tair{tag}."}, "storage_type": "ST_KVCM_SHM"},
    }
    for name, config in configs.items():
        tair.call("addStorage", {"trace_id": name, "storage": {"global_unique_name": name, **config}})
    listed = _storages(tair)
    assert listed[f"nfs-{tag}"] == {"global_unique_name": f"nfs-{tag}", "storage_type": "ST_NFS",
                                    "nfs": {"root_path": os.path.join(root, "nfs"), "key_count_per_file": 8},
                                    "check_storage_available_when_open": False}
    assert listed[f"3fs-{tag}"]["threefs"]["key_count_per_file"] == 4
    assert listed[f"vcns-{tag}"]["storage_type"] == "ST_3FS"  # kvcm keeps one 3FS type
    assert listed[f"mc-{tag}"]["mooncake"]["master_service_entry"] == "10.0.0.9:50051"
    # Every field of a spec member printed, those not given at their defaults.
    assert set(listed[f"mc-{tag}"]["mooncake"]) == {"local_hostname", "metadata_connstring", "protocol",
                                                    "rdma_device", "master_service_entry"}
    assert listed[f"vcns-{tag}"]["threefs"]["cluster_name"] == ""
    assert set(listed[f"vcns-{tag}"]["threefs"]) == {"cluster_name", "mountpoint", "root_dir", "key_count_per_file",
                                                     "touch_file_when_create"}
    assert listed[f"pace-{tag}"]["tair_mem_pool"] == {"domain": "pace.example", "timeout": 200, "media_type": 2,
                                                       "service_discovery_url": ""}
    assert listed[f"ssd-{tag}"]["tair_mem_pool"]["media_type"] == 5
    assert listed[f"shm-{tag}"]["storage_type"] == "ST_KVCM_SHM"
    assert listed[f"shm-{tag}"]["shm"]["segment_size"] == 1 << 20
    tair.call("addStorage", {"storage": {"global_unique_name": f"nfs-{tag}", **configs[f"nfs-{tag}"]}},
              code="DUPLICATE_ENTITY")
    for bad in ({"dummy": {"root_path": "/x"}}, {"nfs": {"root_path": "/x"}, "threefs": {"root_dir": "x"}},
                {"nfs": {"root_path": "/x"}, "storage_type": "ST_MOONCAKE"}, {"nfs": {"rootpath": "/x"}},
                {"nfs": {"root_path": "/x"}, "storage_type": "ST_DUMMY"}):
        tair.call("addStorage", {"storage": {"global_unique_name": f"bad-{tag}", **bad}}, code="INVALID_ARGUMENT")
    tair.call("disableStorage", {"storage_unique_name": f"mc-{tag}"})
    tair.call("enableStorage", {"storage_unique_name": f"mc-{tag}"})
    tair.call("updateStorage", {"storage": {"global_unique_name": f"nfs-{tag}", "storage_type": "ST_NFS",
                                            "nfs": {"root_path": os.path.join(root, "nfs2")}}, "force_update": True})
    assert _storages(tair)[f"nfs-{tag}"]["nfs"]["root_path"] == os.path.join(root, "nfs2")
    for name in configs:
        tair.call("removeStorage", {"storage_unique_name": name})
    assert not set(configs) & set(_storages(tair))
    tair.call("removeStorage", {"storage_unique_name": f"nfs-{tag}"}, code="INVALID_ARGUMENT")


def test_instance_groups_with_tair_s_nested_cache_config(tair):
    name = f"g-{uuid.uuid4().hex[:6]}"
    group = {"name": name, "storage_candidates": ["default-file"], "global_quota_group_name": "q",
             "max_instance_count": "10", "user_data": "ud",
             "quota": {"capacity": str(1 << 40), "quota_config": [{"storage_type": "ST_NFS", "capacity": "1024"}]},
             "cache_config": {"reclaim_strategy": {"reclaim_policy": "POLICY_LFU",
                                                   "trigger_strategy": {"used_percentage": 0.8, "used_size": "0"},
                                                   "trigger_period_seconds": 60, "reclaim_step_percentage": 10,
                                                   "delay_before_delete_ms": 500},
                              "data_storage_strategy": "CPS_PREFER_3FS"}}
    tair.call("createInstanceGroup", {"instance_group": group})
    got = tair.call("getInstanceGroup", {"name": name})["instance_group"]
    assert got["quota"] == {"capacity": str(1 << 40), "quota_config": [{"storage_type": "ST_NFS", "capacity": "1024"}]}
    assert got["max_instance_count"] == "10" and got["version"] == "1"
    # Every field printed; the schedule's fields kvcm accepts and does not keep print their defaults.
    assert got["cache_config"]["reclaim_strategy"] == {
        "storage_unique_name": "", "reclaim_policy": "POLICY_LFU",
        "trigger_strategy": {"used_size": "0", "used_percentage": 0.8}, "trigger_period_seconds": 0,
        "reclaim_step_size": 0, "reclaim_step_percentage": 0, "delay_before_delete_ms": 500}
    for policy, number in (("POLICY_TTL", 3), ("POLICY_LRU", 1)):
        version = tair.call("getInstanceGroup", {"name": name})["instance_group"]["version"]
        tair.call("updateInstanceGroup", {"current_version": version, "instance_group": {
            "name": name, "cache_config": {"reclaim_strategy": {"reclaim_policy": number, "ttl_seconds": 60}}}})
        assert tair.call("getInstanceGroup", {"name": name})["instance_group"]["cache_config"][
            "reclaim_strategy"]["reclaim_policy"] == policy
    stale = {"current_version": "1", "instance_group": {"name": name, "user_data": "x"}}
    reply = tair.call("updateInstanceGroup", stale, code="INVALID_ARGUMENT")
    assert reply["header"]["status"]["message"].startswith("VERSION_CONFLICT: ")
    used_size = {"name": f"{name}-b", "storage_candidates": ["default-file"],
                 "cache_config": {"reclaim_strategy": {"trigger_strategy": {"used_size": 100}}}}
    tair.call("createInstanceGroup", {"instance_group": used_size})  # tests/reclaimer/test_tair_triggers.py
    assert name in {g["name"] for g in tair.call("listInstanceGroup", {})["instance_group"]}
    tair.call("createInstanceGroup", {"instance_group": group}, code="DUPLICATE_ENTITY")
    tair.call("removeInstanceGroup", {"name": name})
    tair.call("getInstanceGroup", {"name": name}, code="INVALID_ARGUMENT")


def test_instances_accounts_snapshots_metrics_health(tair):
    instance_id = _instance(tair)
    listed = tair.call("listInstanceInfo", {"instance_group_name": "default"})["instance_info"]
    assert instance_id in {i["instance_id"] for i in listed}
    assert tair.call("listInstanceInfo", {})["instance_info"]
    tair.call("removeInstance", {"instance_group": "default", "instance_id": instance_id})
    tair.call("getInstanceInfo", {"instance_id": instance_id}, code="INSTANCE_NOT_EXIST")
    user = f"u{uuid.uuid4().hex[:6]}"
    tair.call("addAccount", {"user_name": user, "password": "a-long-password-1", "role": "ROLE_USER"})
    tair.call("addAccount", {"user_name": user + "a", "password": "a-long-password-1", "role": 1})
    accounts = {a["user_name"]: a["role"] for a in tair.call("listAccount", {})["accounts"]}
    assert accounts[user] == "ROLE_USER" and accounts[user + "a"] == "ROLE_ADMIN"
    tair.call("addAccount", {"user_name": user, "password": "a-long-password-1"}, code="DUPLICATE_ENTITY")
    tair.call("addAccount", {"user_name": "x" + user, "password": "a-long-password-1", "role": "ROLE_ROOT"},
              code="INVALID_ARGUMENT")
    tair.call("deleteAccount", {"user_name": user})
    last = tair.call("deleteAccount", {"user_name": user + "a"}, code="INVALID_ARGUMENT")
    assert last["header"]["status"]["message"].startswith("STILL_REFERENCED: ")  # kvcm keeps one admin
    snapshot = tair.call("genConfigSnapshot", {})["config_snapshot"]
    assert isinstance(snapshot, str) and json.loads(snapshot)["storages"]
    tair.call("loadConfigSnapshot", {"config_snapshot": snapshot})
    tair.call("loadConfigSnapshot", {"config_snapshot": "{not json"}, code="INVALID_ARGUMENT")
    metrics = tair.call("getMetrics", {})
    assert int(metrics["timestamp"]) > 0
    requests_total = [m for m in metrics["metrics"] if m["metric_name"] == "kvcm_rpc_requests_total"]
    assert requests_total and all(set(m["metric_value"]) <= {"int_value", "float_value"} for m in requests_total)
    assert {"tag_key": "method", "tag_value": "list_account"} in [t for m in requests_total for t in m["metric_tags"]]
    health = tair.call("checkHealth", {})
    assert health["is_leader"] is True and health["is_health"] is True
    cluster = tair.call("getManagerClusterInfo", {})
    endpoint = cluster["leader_endpoint"]
    assert endpoint["admin_http_port"] == endpoint["meta_http_port"]  # no admin port: one port serves both
    assert int(cluster["info_updated_time"]) > 0 and cluster["self_leader_expiration_time"] == "0"


def test_admin_copies_of_get_cache_meta_remove_cache_and_register(tair):
    instance_id = f"i-{uuid.uuid4().hex[:8]}"
    reply = tair.call("registerInstance", {"instance_group": "default", "instance_id": instance_id, "block_size": 4,
                                           "location_spec_infos": [{"name": "tp0", "size": 64}]})
    storages = json.loads(reply["storage_configs"])
    assert storages[0]["storage_type"] == "ST_NFS" and "nfs" in storages[0]
    _write(tair, instance_id, [7, 8])
    tair.call("removeCache", {"instance_id": instance_id, "block_keys": [7, 8], "block_mask": {"offset": 1}})
    meta = tair.call("getCacheMeta", {"instance_id": instance_id, "block_keys": [7, 8]})
    assert [json.loads(m)["status"] for m in meta["metas"]] == ["serving", "deleting"]


# -- the admin port ----------------------------------------------------------------------------------


def test_admin_port_serves_admin_routes_only_and_the_side_port_meta_only():
    with serve_in_thread(overrides={"http": {"admin_port": 0}}) as server:
        admin_port = server.app.http.admin_port
        assert admin_port and admin_port != server.http_port
        meta, admin = Tair(server.http_port), Tair(admin_port)
        assert admin.call("listStorage", {})["storage"]
        reply = meta.raw("listStorage", {})
        assert reply.status_code == 404 and "admin port" in reply.json()["header"]["status"]["message"]
        reply = admin.raw("getCacheLocation", {"instance_id": "x", "query_type": "QT_BATCH_GET"})
        assert reply.status_code == 404
        # The four shared names take each service's shapes: the admin getInstanceInfo has no instance_group.
        admin.call("registerInstance", {"instance_group": "default", "instance_id": "a1", "block_size": 4,
                                        "location_spec_infos": [{"name": "tp0", "size": 64}]})
        assert "instance_group" not in admin.call("getInstanceInfo", {"instance_id": "a1"})
        assert meta.call("getInstanceInfo", {"instance_id": "a1"})["instance_group"] == "default"
        endpoint = admin.call("getManagerClusterInfo", {})["leader_endpoint"]
        assert (endpoint["meta_http_port"], endpoint["admin_http_port"]) == (server.http_port, admin_port)
        # Only /api/<TairName> on the admin port: not kvcm's own routes, probes or metrics.
        assert requests.post(admin.url + "list_storage", json={}, timeout=10).status_code == 404
        assert requests.get(f"http://127.0.0.1:{admin_port}/metrics", timeout=10).status_code == 404
        assert requests.get(f"http://127.0.0.1:{server.http_port}/livez", timeout=10).status_code == 200
        # The port's browser protections hold on the admin port too.
        foreign = requests.post(admin.url + "listStorage", json={}, headers={"Origin": "http://evil.example"},
                                timeout=10)
        assert foreign.status_code == 403


# -- URIs in Tair's form ----------------------------------------------------------------------------


def _own(server, method: str, params: dict) -> dict:
    """kvcm's own route on the same port (kvcm's JSON, kvcm's URIs)."""
    reply = requests.post(f"http://127.0.0.1:{server.http_port}/api/{method}", json=params, timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()["result"]


def _tier(tair: Tair, kind: str, spec: dict) -> tuple[str, str, str]:
    """A storage of its own group and an instance of that group: (storage, group, instance)."""
    tag = uuid.uuid4().hex[:6]
    storage, group, instance_id = f"{kind}-{tag}", f"g-{tag}", f"i-{tag}"
    tair.call("addStorage", {"storage": {"global_unique_name": storage, kind: spec}})
    tair.call("createInstanceGroup", {"instance_group": {"name": group, "storage_candidates": [storage]}})
    tair.call("registerInstance", {"instance_group": group, "instance_id": instance_id, "block_size": 4,
                                   "location_spec_infos": [{"name": "tp0", "size": 64}]})
    return storage, group, instance_id


def _drop(tair: Tair, storage: str, group: str, instance_id: str) -> None:
    tair.call("trimCache", {"instance_id": instance_id, "strategy": "TS_REMOVE_ALL_META"})
    tair.call("removeInstance", {"instance_group": group, "instance_id": instance_id})
    tair.call("removeInstanceGroup", {"name": group})
    tair.call("removeStorage", {"storage_unique_name": storage})


def _split(uri: str) -> tuple[str, str, dict[str, int]]:
    """(scheme://host, path, numeric params) of a URI in the unescaped form both sides use."""
    scheme, _, rest = uri.partition("://")
    base, _, query = rest.partition("?")
    host, slash, path = base.partition("/")
    return f"{scheme}://{host}", slash + path, {k: int(v) for k, v in (p.split("=") for p in query.split("&"))}


@pytest.mark.parametrize("kind", ["nfs", "shm"])
def test_file_and_shm_uris_name_the_whole_path_and_the_same_bytes(tair, server, kind):
    root = tempfile.mkdtemp(prefix="kvcm-tair-uri-")
    spec = {"root_path": root} if kind == "nfs" else {"shm_dir": root, "segment_size": 1 << 16}
    storage, group, instance_id = _tier(tair, kind, spec)
    started = tair.call("startWriteCache", {"instance_id": instance_id, "block_keys": [1, 2]})
    tair_uris = [loc["location_specs"][0]["uri"] for loc in started["locations"]]
    for i, uri in enumerate(tair_uris):  # as Tair's reader does: the path as it is, no root joined
        _, path, params = _split(uri)
        assert path.startswith(root + "/"), uri
        with open(path, "r+b") as f:
            f.seek(params.get("offset", params.get("blkid", 0) * params["size"]))
            f.write(bytes([i + 1]) * params["size"])
    tair.call("finishWriteCache", {"instance_id": instance_id, "write_session_id": started["write_session_id"],
                                   "success_blocks": {"offset": 2}, "locations": started["locations"]})
    own = _own(server, "get_cache_location", {"instance_id": instance_id, "query_type": "batch_get", "block_keys": [1, 2]})
    kvcm_uris = [loc["location_specs"][0]["uri"] for loc in own["locations"]]
    with Client(server.endpoint, timeout=5.0) as kv:
        blocks = BlockIO.for_instance(kv, instance_id)
        try:
            for i, (tair_uri, kvcm_uri) in enumerate(zip(tair_uris, kvcm_uris)):
                host, path, _ = _split(kvcm_uri)
                assert host == f"{'file' if kind == 'nfs' else 'shm'}://{storage}"
                assert tair_uri == host + root + kvcm_uri[len(host):]  # the directory, joined once
                assert bytes(blocks.read(kvcm_uri)) == bytes([i + 1]) * 64
        finally:
            blocks.close()
    # getCacheMeta's locations, and every copy's location at detail_level 2, are Tair's too
    meta = tair.call("getCacheMeta", {"instance_id": instance_id, "block_keys": [1, 2], "detail_level": 2})
    assert [loc["location_specs"][0]["uri"] for loc in meta["locations"]] == tair_uris
    assert [json.loads(m)["all"][0]["location"]["location_specs"][0]["uri"] for m in meta["metas"]] == tair_uris
    _drop(tair, storage, group, instance_id)


def test_uris_coming_back_must_name_a_block_under_the_storage_s_root(tair):
    root = tempfile.mkdtemp(prefix="kvcm-tair-uri-")
    storage, group, instance_id = _tier(tair, "nfs", {"root_path": root})
    started = tair.call("startWriteCache", {"instance_id": instance_id, "block_keys": [1]})
    good = started["locations"][0]["location_specs"][0]["uri"]
    host, path, _ = _split(good)
    query = good.partition("?")[2]
    bad = {
        "outside the root": f"{host}/etc/passwd?{query}",
        "a sibling sharing the prefix": f"{host}{root}x{path[len(root):]}?{query}",
        "dot-dot out of the root": f"{host}{root}/../x/{path.rsplit('/', 1)[1]}?{query}",
        "not a file kvcm names": f"{host}{root}/s64/other.kv?{query}",
        "kvcm's relative form": f"{host}{path[len(root):]}?{query}",
        "an unknown storage": good.replace(storage, "nobody", 1),
        "a file URI naming a shm storage": good.replace("file://", "shm://", 1),
    }
    for why, uri in bad.items():
        location = {**started["locations"][0], "location_specs": [{"name": "tp0", "uri": uri}]}
        reply = tair.call("finishWriteCache", {"instance_id": instance_id, "write_session_id": started["write_session_id"],
                                               "success_blocks": {"offset": 1}, "locations": [location]},
                          code="INVALID_ARGUMENT")
        assert "locations[0].location_specs[0].uri" in reply["header"]["status"]["message"], why
    tair.call("finishWriteCache", {"instance_id": instance_id, "write_session_id": started["write_session_id"],
                                   "success_blocks": {"offset": 1}, "locations": [{"spec_size": 1, "bogus": 1}]},
              code="INVALID_ARGUMENT")
    # the refusals left the session alone: the good URIs finish it
    tair.call("finishWriteCache", {"instance_id": instance_id, "write_session_id": started["write_session_id"],
                                   "success_blocks": {"offset": 1}, "locations": started["locations"]})
    assert _found(tair, instance_id, [1]) == 1
    _drop(tair, storage, group, instance_id)


def test_a_moved_root_shows_in_the_next_reply(tair):
    root = tempfile.mkdtemp(prefix="kvcm-tair-uri-")
    storage, group, instance_id = _tier(tair, "nfs", {"root_path": os.path.join(root, "a")})
    first = tair.call("startWriteCache", {"instance_id": instance_id, "block_keys": [1]})
    assert _split(first["locations"][0]["location_specs"][0]["uri"])[1].startswith(os.path.join(root, "a") + "/")
    tair.call("finishWriteCache", {"instance_id": instance_id, "write_session_id": first["write_session_id"],
                                   "success_blocks": {"offset": 0}})
    tair.call("updateStorage", {"storage": {"global_unique_name": storage, "nfs": {"root_path": os.path.join(root, "b")}}})
    second = tair.call("startWriteCache", {"instance_id": instance_id, "block_keys": [2]})
    assert _split(second["locations"][0]["location_specs"][0]["uri"])[1].startswith(os.path.join(root, "b") + "/")
    tair.call("finishWriteCache", {"instance_id": instance_id, "write_session_id": second["write_session_id"],
                                   "success_blocks": {"offset": 0}})
    _drop(tair, storage, group, instance_id)


def test_roots_expire_and_an_unknown_name_asks_once_per_call():
    now = [0.0]
    asked: list[str] = []
    specs = {"storages": [{"global_unique_name": "n", "storage_type": "file", "storage_spec": {"root_path": "/r/"}}]}

    def fetch(method: str) -> dict:
        asked.append(method)
        return specs if method == "get_storage_specs" else {"storage": []}

    roots = Roots(ttl_s=2.0, clock=lambda: now[0])
    uri = "file://n/s64/0000000a-00000000.kv?blkid=1&size=64"
    assert roots.translator(fetch).out(uri) == "file://n/r/s64/0000000a-00000000.kv?blkid=1&size=64"
    assert roots.translator(fetch).out(uri).startswith("file://n/r/") and asked == ["get_storage_specs"]
    now[0] = 2.5  # expired: asked again
    roots.translator(fetch).out(uri)
    assert asked == ["get_storage_specs"] * 2
    translator = roots.translator(fetch)
    for _ in range(3):  # a name no storage has: one refresh per call, then INTERNAL_ERROR, never kvcm's form
        with pytest.raises(ServerError, match="'m'"):
            translator.out("file://m/s64/0000000a-00000000.kv?blkid=1&size=64")
    assert asked == ["get_storage_specs"] * 3 + ["list_storage"]
    assert translator.out("pace://p/4096?media_type=dram&node_id=1&range_id=2&size=64").startswith("pace://p/4096")


# -- auth on --------------------------------------------------------------------------------------


ADMIN_PW = "Tair-admin-passw0rd"


def _status(reply: requests.Response) -> dict:
    assert reply.status_code == 200, reply.text  # Tair's client reads the header's status, not HTTP's
    return reply.json()["header"]["status"]


def test_auth_on_a_user_s_token_saves_and_loads_and_nothing_else_gets_in():
    """``auth.enabled``: a connector holding a data-plane user's token (``Authorization: Bearer``)
    does a save and load with Tair's URIs (the directories asked with its own credentials, which
    cannot call ``list_storage``); no credentials and an admin RPC are refused, by kvcm's name."""
    with serve_in_thread(overrides={"auth": {"enabled": True, "admin_password": ADMIN_PW}}) as server:
        admin = {"user": "admin", "password": ADMIN_PW}
        anonymous = Tair(server.http_port)
        anonymous.call("addAccount", {"user_name": "connector", "password": "Connector-passw0rd", "role": "ROLE_USER",
                                      "auth": admin})  # kvcm's body credentials, on Tair's route too
        with server.client(auth=admin) as kv:
            token = kv.call("add_token", {"user_name": "connector", "name": "vllm"})["token"]
        user = Tair(server.http_port)
        user.session.headers["Authorization"] = f"Bearer {token}"
        try:
            registered = user.call("registerInstance", {"instance_group": "default", "instance_id": "llm",
                                                        "block_size": 4, "location_spec_infos": [{"name": "tp0", "size": 64}]})
            (root,) = [s["nfs"]["root_path"] for s in json.loads(registered["storage_configs"])]
            started = user.call("startWriteCache", {"instance_id": "llm", "block_keys": [str(BIG), "2"]})
            for i, loc in enumerate(started["locations"]):
                _, path, query = _split(loc["location_specs"][0]["uri"])
                assert path.startswith(root.rstrip("/") + "/"), loc  # Tair's whole path, never kvcm's relative one
                with open(path, "r+b") as f:
                    f.seek(int(query["blkid"]) * int(query["size"]))
                    f.write(bytes([i + 1]) * int(query["size"]))
            user.call("finishWriteCache", {"instance_id": "llm", "write_session_id": started["write_session_id"],
                                           "success_blocks": {"offset": 2}, "locations": started["locations"]})
            found = user.call("getCacheLocation", {"instance_id": "llm", "query_type": "QT_PREFIX_MATCH",
                                                   "block_keys": [str(BIG), "2", "3"]})
            assert len(found["locations"]) == 2
            for i, loc in enumerate(found["locations"]):  # what the connector wrote, read where Tair's URI says
                _, path, query = _split(loc["location_specs"][0]["uri"])
                with open(path, "rb") as f:
                    f.seek(int(query["blkid"]) * int(query["size"]))
                    assert f.read(int(query["size"])) == bytes([i + 1]) * int(query["size"])
            # An admin RPC with a user's token: PERMISSION_DENIED by name.
            status = _status(user.raw("listStorage", {}))
            assert status["code"] == "INVALID_ARGUMENT" and status["message"].startswith("PERMISSION_DENIED: "), status
            # No credentials, or a token that is not one: UNAUTHENTICATED by name, in Tair's reply. A
            # bad Authorization header is refused before the body is read, so its trace_id is unknown.
            for headers, read in (({}, True), ({"Authorization": "Bearer not-a-real-token"}, False),
                                  ({"Authorization": "Basic eDp5"}, False)):
                reply = anonymous.session.post(anonymous.url + "getCacheLocation", headers={**HEADERS, **headers},
                                               data=json.dumps({"trace_id": "t", "instance_id": "llm",
                                                                "query_type": "QT_PREFIX_MATCH", "block_keys": ["2"]}))
                status = _status(reply)
                assert status["code"] == "INVALID_ARGUMENT" and status["message"].startswith("UNAUTHENTICATED: "), \
                    (headers, status)
                assert reply.json()["header"]["request_id"].startswith("t_" if read else "_"), (headers, reply.json())
                assert "locations" not in reply.json()
            # The refusals kept the connection usable: the user's next call is served.
            assert len(user.call("getCacheLocation", {"instance_id": "llm", "query_type": "QT_BATCH_GET",
                                                      "block_keys": ["2"]})["locations"]) == 1
        finally:
            user.session.close()
            anonymous.session.close()


def test_a_storage_the_group_no_longer_lists_is_a_clear_error_for_a_non_admin():
    """``list_storage`` is admin-only with auth on: a location on a storage the caller's group no
    longer lists has no Tair form for a user, and says why, never kvcm's relative URI."""
    def fetch(method: str) -> dict:
        if method == "list_storage":
            raise AccessDenied("list_storage needs the admin role", Code.PERMISSION_DENIED)
        return {"storages": []}

    with pytest.raises(ServerError, match=r"'old'.*list_storage: PERMISSION_DENIED.*no Tair form"):
        Roots().translator(fetch).out("file://old/s64/0000000a-00000000.kv?blkid=1&size=64")
