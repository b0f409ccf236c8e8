"""Tair KVCM's ReportEvent and GetHostCacheState on kvcm's Tair HTTP/JSON surface, driven by a plain
``requests`` client written from Tair's meta_service.proto: a reporter registers, adds and deletes
blocks, snapshots and goes down, and both ``getHostCacheState`` and kvcm's own ``match_engines``
(msgpack-RPC) see exactly what it holds, per host."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from kvcm.errors import Code, KvcmError
from kvcm.testing import RunningServer, serve_in_thread

BIG = (1 << 53) + 1  # the first integer a double cannot hold
KEYS = [str(BIG), str(BIG + 1), "-5", "7", "8"]  # int64 as Tair prints them, one negative
HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}
ADMIN_PW = "Tair-report-passw0rd"
L2 = "ST_EVENT_REPORT_L2"


class Tair:
    """POST /api/<lowerCamelName> with proto3 JSON, as Tair's clients do."""

    def __init__(self, port: int, token: str | None = None) -> None:
        self.url = f"http://127.0.0.1:{port}/api/"
        self.session = requests.Session()
        if token is not None:
            self.session.headers["Authorization"] = f"Bearer {token}"

    def call(self, method: str, body: object, code: str = "OK") -> dict[str, Any]:
        reply = self.session.post(self.url + method, data=json.dumps(body), headers=HEADERS, timeout=10)
        assert reply.status_code == 200, (method, reply.status_code, reply.text)
        data: dict[str, Any] = reply.json()
        status = data["header"]["status"]
        assert status["code"] == code, (method, status)
        return data

    def report(self, instance_id: str, host: str, events: list[dict[str, Any]], code: str = "OK",
               storage_type: object = L2, **extra: Any) -> dict[str, Any]:
        return self.call("reportEvent", {"trace_id": "r", "instance_id": instance_id, "host_ip_port": host,
                                         "storage_type": storage_type, "events": events, **extra}, code)

    def hosts(self, instance_id: str, keys: list[Any], **extra: Any) -> dict[str, dict[str, Any]]:
        reply = self.call("getHostCacheState", {"trace_id": "h", "instance_id": instance_id,
                                                "query_type": "QT_PREFIX_MATCH", "block_cache_keys": keys, **extra})
        return {h["host_ip_port"]: h for h in reply["hosts"]}

    def local(self, instance_id: str, keys: list[Any], **extra: Any) -> dict[str, str]:
        return {host: h["local"] for host, h in self.hosts(instance_id, keys, **extra).items()}


def register() -> dict[str, Any]:
    return {"event_type": "EVENT_NODE_REGISTER", "node_register": {"mediums": ["hbm", "mem"]}}


def add(key: str, medium: str = "hbm") -> dict[str, Any]:
    return {"event_type": "EVENT_BLOCK_ADD",
            "block_add": {"block_key": key, "medium": medium, "specs": [{"name": "tp0", "uri": f"rtp://h/{key}"}]}}


def delete(key: str, medium: str = "hbm") -> dict[str, Any]:
    return {"event_type": "EVENT_BLOCK_DELETE", "block_delete": {"block_key": key, "medium": medium,
                                                                 "spec_names": ["tp0"]}}


def snapshot(keys: list[str], medium: str = "hbm") -> dict[str, Any]:
    return {"event_type": "EVENT_BLOCK_SNAPSHOT", "block_snapshot": {
        "blocks": [{"block_key": k, "medium": medium, "specs": [{"name": "tp0", "uri": "u"}]} for k in keys]}}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread() as running:
        yield running


@pytest.fixture
def tair(server: RunningServer) -> Iterator[Tair]:
    client = Tair(server.http_port)
    yield client
    client.session.close()


def _instance(tair: Tair) -> str:
    instance_id = f"i-{uuid.uuid4().hex[:8]}"
    tair.call("registerInstance", {"instance_group": "default", "instance_id": instance_id, "block_size": 4,
                                   "location_spec_infos": [{"name": "tp0", "size": "64"}]})
    return instance_id


def _sources(server: RunningServer, instance_id: str) -> dict[str, dict[str, Any]]:
    with server.client() as kv:
        listed = kv.call("list_event_sources", {"instance_id": instance_id})["sources"]
    return {s["source_id"]: s for s in listed}


def test_registered_blocks_are_seen_per_host_by_get_host_cache_state_and_match_engines(tair, server):
    instance_id = _instance(tair)
    for host in ("10.0.0.1:80", "10.0.0.2:80"):
        reply = tair.report(instance_id, host, [register()])
        assert reply["snapshot_required"] is False and reply["item_results"] == [] and reply["retry_after_ms"] == "0"
        assert reply["header"]["request_id"].startswith("r_")
    tair.report(instance_id, "10.0.0.1:80", [add(k) for k in KEYS[:3]])
    tair.report(instance_id, "10.0.0.2:80", [add(KEYS[0], "mem")])
    hosts = tair.hosts(instance_id, KEYS)
    assert hosts["10.0.0.1:80"] == {"host_ip_port": "10.0.0.1:80", "local": "3", "p2p_1_fetch": "0",
                                    "p2p_1_total_match": "3"}
    assert hosts["10.0.0.2:80"] == {"host_ip_port": "10.0.0.2:80", "local": "1", "p2p_1_fetch": "2",
                                    "p2p_1_total_match": "3"}
    # Tair's medium filter, in Tair's lower-case spelling
    assert tair.local(instance_id, KEYS, medium=["mem"]) == {"10.0.0.1:80": "0", "10.0.0.2:80": "1"}
    # kvcm's own match_engines over msgpack-RPC sees the same source, keyed by the very block keys
    with server.client() as kv:
        reply = kv.call("match_engines", {"instance_id": instance_id, "block_keys": [int(k) for k in KEYS]})
    best = {s["source_id"]: s for s in reply["sources"]}[f"tair/{instance_id}/L2/10.0.0.1:80"]
    assert (best["matched_blocks"], best["media"], best["pod"]) == (3, {"HBM": 3}, "10.0.0.1:80")
    assert {p["pod"] for p in reply["pods"]} == {"10.0.0.1:80", "10.0.0.2:80"}


def test_delete_removes_and_a_repeated_add_is_one_holding(tair):
    instance_id = _instance(tair)
    host = "h:1"
    tair.report(instance_id, host, [register()])
    tair.report(instance_id, host, [add(k) for k in KEYS[:3]] + [add(KEYS[0])])  # the first key twice
    tair.report(instance_id, host, [delete(KEYS[1])])
    assert tair.local(instance_id, KEYS) == {host: "1"}
    tair.report(instance_id, host, [delete(KEYS[0]), delete(KEYS[0], "mem")])  # absent on mem: a no-op
    assert tair.local(instance_id, KEYS) == {host: "0"}
    assert tair.local(instance_id, KEYS[2:]) == {host: "1"}
    # adds and deletes of one call apply in order
    tair.report(instance_id, host, [add(KEYS[0]), add(KEYS[1]), delete(KEYS[1]), add(KEYS[1])])
    assert tair.local(instance_id, KEYS) == {host: "3"}


def test_a_snapshot_replaces_what_the_host_held(tair):
    instance_id = _instance(tair)
    host = "h:2"
    tair.report(instance_id, host, [register()])
    tair.report(instance_id, host, [add(k) for k in KEYS[:3]])
    reply = tair.report(instance_id, host, [snapshot(KEYS[3:])])
    assert reply["snapshot_required"] is False
    assert tair.local(instance_id, KEYS) == {host: "0"}
    assert tair.local(instance_id, KEYS[3:]) == {host: "2"}
    legacy = {"event_type": "EVENT_BLOCK_SNAPSHOT",
              "block_snapshot": {"medium": "mem", "blocks": [{"block_key": KEYS[0]}]}}  # the deprecated medium
    tair.report(instance_id, host, [legacy])
    assert tair.local(instance_id, KEYS, medium=["MEM"]) == {host: "1"}
    assert tair.local(instance_id, KEYS[3:]) == {host: "0"}
    tair.report(instance_id, host, [snapshot([])])  # empty: the host holds nothing
    assert tair.local(instance_id, KEYS) == {host: "0"}


def test_host_down_drops_the_source_and_a_reporter_must_register(tair, server):
    instance_id = _instance(tair)
    host = "h:3"
    status = tair.report(instance_id, host, [add(KEYS[0])], "NODE_NOT_REGISTERED")["header"]["status"]
    assert "is not registered" in status["message"], status
    tair.report(instance_id, host, [register()])
    tair.report(instance_id, host, [{"event_type": "EVENT_HEARTBEAT", "heartbeat": {"system_status": {"gpu": "ok"}}}])
    tair.report(instance_id, host, [add(KEYS[0])])
    assert set(_sources(server, instance_id)) == {f"tair/{instance_id}/L2/{host}"}
    tair.report(instance_id, host, [{"event_type": "EVENT_HOST_DOWN", "host_down": {}}])
    assert _sources(server, instance_id) == {}
    assert tair.hosts(instance_id, KEYS) == {}
    tair.report(instance_id, host, [{"event_type": "EVENT_HEARTBEAT"}], "NODE_NOT_REGISTERED")
    tair.report(instance_id, host, [register()])  # back, holding nothing
    assert tair.local(instance_id, KEYS) == {host: "0"}
    tair.report("no-such-instance", host, [register()], "INSTANCE_NOT_EXIST")


def test_two_storage_types_of_one_host_are_two_sources_of_one_host(tair, server):
    instance_id = _instance(tair)
    host = "h:4"
    for kind in ("ST_EVENT_REPORT_L1P5", L2):
        tair.report(instance_id, host, [register()], storage_type=kind)
    tair.report(instance_id, host, [add(k) for k in KEYS[:2]], storage_type="ST_EVENT_REPORT_L1P5")
    tair.report(instance_id, host, [add(KEYS[0])], storage_type=L2)
    assert set(_sources(server, instance_id)) == {f"tair/{instance_id}/L1P5/{host}", f"tair/{instance_id}/L2/{host}"}
    assert tair.local(instance_id, KEYS) == {host: "2"}


def test_int64_as_strings_both_ways_and_enums_by_name_and_number(tair, server):
    instance_id = _instance(tair)
    host = "h:5"
    # by number: EVENT_NODE_REGISTER = 1, EVENT_BLOCK_ADD = 2, ST_EVENT_REPORT_L2 = 8, QT_PREFIX_MATCH = 2;
    # lowerCamel JSON names as proto3 parsers take them; a key as a JSON number too
    tair.report(instance_id, host, [{"eventType": 1, "nodeRegister": {}}], storage_type=8)
    tair.call("reportEvent", {"instanceId": instance_id, "hostIpPort": host, "storageType": 8,
                              "events": [{"eventType": 2, "blockAdd": {"blockKey": KEYS[0], "medium": "hbm"}},
                                         {"event_type": 2, "block_add": {"block_key": BIG + 1, "medium": "hbm"}}]})
    reply = tair.call("getHostCacheState", {"instance_id": instance_id, "query_type": 2,
                                            "block_cache_keys": [KEYS[0], BIG + 1, KEYS[2]]})
    assert reply["hosts"] == [{"host_ip_port": host, "local": "2", "p2p_1_fetch": "0", "p2p_1_total_match": "2"}]
    # unset query_type is prefix matching too, and p2p_host_count (older Tair clients send it) is taken
    reply = tair.call("getHostCacheState", {"instance_id": instance_id, "block_cache_keys": KEYS, "p2p_host_count": 5})
    assert reply["hosts"][0]["local"] == "2"
    with server.client() as kv:  # exactly the key above 2^53 the reporter named, not a rounded double
        assert kv.call("match_engines", {"instance_id": instance_id, "block_keys": [BIG]})["sources"][0][
            "matched_blocks"] == 1
        assert kv.call("match_engines", {"instance_id": instance_id, "block_keys": [BIG - 1]})["sources"] == []


@pytest.mark.parametrize(("events", "extra", "named"), [
    ([{"event_type": "EVENT_BLOCK_ADD", "block_add": {"block_key": "1", "medium": "hbm", "mediun": "x"}}], {},
     "unknown field events[0].block_add.mediun (did you mean events[0].block_add.medium?)"),
    ([{"event_type": "EVENT_BLOCK_ADD", "block_add": {"block_key": "1", "medium": "hbm",
                                                      "specs": [{"name": "a", "url": "u"}]}}], {},
     "unknown field events[0].block_add.specs[0].url"),
    ([{"event_type": "EVENT_HEARTBEAT", "hearbeat": {}}], {}, "unknown field events[0].hearbeat"),
    ([register()], {"hosts": "x"}, "unknown field hosts"),
    ([{"event_type": "EVENT_BLOCK_ADD", "block_add": {"medium": "hbm"}}], {}, "events[0].block_add.block_key: required"),
    ([{"event_type": "EVENT_BLOCK_ADD", "block_add": {"block_key": "1x", "medium": "hbm"}}], {},
     "events[0].block_add.block_key: expected int64"),
    ([{"event_type": "EVENT_BLOCK_DELETE", "block_delete": {"block_key": "1"}}], {},
     "events[0].block_delete.medium: required"),
    ([{"event_type": "EVENT_BLOCK_ADD"}], {}, "events[0].block_add: required"),
    ([{"event_type": "EVENT_BLOCK_ADD", "block_delete": {"block_key": "1", "medium": "m"}}], {},
     "events[0].block_delete: not the parameters of EVENT_BLOCK_ADD"),
    ([{"event_type": "EVENT_NODE_GONE"}], {}, "events[0].event_type: \"EVENT_NODE_GONE\" is not a ReportEventType"),
    ([{"block_add": {"block_key": "1", "medium": "m"}}], {}, "events[0].event_type: required"),
    ([snapshot(["1"]), snapshot(["2"])], {}, "events[1]: one EVENT_BLOCK_SNAPSHOT per call"),
    ([snapshot(["1", "1"])], {}, "events[0].block_snapshot.blocks[1].block_key: 1 is listed twice"),
    ([register()], {"storage_type": None}, "storage_type: ST_UNSPECIFIED is not an event-report storage type"),
    ([register()], {"storage_type": "ST_NFS"}, "storage_type: ST_NFS is not an event-report storage type"),
    ([register()], {"host_ip_port": ""}, "host_ip_port: required"),
    ([register()], {"host_ip_port": "h" * 200}, "host_ip_port: instance_id and host_ip_port together are too long"),
])
def test_malformed_reports_are_refused_naming_the_field(tair, server, events, extra, named):
    instance_id = _instance(tair)
    body = {"instance_id": instance_id, "host_ip_port": "h:6", "storage_type": L2, "events": events, **extra}
    status = tair.call("reportEvent", body, "INVALID_ARGUMENT")["header"]["status"]
    assert status["message"].startswith(f"reportEvent: {named}"), status
    assert _sources(server, instance_id) == {}  # nothing was registered on the way


@pytest.mark.parametrize(("body", "named"), [
    ({"top_k": 1}, "unknown field top_k"),
    ({"query_type": "QT_BATCH_GET"}, "query_type: QT_BATCH_GET is not answered"),
    ({"query_type": 9}, "query_type: 9 is not a QueryType"),
    ({"block_cache_keys": ["x"]}, "block_cache_keys[0]: expected int64"),
    ({"medium": "hbm"}, "medium: expected a list of strings"),
])
def test_malformed_host_queries_are_refused_naming_the_field(tair, body, named):
    instance_id = _instance(tair)
    status = tair.call("getHostCacheState", {"instance_id": instance_id, "block_cache_keys": ["1"], **body},
                       "INVALID_ARGUMENT")["header"]["status"]
    assert status["message"].startswith(f"getHostCacheState: {named}"), status


def test_auth_a_reporter_reports_only_for_its_own_hosts():
    """With auth on, a reporter's token registers its hosts; another account's token for that host
    is PERMISSION_DENIED in Tair's status, another tenant's sees no such reporter."""
    with serve_in_thread(overrides={"auth": {"enabled": True, "admin_password": ADMIN_PW}}) as server, \
            server.client(auth={"user": "admin", "password": ADMIN_PW}) as admin:
        admin.call("create_instance_group", {"instance_group": {"name": "gb", "storage_candidates": ["default-file"]}})
        for user, group in (("alice", "default"), ("bob", "default"), ("carol", "gb")):
            admin.call("add_account", {"user_name": user, "password": f"{user}-Passw0rd", "groups": [group]})
        tokens = {u: admin.call("add_token", {"user_name": u})["token"] for u in ("alice", "bob", "carol")}
        alice, bob, carol = (Tair(server.http_port, tokens[u]) for u in ("alice", "bob", "carol"))
        try:
            alice.call("registerInstance", {"instance_group": "default", "instance_id": "llm", "block_size": 4,
                                            "location_spec_infos": [{"name": "tp0", "size": 64}]})
            alice.report("llm", "h:7", [register()])
            alice.report("llm", "h:7", [add(KEYS[0])])
            for events in ([add(KEYS[1])], [register()], [{"event_type": "EVENT_HOST_DOWN"}]):
                status = bob.report("llm", "h:7", events, "INVALID_ARGUMENT")["header"]["status"]
                assert status["message"].startswith("PERMISSION_DENIED: "), status
            status = carol.report("llm", "h:7", [add(KEYS[1])], "NODE_NOT_REGISTERED")["header"]["status"]
            assert "is not registered" in status["message"], status
            anonymous = Tair(server.http_port)
            status = anonymous.report("llm", "h:7", [add(KEYS[1])], "INVALID_ARGUMENT")["header"]["status"]
            assert status["message"].startswith("UNAUTHENTICATED: "), status
            anonymous.session.close()
            assert alice.local("llm", KEYS) == {"h:7": "1"}  # none of the refused reports changed a thing
            bob.report("llm", "h:8", [register()])  # bob's own host is his
            bob.report("llm", "h:8", [add(KEYS[0])])
            assert bob.local("llm", KEYS) == {"h:7": "1", "h:8": "1"}
        finally:
            for client in (alice, bob, carol):
                client.session.close()


def test_after_a_kvcm_restart_the_reporter_is_asked_for_a_snapshot(tmp_path):
    data = str(tmp_path / "data")
    with serve_in_thread(data) as server:
        tair = Tair(server.http_port)
        tair.call("registerInstance", {"instance_group": "default", "instance_id": "llm", "block_size": 4,
                                       "location_spec_infos": [{"name": "tp0", "size": 64}]})
        tair.report("llm", "h:9", [register()])
        assert tair.report("llm", "h:9", [snapshot(KEYS[:2])])["snapshot_required"] is False
        tair.session.close()
    with serve_in_thread(data) as server:
        tair = Tair(server.http_port)
        assert tair.local("llm", KEYS) == {"h:9": "2"}  # kept across the restart
        assert tair.report("llm", "h:9", [{"event_type": "EVENT_HEARTBEAT"}])["snapshot_required"] is True
        assert tair.report("llm", "h:9", [add(KEYS[2])])["snapshot_required"] is True
        assert tair.report("llm", "h:9", [snapshot(KEYS[:1])])["snapshot_required"] is False
        assert tair.local("llm", KEYS) == {"h:9": "1"}
        tair.session.close()


def test_kvcm_s_keyed_events_the_translation_relies_on(tair, server):
    """``report_events``' keyed events, as the translation sends them: no tokens or parent with
    keys, and a batch without seq only when every event is keyed."""
    instance_id = _instance(tair)
    tair.report(instance_id, "h:10", [register()])
    source_id = f"tair/{instance_id}/L2/h:10"
    with server.client() as kv:
        for events, named in (
            ([{"type": "add", "keyed": True, "block_hashes": [1], "token_ids": [1, 2, 3, 4], "block_size": 4}],
             "events[0] is keyed"),
            ([{"type": "add", "keyed": True, "block_hashes": [1], "parent_block_hash": 9}], "events[0] is keyed"),
            ([{"type": "add", "keyed": True, "block_hashes": [1]}, {"type": "remove", "block_hashes": [1]}],
             "op events needs seq"),
        ):
            with pytest.raises(KvcmError) as exc:
                kv.call("report_events", {"source_id": source_id, "op": "events", "events": events}, retry=False)
            assert exc.value.code is Code.INVALID_ARGUMENT and named in exc.value.message, exc.value
        done = kv.call("report_events", {"source_id": source_id, "op": "events",
                                         "events": [{"type": "add", "keyed": True, "block_hashes": [7, 8]}]})
        assert (done["applied_blocks"], done["last_seq"], done["resync"]) == (2, -1, False)
    assert tair.local(instance_id, ["7", "8"]) == {"h:10": "2"}
