"""A connector's save and load against ``kvcm serve`` through a client that uses only the documented
calls of Tair's ``kv_cache_manager/py_connector/common/manager_client.py``: the same method names,
the same request dicts, the same checks (HTTP 200 and ``header.status.code == "OK"``) and the same
leader discovery (``getClusterInfo`` -> ``http://{host}:{meta_http_port}``, rediscovery on
``SERVER_NOT_LEADER``). Written here from its documentation; Tair's code is not copied."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.parse

import pytest
import requests

from kvcm import Client
from kvcm.blocks import BlockIO
from kvcm.errors import KvcmError
from kvcm.testing import serve_in_subprocess, start_subprocess, stop_subprocess

BLOCK = 4  # tokens per block
SPEC_BYTES = 256


class ManagerClient:
    """Tair's KvCacheManagerClient surface: ``method(data, check_response=True) -> dict``."""

    def __init__(self, base_url: str, *, instance_id: str = "", auto_discover_leader: bool = False,
                 leader_retry_count: int = 1) -> None:
        self.base_url = base_url
        self._discovery_url = base_url  # discovery always asks the address it was given
        self._instance_id = instance_id
        self._auto = auto_discover_leader
        self._retries = leader_retry_count
        self.session = requests.Session()
        self.headers = {"Accept": "application/json", "Content-Type": "application/json"}
        if auto_discover_leader:
            self.discover_leader()

    def discover_leader(self) -> bool:
        try:
            reply = requests.post(self._discovery_url + "/api/getClusterInfo", headers=self.headers, timeout=5,
                                  json={"trace_id": f"leader_discovery_{time.monotonic()}",
                                        "instance_id": self._instance_id})
        except requests.ConnectionError:
            return False
        data = reply.json() if reply.status_code == 200 else {}
        leader = data.get("leader_endpoint") or {}
        if data.get("header", {}).get("status", {}).get("code") != "OK" or not leader.get("host") \
                or not leader.get("meta_http_port"):
            return False
        self.base_url = f"http://{leader['host']}:{leader['meta_http_port']}"
        return True

    def _api(self, endpoint: str, data: dict, check_response: bool) -> dict:
        retries = self._retries if self._auto else 0
        while True:
            response = self.session.post(self.base_url + endpoint, json=data, headers=self.headers)
            body = response.json()
            code = body.get("header", {}).get("status", {}).get("code")
            if self._auto and code == "SERVER_NOT_LEADER" and retries > 0:
                retries -= 1
                if self.discover_leader():
                    continue
            if check_response:
                if response.status_code != 200:
                    raise AssertionError(f"Request to {endpoint} failed with status code {response.status_code}")
                if body["header"]["status"]["code"] != "OK":
                    raise AssertionError(f"Request to {endpoint} failed with error: "
                                         f"{body['header']['status']['message']}")
            return body

    def register_instance(self, data: dict, check_response: bool = True) -> dict:
        return self._api("/api/registerInstance", data, check_response)

    def get_instance_info(self, data: dict, check_response: bool = True) -> dict:
        return self._api("/api/getInstanceInfo", data, check_response)

    def get_cache_location(self, data: dict, check_response: bool = True) -> dict:
        return self._api("/api/getCacheLocation", data, check_response)

    def start_write_cache(self, data: dict, check_response: bool = True) -> dict:
        return self._api("/api/startWriteCache", data, check_response)

    def finish_write_cache(self, data: dict, check_response: bool = True) -> dict:
        return self._api("/api/finishWriteCache", data, check_response)

    def remove_cache(self, data: dict, check_response: bool = True) -> dict:
        return self._api("/api/removeCache", data, check_response)

    def trim_cache(self, data: dict, check_response: bool = True) -> dict:
        return self._api("/api/trimCache", data, check_response)

    def get_cluster_info(self, data: dict, check_response: bool = True) -> dict:
        return self._api("/api/getClusterInfo", data, check_response)

    def close(self) -> None:
        self.session.close()


# -- a connector's block I/O, from what registerInstance says -------------------------------------


def _roots(registered: dict) -> dict[str, str]:
    """Storage name -> root path of the NFS storages in ``storage_configs`` (a JSON string)."""
    return {s["global_unique_name"]: s["nfs"]["root_path"] for s in json.loads(registered["storage_configs"]) if "nfs" in s}


def _place(uri: str) -> tuple[str, int, int]:
    """(path, offset, size) of a Tair NFS URI, as Tair's file transfer reads it: the URI path is
    the file, opened as it is (no root joined), the block is at ``blkid × size`` (blkid 0 if absent)."""
    parsed = urllib.parse.urlsplit(uri)
    assert parsed.scheme == "file" and parsed.netloc and parsed.path.startswith("/"), uri
    query = dict(urllib.parse.parse_qsl(parsed.query))
    size = int(query["size"])
    return parsed.path, int(query.get("blkid", 0)) * size, size


def _tair_write(uri: str, data: bytes) -> None:
    path, offset, size = _place(uri)
    assert len(data) == size
    fd = os.open(path, os.O_RDWR)  # the file exists: kvcm created it when it handed the URI out
    try:
        assert os.pwrite(fd, data, offset) == size
    finally:
        os.close(fd)


def _tair_read(uri: str) -> bytes:
    path, offset, size = _place(uri)
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def _block(key: int, spec: str) -> bytes:
    return (f"{key}:{spec}:".encode() * SPEC_BYTES)[:SPEC_BYTES]


def _save_and_load(client: ManagerClient, instance_id: str) -> None:
    registered = client.register_instance({
        "trace_id": "connector", "instance_group": "default", "instance_id": instance_id, "block_size": BLOCK,
        "location_spec_infos": [{"name": "tp0", "size": SPEC_BYTES}, {"name": "tp1", "size": SPEC_BYTES}],
        "model_deployment": {"model_name": "qwen", "dtype": "bf16", "tp_size": 2}})
    roots = _roots(registered)
    keys = [str((1 << 60) + i) for i in range(4)]  # a connector's int64 block hashes
    # save: ask where, write the bytes there, say which succeeded
    started = client.start_write_cache({"trace_id": "save", "instance_id": instance_id, "block_keys": keys,
                                        "write_timeout_seconds": 30})
    assert started["block_mask"] == {"offset": 0}
    for key, location in zip(keys, started["locations"]):
        for spec in location["location_specs"]:
            assert any(_place(spec["uri"])[0].startswith(root + "/") for root in roots.values()), spec["uri"]
            _tair_write(spec["uri"], _block(int(key), spec["name"]))
    client.finish_write_cache({"instance_id": instance_id, "write_session_id": started["write_session_id"],
                               "success_blocks": {"offset": len(started["locations"])},
                               "locations": started["locations"]})  # a connector sends them back
    # load: a prompt that shares the first three blocks
    query = [*keys[:3], str((1 << 61) + 7)]
    found = client.get_cache_location({"trace_id": "load", "instance_id": instance_id,
                                       "query_type": "QT_PREFIX_MATCH", "block_keys": query,
                                       "block_mask": {"offset": 1}})  # the first block is on the GPU
    assert len(found["locations"]) == 2
    for key, location in zip(query[1:], found["locations"]):
        for spec in location["location_specs"]:
            assert _tair_read(spec["uri"]) == _block(int(key), spec["name"])
    again = client.start_write_cache({"instance_id": instance_id, "block_keys": keys})
    assert again["block_mask"] == {"offset": 4}
    client.finish_write_cache({"instance_id": instance_id, "write_session_id": again["write_session_id"],
                               "success_blocks": {"offset": 0}})
    client.remove_cache({"instance_id": instance_id, "block_keys": keys[3:]})
    client.trim_cache({"instance_id": instance_id, "strategy": "TS_REMOVE_ALL_CACHE"})
    assert client.get_cache_location({"instance_id": instance_id, "query_type": "QT_PREFIX_MATCH",
                                      "block_keys": keys})["locations"] == []
    with pytest.raises(AssertionError, match="is not registered"):
        client.get_instance_info({"instance_id": "nobody"})


def _http_port(endpoint: str) -> int:
    with Client(endpoint, timeout=5.0) as c:
        return int(c.call("check_health")["node"]["http_port"])


def test_a_connector_saves_and_loads_through_tair_s_manager_client():
    with serve_in_subprocess() as server:
        url = f"http://127.0.0.1:{_http_port(server.endpoint)}"
        client = ManagerClient(url, instance_id="llm", auto_discover_leader=True)
        try:
            assert client.base_url == url  # one node: it names itself the leader
            info = client.get_cluster_info({"instance_id": "llm"})
            assert info["leader_endpoint"]["host"] == "127.0.0.1"
            _save_and_load(client, "llm")
        finally:
            client.close()


def _kvcm_uris(kv: Client, instance_id: str, keys: list[int]) -> list[str]:
    found = kv.call("get_cache_location", {"instance_id": instance_id, "query_type": "batch_get", "block_keys": keys})
    return [spec["uri"] for loc in found["locations"] for spec in loc["location_specs"]]


def test_tair_s_absolute_uri_and_kvcm_s_own_uri_name_the_same_bytes():
    """A Tair reader opens only the path its URI names; kvcm's own client reads through kvcm's URI
    of the same block (BlockIO): what one writes, the other reads, both ways."""
    with serve_in_subprocess() as server, Client(server.endpoint, timeout=5.0) as kv:
        client = ManagerClient(f"http://127.0.0.1:{_http_port(server.endpoint)}")
        registered = client.register_instance({"instance_group": "default", "instance_id": "x", "block_size": BLOCK,
                                               "location_spec_infos": [{"name": "tp0", "size": SPEC_BYTES}]})
        (name, root), = _roots(registered).items()
        blocks = BlockIO.for_instance(kv, "x")
        try:
            # Tair writes through its URI; kvcm reads through its own.
            started = client.start_write_cache({"instance_id": "x", "block_keys": ["11", "12"]})
            tair_uris = [loc["location_specs"][0]["uri"] for loc in started["locations"]]
            for key, uri in zip((11, 12), tair_uris):
                _tair_write(uri, _block(key, "tp0"))
            client.finish_write_cache({"instance_id": "x", "write_session_id": started["write_session_id"],
                                       "success_blocks": {"offset": 2}, "locations": started["locations"]})
            kvcm_uris = _kvcm_uris(kv, "x", [11, 12])
            for key, tair_uri, kvcm_uri in zip((11, 12), tair_uris, kvcm_uris):
                prefix = f"file://{name}"
                assert kvcm_uri.startswith(prefix + "/s") and tair_uri == prefix + root + kvcm_uri[len(prefix):]
                assert bytes(blocks.read(kvcm_uri)) == _block(key, "tp0")
            # kvcm writes through its URI; Tair reads through its own.
            own = kv.call("start_write_cache", {"instance_id": "x", "block_keys": [21, 22]})
            for key, loc in zip((21, 22), own["locations"]):
                blocks.write(loc["location_specs"][0]["uri"], _block(key, "tp0"))
            kv.call("finish_write_cache", {"instance_id": "x", "write_session_id": own["write_session_id"],
                                           "success_blocks": {"offset": 2}})
            found = client.get_cache_location({"instance_id": "x", "query_type": "QT_BATCH_GET",
                                               "block_keys": ["21", "22"]})
            assert [_tair_read(loc["location_specs"][0]["uri"]) for loc in found["locations"]] == \
                [_block(21, "tp0"), _block(22, "tp0")]
        finally:
            blocks.close()
            client.close()


# -- leader discovery under the leader lease ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _leader(endpoints: dict[str, str]) -> str:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for node, endpoint in endpoints.items():
            try:
                with Client(endpoint, timeout=1.0, retries=0) as c:
                    if c.call("get_manager_cluster_info")["leader"]:
                        return node
            except KvcmError:
                pass
        time.sleep(0.05)
    raise AssertionError("no leader")


def test_leader_discovery_through_get_cluster_info_follows_the_lease(redis_factory, tmp_path):
    redis = redis_factory()
    endpoints = {n: f"tcp://127.0.0.1:{_free_port()}" for n in ("n1", "n2")}
    common = ["--set", "store.backend=redis", "--set", f"store.redis_url={redis.url}",
              "--set", "store.redis_prefix=tair", "--set", "ha.enabled=true",
              "--set", "ha.lease_ms=1500", "--set", "ha.renew_ms=500"]
    # Fixed HTTP ports, as in production: each role change rebinds the node's side port.
    ports = {n: _free_port() for n in endpoints}
    urls = {n: f"http://127.0.0.1:{port}" for n, port in ports.items()}
    nodes = {}
    try:
        for node in endpoints:
            nodes[node] = start_subprocess(str(tmp_path / node), endpoints[node],
                                           [*common, "--set", f"ha.node_id={node}", "--http-port", str(ports[node])])
        leader = _leader(endpoints)
        follower = "n2" if leader == "n1" else "n1"
        assert {n: _http_port(e) for n, e in endpoints.items()} == ports
        assert urls["n1"] != urls["n2"]  # so the follower must learn the leader's own port
        # With discovery, the follower's getClusterInfo sends the client to the leader.
        client = ManagerClient(urls[follower], instance_id="llm", auto_discover_leader=True)
        assert client.base_url == urls[leader]
        # A client of the follower without discovery is served too: the follower's side port
        # forwards through a kvcm client, which follows SERVER_NOT_LEADER to the leader.
        plain = ManagerClient(urls[follower])
        plain.register_instance({"instance_group": "default", "instance_id": "x", "block_size": BLOCK,
                                 "location_spec_infos": [{"name": "tp0", "size": 64}]})
        plain.close()
        _save_and_load(client, "llm")
        # The leader goes away: the follower takes the lease, and discovery now names it.
        stop_subprocess(nodes.pop(leader), kill=True)
        deadline = time.monotonic() + 20
        # (Until it does, it names the dead leader, with its own HTTP port: the leader cannot say.)
        while not (client.discover_leader() and client.base_url == urls[follower]
                   and client.get_cluster_info({"instance_id": "llm"})["leader_node_id"] == follower):
            assert time.monotonic() < deadline, "the follower never became the leader"
            time.sleep(0.1)
        client.close()
    finally:
        for server in nodes.values():
            stop_subprocess(server, kill=True)


def _tair_status(url: str, method: str, body: dict) -> dict:
    """One Tair call; the timeout bounds how long a follower may take to answer (Tair's own client
    gives up after a second by default), so an answer after the RPC timeout fails here."""
    reply = requests.post(f"{url}/api/{method}", json=body, timeout=5)
    assert reply.status_code == 200, reply.text
    return reply.json()["header"]["status"]


def test_a_follower_answers_server_not_leader_at_once_while_its_leader_is_stopped_or_unknown(redis_factory, tmp_path):
    """The side port follows SERVER_NOT_LEADER only to a leader that answers: a stopped leader
    (its lease not yet expired) or none known is Tair's SERVER_NOT_LEADER, by name and at once,
    naming the leader where one is known, so Tair's client rediscovers instead of timing out."""
    import signal

    import redis as redis_py

    server = redis_factory()
    endpoints = {n: f"tcp://127.0.0.1:{_free_port()}" for n in ("n1", "n2")}
    ports = {n: _free_port() for n in endpoints}
    # A long lease: the stopped leader stays the named holder for the whole test.
    common = ["--set", "store.backend=redis", "--set", f"store.redis_url={server.url}",
              "--set", "store.redis_prefix=stale", "--set", "ha.enabled=true",
              "--set", "ha.lease_ms=30000", "--set", "ha.renew_ms=500"]
    nodes = {"n1": start_subprocess(str(tmp_path / "n1"), endpoints["n1"],
                                    [*common, "--set", "ha.node_id=n1", "--http-port", str(ports["n1"])])}
    try:
        assert _leader({"n1": endpoints["n1"]}) == "n1"
        nodes["n2"] = start_subprocess(str(tmp_path / "n2"), endpoints["n2"],
                                       [*common, "--set", "ha.node_id=n2", "--http-port", str(ports["n2"])])
        follower = f"http://127.0.0.1:{ports['n2']}"
        register = {"instance_group": "default", "instance_id": "x", "block_size": BLOCK,
                    "location_spec_infos": [{"name": "tp0", "size": 64}]}
        # While the leader answers, the follower forwards to it (and Tair's client is served)...
        assert _tair_status(follower, "registerInstance", register)["code"] == "OK"
        os.kill(nodes["n1"].process.pid, signal.SIGSTOP)
        time.sleep(1.2)  # past the second the follower trusts its last look at the leader
        # ...and once it stops, every call starts at the follower again and is refused there.
        status = _tair_status(follower, "registerInstance", register)
        assert status["code"] == "SERVER_NOT_LEADER", status
        assert f"the leader is n1 at {endpoints['n1']}" in status["message"] and "does not answer" in status["message"]
        # Reads are the follower's own: answered, whatever the leader does.
        status = _tair_status(follower, "getCacheLocation", {"instance_id": "nobody", "query_type": "QT_BATCH_GET",
                                                              "block_keys": ["1"]})
        assert status["code"] == "INSTANCE_NOT_EXIST", status
        # No leader known (a lease record no node wrote holds the key): refused at once, naming none.
        with redis_py.Redis.from_url(server.url) as conn:
            conn.set("{stale}:leader", b"not a record", px=30000)
        deadline = time.monotonic() + 10
        while "no leader is known" not in (status := _tair_status(follower, "startWriteCache", {
                "instance_id": "x", "block_keys": ["1"]}))["message"]:
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert status["code"] == "SERVER_NOT_LEADER", status
    finally:
        for server_proc in nodes.values():
            if server_proc.process is not None:
                os.kill(server_proc.process.pid, signal.SIGCONT)
            stop_subprocess(server_proc, kill=True)
