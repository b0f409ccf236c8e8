"""Tair's event reporters and routers against kvcm, call for call: ``reportEvent`` and
``getHostCacheState`` over real HTTP with ``requests``, the bodies built as Tair's own code builds
them.

Two sources, both alibaba/tair-kvcache: the ReportEvent integration test (a ``requests.Session``
POSTing ``/api/reportEvent``: register, an empty first snapshot, adds on two mediums and with two
specs, deletes, host downs, heartbeats with a ``system_status``), and the cache subscriber
(``subscriber/kvcm/client.py``: ``registerInstance`` with its full ``model_deployment``, a
NODE_REGISTER alone, heartbeats alone, one add or delete item per block hash, a host reset as a
HOST_DOWN alone followed by a fresh registration). Replies are checked against
``meta_service.proto``'s ReportEventResponse and HostCacheMatch, and every block a reporter
reports is checked where a router looks for it: ``getHostCacheState`` and kvcm's own
``match_engines``.

The last tests are calls one kvcm op cannot answer (kvcm/tair/events.py runs several): an
idempotent host down, kinds mixed in one call, a call without events.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from kvcm.testing import RunningServer, serve_in_thread
from tests.helpers import TIME_FACTOR, wait_until

L2 = "ST_EVENT_REPORT_L2"
#: ReportEventResponse's fields (meta_service.proto), header aside.
REPORT_FIELDS = {"item_results", "committed_snapshot_version", "retry_after_ms", "snapshot_required", "extra_info"}
#: HostCacheMatch's fields.
HOST_FIELDS = {"host_ip_port", "local", "p2p_1_fetch", "p2p_1_total_match"}


class Client:
    """Tair's integration-test client: one ``requests.Session``, JSON in and out."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.session = requests.Session()
        self.session.headers.update({"Content-Type": "application/json", "Accept": "application/json"})

    def post(self, method: str, body: dict[str, Any], code: str = "OK") -> dict[str, Any]:
        resp = self.session.post(f"{self.base}/api/{method}", json=body, timeout=10)
        resp.raise_for_status()  # a logical error is HTTP 200 with its code, as Tair answers
        reply: dict[str, Any] = resp.json()
        assert reply["header"]["status"]["code"] == code, (method, reply)
        return reply

    def report(self, instance_id: str, host: str, events: list[dict[str, Any]], code: str = "OK",
               trace_id: str = "test") -> dict[str, Any]:
        return self.post("reportEvent", {"trace_id": trace_id, "instance_id": instance_id, "host_ip_port": host,
                                         "events": events, "storage_type": L2}, code)

    def hosts(self, instance_id: str, keys: list[int], medium: list[str] | None = None) -> dict[str, dict[str, Any]]:
        body: dict[str, Any] = {"trace_id": "router", "instance_id": instance_id, "query_type": "QT_PREFIX_MATCH",
                                "block_cache_keys": [str(k) for k in keys]}
        if medium is not None:
            body["medium"] = medium
        reply = self.post("getHostCacheState", body)
        assert set(reply) == {"header", "hosts"}, reply
        for host in reply["hosts"]:
            assert set(host) == HOST_FIELDS, host
            assert all(isinstance(host[f], str) for f in HOST_FIELDS - {"host_ip_port"}), host  # int64 as strings
        return {h["host_ip_port"]: h for h in reply["hosts"]}

    def local(self, instance_id: str, keys: list[int], medium: list[str] | None = None) -> dict[str, int]:
        return {host: int(h["local"]) for host, h in self.hosts(instance_id, keys, medium).items()}


# -- Tair's EventItem builders, as its integration test writes them ------------------------------


def node_register(mediums: list[str]) -> dict[str, Any]:
    return {"event_type": "EVENT_NODE_REGISTER", "node_register": {"mediums": list(mediums)}}


def block_add(key: int, medium: str, specs: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {"event_type": "EVENT_BLOCK_ADD", "block_add": {
        "block_key": str(key), "medium": medium, "specs": specs or [{"name": "spec_4096", "uri": f"er://h/{medium}"}]}}


def block_delete(key: int, medium: str) -> dict[str, Any]:
    return {"event_type": "EVENT_BLOCK_DELETE",
            "block_delete": {"block_key": str(key), "medium": medium, "spec_names": ["spec_4096"]}}


def block_snapshot(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    return {"event_type": "EVENT_BLOCK_SNAPSHOT", "block_snapshot": {"blocks": blocks}}


def host_down() -> dict[str, Any]:
    return {"event_type": "EVENT_HOST_DOWN", "host_down": {}}


def heartbeat(status: dict[str, str] | None = None) -> dict[str, Any]:
    return {"event_type": "EVENT_HEARTBEAT", "heartbeat": {"system_status": status or {}}}


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread() as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[Client]:
    c = Client(server.http_port)
    yield c
    c.session.close()


def _instance(client: Client) -> str:
    """A registered instance, as Tair's test registers one (block_size 128, one spec)."""
    instance_id = f"er-{uuid.uuid4().hex[:8]}"
    client.post("registerInstance", {
        "trace_id": "setup", "instance_group": "default", "instance_id": instance_id, "block_size": 128,
        "model_deployment": {"model_name": "test_er_model", "dtype": "FP8", "use_mla": False,
                             "tp_size": 1, "dp_size": 1, "pp_size": 1},
        "location_spec_infos": [{"name": "tp0", "size": 1024}]})
    return instance_id


def _registered(client: Client, host: str, mediums: list[str]) -> str:
    """Tair's set-up of a reporter: a NODE_REGISTER, then an empty first snapshot."""
    instance_id = _instance(client)
    client.report(instance_id, host, [node_register(mediums)], trace_id="setup_register_host")
    client.report(instance_id, host, [block_snapshot([])], trace_id="setup_initial_snapshot")
    return instance_id


def _matched(server: RunningServer, instance_id: str, keys: list[int]) -> dict[str, int]:
    """kvcm's own view, over msgpack-RPC: matched blocks per pod."""
    with server.client() as kv:
        reply = kv.call("match_engines", {"instance_id": instance_id, "block_keys": keys})
    return {s["pod"]: s["matched_blocks"] for s in reply["sources"]}


def _source_ids(server: RunningServer, instance_id: str) -> set[str]:
    with server.client() as kv:
        return {s["source_id"] for s in kv.call("list_event_sources", {"instance_id": instance_id})["sources"]}


# -- what works ------------------------------------------------------------------------------------


def test_adds_on_two_mediums_and_with_two_specs_are_seen_by_routers(client, server):
    """Tair's tests 01-05b: registering again merges mediums; one block added on ``mem`` and
    ``disk`` in one call is one block of the host, on either medium; a block of two specs is one
    block; ``getHostCacheState`` and ``match_engines`` count the same prefix."""
    host = "192.168.1.220:8080"
    instance_id = _registered(client, host, ["mem"])
    reply = client.report(instance_id, host, [node_register(["mem", "disk", "ssd"])], trace_id="t02")
    assert set(reply) == {"header", *REPORT_FIELDS}, reply
    assert (reply["item_results"], reply["retry_after_ms"], reply["snapshot_required"]) == ([], "0", False)
    assert re.fullmatch(r"t02_\d{16}", reply["header"]["request_id"]), reply["header"]  # trace id, µs
    client.report(instance_id, host, [block_add(9020, "mem"), block_add(9020, "disk")], trace_id="t05b")
    client.report(instance_id, host, [block_add(9021, "mem", [{"name": "spec_4096", "uri": "er://h/mem?obj_id=o1"},
                                                              {"name": "spec_8192", "uri": "er://h/mem?obj_id=o2"}])])
    keys = [9020, 9021, 9022]
    assert client.hosts(instance_id, keys) == {host: {"host_ip_port": host, "local": "2", "p2p_1_fetch": "0",
                                                      "p2p_1_total_match": "2"}}
    assert client.local(instance_id, keys, ["disk"]) == {host: 1}  # only 9020 is on disk
    assert client.local(instance_id, keys, ["mem", "disk"]) == {host: 2}
    assert _matched(server, instance_id, keys) == {host: 2}


def test_deletes_remove_a_block_from_its_medium_and_an_absent_one_is_a_no_op(client, server):
    """Tair's tests 06-07, through the prefix a router sees."""
    host = "192.168.1.200:8080"
    instance_id = _registered(client, host, ["mem", "disk"])
    client.report(instance_id, host, [block_add(k, "mem") for k in (1, 2, 3)] + [block_add(1, "disk")])
    assert client.local(instance_id, [1, 2, 3]) == {host: 3}
    client.report(instance_id, host, [block_delete(2, "mem")], trace_id="t06b")
    assert client.local(instance_id, [1, 2, 3]) == {host: 1}
    assert _matched(server, instance_id, [1, 2, 3]) == {host: 1}
    client.report(instance_id, host, [block_delete(99999, "mem")], trace_id="t07")  # never held
    client.report(instance_id, host, [block_delete(1, "mem")])  # still on disk
    assert client.local(instance_id, [1, 2, 3]) == {host: 1}
    assert client.local(instance_id, [1], ["mem"]) == {host: 0}
    client.report(instance_id, host, [block_delete(1, "disk")])
    assert client.local(instance_id, [1, 2, 3]) == {host: 0}
    assert _matched(server, instance_id, [1, 2, 3]) == {}


def test_host_down_drops_the_host_and_its_blocks(client, server):
    """Tair's test 08: a host's blocks on every medium, then EVENT_HOST_DOWN."""
    down, other = "192.168.1.202:8080", "192.168.1.204:8080"
    instance_id = _registered(client, down, ["mem", "disk"])
    client.report(instance_id, other, [node_register(["mem"])])
    keys = [9010, 9011, 9012]
    client.report(instance_id, down, [block_add(k, m) for k in keys for m in ("mem", "disk")], trace_id="t08a")
    client.report(instance_id, other, [block_add(9010, "mem")])
    assert client.local(instance_id, keys) == {down: 3, other: 1}
    client.report(instance_id, down, [host_down()], trace_id="t08b")
    assert client.local(instance_id, keys) == {other: 1}
    assert _matched(server, instance_id, keys) == {other: 1}
    assert _source_ids(server, instance_id) == {f"tair/{instance_id}/L2/{other}"}


def test_the_subscriber_s_life_register_heartbeat_batch_reset(client, server):
    """The cache subscriber, call for call: registerInstance with its full model_deployment and a
    numeric spec size, NODE_REGISTER alone, heartbeats alone with an empty ``system_status``, a
    batch of adds and deletes in one call (one item per block hash), then a host reset: HOST_DOWN
    alone, registerInstance and NODE_REGISTER again, the new generation's blocks. The router sees
    the old generation's blocks gone and the new ones there."""
    instance_id, host = f"sub-{uuid.uuid4().hex[:8]}", "10.0.0.8:9000"

    def register_and_report_node() -> None:
        client.post("registerInstance", {
            "trace_id": f"subscriber_register_instance_{time.monotonic_ns()}", "instance_group": "default",
            "instance_id": instance_id, "block_size": 16, "location_spec_infos": [{"name": "vllm_16", "size": 16}],
            "model_deployment": {"model_name": "qwen", "dtype": "bfloat16", "use_mla": False, "tp_size": 1,
                                 "dp_size": 1, "lora_name": "", "pp_size": 1, "extra": "", "user_data": ""},
            "location_spec_groups": [{"name": "default", "spec_names": ["vllm_16"]}]})
        client.report(instance_id, host, [node_register(["hbm", "mem"])])

    def specs(medium: str) -> list[dict[str, str]]:
        return [{"name": "vllm_16", "uri": f"vllm://{host}/{medium}"}]

    register_and_report_node()
    assert client.report(instance_id, host, [heartbeat()])["snapshot_required"] is False
    old, new = [(1 << 62) + i for i in range(4)], [-(1 << 62) - i for i in range(3)]  # int64, both signs
    batch = [block_add(k, "hbm", specs("hbm")) for k in old] + [block_delete(old[3], "hbm")]
    client.report(instance_id, host, batch, trace_id=f"subscriber_report_event_{time.monotonic_ns()}")
    assert client.local(instance_id, old) == {host: 3}
    client.report(instance_id, host, [host_down()])
    assert client.local(instance_id, old) == {}
    register_and_report_node()
    client.report(instance_id, host, [block_add(k, "mem", specs("mem")) for k in new])
    assert client.local(instance_id, old) == {host: 0}
    assert client.hosts(instance_id, new)[host] == {"host_ip_port": host, "local": "3", "p2p_1_fetch": "0",
                                                    "p2p_1_total_match": "3"}
    assert _matched(server, instance_id, new) == {host: 3}
    client.report(instance_id, host, [heartbeat({"version": "er-0.18", "cpu": "45%"})])


def test_heartbeats_keep_a_silent_host_live_for_routers():
    """Tair's test 10 and its liveness: of two hosts holding the same blocks, the one that keeps
    sending heartbeats (and nothing else) stays in kvcm's matches; the silent one goes stale and
    drops out."""
    stale = 1.0 * TIME_FACTOR
    overrides = {"events": {"probe_interval_s": stale / 4, "stale_after_s": stale, "expire_after_s": 60 * stale}}
    with serve_in_thread(overrides=overrides) as server:
        client = Client(server.http_port)
        try:
            instance_id = _instance(client)
            beating, silent = "10.0.1.1:80", "10.0.1.2:80"
            for host in (beating, silent):
                client.report(instance_id, host, [node_register(["mem"])])
                client.report(instance_id, host, [block_add(k, "mem") for k in (5, 6)])
            assert _matched(server, instance_id, [5, 6]) == {beating: 2, silent: 2}
            deadline = time.monotonic() + 3 * stale
            while time.monotonic() < deadline:
                client.report(instance_id, beating, [heartbeat({"phase": "serving"})])
                time.sleep(stale / 5)
            assert _matched(server, instance_id, [5, 6]) == {beating: 2}
            client.report(instance_id, silent, [heartbeat()])  # heard again: back in the matches
            wait_until(lambda: _matched(server, instance_id, [5, 6]) == {beating: 2, silent: 2},
                       timeout=2 * stale, what="a heartbeat did not bring the silent host back")
        finally:
            client.session.close()


@pytest.mark.parametrize(("method", "body", "code", "message"), [
    # Tair's test 14: an empty host_ip_port is refused before anything else
    ("reportEvent", {"host_ip_port": "", "events": [node_register(["mem"])]}, "INVALID_ARGUMENT",
     "reportEvent: host_ip_port: required"),
    # Tair's test 13: EVENT_BLOCK_ADD without its parameters (Tair fails the item, kvcm the call)
    ("reportEvent", {"events": [{"event_type": "EVENT_BLOCK_ADD"}]}, "INVALID_ARGUMENT",
     "reportEvent: events[0].block_add: required"),
    ("reportEvent", {"events": [block_add(1, "")]}, "INVALID_ARGUMENT",
     "reportEvent: events[0].block_add.medium: required"),
    ("reportEvent", {"events": [{"event_type": "EVENT_BLOCK_ADD", "block_add": {"block_key": "0x1f", "medium": "m"}}]},
     "INVALID_ARGUMENT", "reportEvent: events[0].block_add.block_key: expected int64"),
    ("reportEvent", {"storage_type": "ST_NFS", "events": [node_register(["mem"])]}, "INVALID_ARGUMENT",
     "reportEvent: storage_type: ST_NFS is not an event-report storage type"),
    # Tair's OnHeartbeat code for a host that never registered
    ("reportEvent", {"host_ip_port": "10.9.9.9:1", "events": [heartbeat()]}, "NODE_NOT_REGISTERED",
     "NOT_FOUND: event source"),
    ("reportEvent", {"instance_id": "no-such-instance", "events": [node_register(["mem"])]}, "INSTANCE_NOT_EXIST", ""),
    ("getHostCacheState", {"query_type": "QT_BATCH_GET", "block_cache_keys": ["1"]}, "INVALID_ARGUMENT",
     "getHostCacheState: query_type: QT_BATCH_GET is not answered"),
    ("getHostCacheState", {"block_cache_keys": ["1.5"]}, "INVALID_ARGUMENT",
     "getHostCacheState: block_cache_keys[0]: expected int64"),
])
def test_bad_calls_are_refused_in_tair_s_shape_and_change_nothing(client, server, method, body, code, message):
    instance_id = _instance(client)
    full = {"trace_id": "bad", "instance_id": instance_id, **body}
    if method == "reportEvent":
        full = {"host_ip_port": "10.9.9.8:1", "storage_type": L2, **full}
    reply = client.post(method, full, code)
    assert set(reply["header"]) >= {"status", "request_id"}, reply
    assert reply["header"]["status"]["message"].startswith(message), reply
    assert re.fullmatch(r"bad_\d{16}", reply["header"]["request_id"]), reply["header"]
    assert _source_ids(server, instance_id) == set()  # nothing registered on the way
    assert client.hosts(instance_id, [1]) == {}


def test_a_body_that_is_not_a_json_object_is_http_400(client):
    for data in (b"[1, 2]", b"{\"instance_id\": ", b"\xff"):
        resp = client.session.post(f"{client.base}/api/reportEvent", data=data, timeout=10)
        assert (resp.status_code, resp.json()) == (400, {}), (data, resp.text)


# -- calls Tair answers OK that take several kvcm ops -------------------------------------------


def test_host_down_is_idempotent_and_needs_no_registration(client, server):
    """Tair's test 09, and the subscriber's cold start with a host reset: it sends HOST_DOWN
    before it registers (``HOST_DOWN identifies the node by instance/host and does not require
    NODE_REGISTER``)."""
    host = "192.168.1.203:8080"
    instance_id = _registered(client, host, ["mem"])
    client.report(instance_id, host, [host_down()], trace_id="t09b")
    client.report(instance_id, host, [host_down()], trace_id="t09c")
    client.report(instance_id, "10.0.0.9:1", [host_down()])  # never registered
    assert _source_ids(server, instance_id) == set()
    client.report(instance_id, host, [node_register(["mem"])])  # and back
    assert client.local(instance_id, [1]) == {host: 0}


def test_a_batch_of_an_add_and_a_heartbeat_is_one_call(client):
    """Tair's test 11."""
    host = "192.168.1.230:8080"
    instance_id = _registered(client, host, ["mem"])
    client.report(instance_id, host, [block_add(9030, "mem"), heartbeat({"phase": "boot"})], trace_id="t11")
    assert client.local(instance_id, [9030]) == {host: 1}


def test_an_empty_batch_is_a_no_op(client, server):
    """Tair's test 12."""
    host = "192.168.1.200:8080"
    instance_id = _registered(client, host, ["mem"])
    before = client.hosts(instance_id, [1])
    reply = client.report(instance_id, host, [], trace_id="t12")
    assert (reply["snapshot_required"], client.hosts(instance_id, [1])) == (False, before)
    client.report(instance_id, "10.0.0.9:2", [])  # nor does it register anyone
    assert _source_ids(server, instance_id) == {f"tair/{instance_id}/L2/{host}"}


def test_kinds_in_one_call_apply_in_tair_s_order_whatever_their_order(client, server):
    """Registrations first, the blocks in order, a host down last: an add before its host's
    register is taken, and a down before an add drops the add too."""
    instance_id = _instance(client)
    host, other = "10.0.2.1:80", "10.0.2.2:80"
    client.report(instance_id, host, [block_add(1, "mem"), heartbeat(), node_register(["mem"]),
                                      block_add(2, "mem"), block_delete(1, "mem"), block_add(3, "mem")])
    assert client.local(instance_id, [2, 3]) == {host: 2}
    assert client.local(instance_id, [1]) == {host: 0}
    client.report(instance_id, other, [node_register(["mem"]), block_snapshot([
        {"block_key": "2", "medium": "mem"}]), block_add(3, "mem")])
    assert client.local(instance_id, [2, 3]) == {host: 2, other: 2}
    client.report(instance_id, other, [host_down(), block_add(4, "mem")])
    assert _source_ids(server, instance_id) == {f"tair/{instance_id}/L2/{host}"}
    # an add for a host not registered fails the whole call, heartbeat and all
    client.report(instance_id, other, [heartbeat(), block_add(4, "mem")], "NODE_NOT_REGISTERED")
    assert _source_ids(server, instance_id) == {f"tair/{instance_id}/L2/{host}"}
