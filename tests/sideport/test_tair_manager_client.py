"""A connector's save and load against ``kvcm serve`` through a client that uses only the documented
calls of Tair's ``kv_cache_manager/py_connector/common/manager_client.py``: the same method names,
the same request dicts, the same checks (HTTP 200 and ``header.status.code == "OK"``) and the same
leader discovery (``getClusterInfo`` -> ``http://{host}:{meta_http_port}``, rediscovery on
``SERVER_NOT_LEADER``). Written here from its documentation; Tair's code is not copied."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import requests

from kvcm import Client
from kvcm.blocks import BlockIO
from kvcm.errors import KvcmError
from kvcm.testing import RunningServer, serve_in_subprocess, start_subprocess, stop_subprocess
from tests.helpers import TIME_FACTOR, free_port, wait_until

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




@dataclass
class Pair:
    """Two ``kvcm serve`` nodes under one lease on a real Redis, each with fixed RPC and HTTP
    ports (as in production: every role change serves the node's side port from another stage)."""

    redis_url: str
    prefix: str
    data_root: str
    args: list[str]
    endpoints: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    nodes: dict[str, RunningServer] = field(default_factory=dict)

    def url(self, node: str) -> str:
        return f"http://127.0.0.1:{self.ports[node]}"

    def start(self, node: str) -> None:
        self.endpoints.setdefault(node, f"tcp://127.0.0.1:{free_port()}")
        self.ports.setdefault(node, free_port())
        self.nodes[node] = start_subprocess(os.path.join(self.data_root, node), self.endpoints[node], [
            "--set", "store.backend=redis", "--set", f"store.redis_url={self.redis_url}",
            "--set", f"store.redis_prefix={self.prefix}", "--set", "ha.enabled=true",
            "--set", f"ha.node_id={node}", "--http-port", str(self.ports[node]), *self.args])

    def leader(self, among: tuple[str, ...] | None = None) -> str:
        """The node that says it leads (waits up to 20 s for one)."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for node in among or tuple(self.endpoints):
                try:
                    with Client(self.endpoints[node], timeout=1.0, retries=0) as c:
                        if c.call("get_manager_cluster_info")["leader"]:
                            return node
                except KvcmError:
                    pass
            time.sleep(0.05)
        raise AssertionError("no leader")

    def other(self, node: str) -> str:
        return next(n for n in self.endpoints if n != node)

    def kill(self, node: str) -> None:
        server = self.nodes.pop(node)
        if server.process is not None and server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGCONT)  # a stopped node dies too
        stop_subprocess(server, kill=True)


@pytest.fixture
def tair_pair(redis_factory, tmp_path) -> Iterator[Callable[..., Pair]]:
    """``tair_pair(*args)``: a :class:`Pair` with ``args`` (``--set`` ...) on both nodes; ``n1`` is
    started (and leads) first, then ``n2``. Every node left is killed at the end."""
    made: list[Pair] = []

    def make(*args: str) -> Pair:
        pair = Pair(redis_factory("--appendonly", "yes").url, f"tair{len(made)}", str(tmp_path / f"pair{len(made)}"),
                    list(args))
        made.append(pair)
        pair.endpoints = {n: f"tcp://127.0.0.1:{free_port()}" for n in ("n1", "n2")}
        pair.start("n1")
        assert pair.leader(("n1",)) == "n1"
        pair.start("n2")
        return pair

    yield make
    for pair in made:
        for node in list(pair.nodes):
            pair.kill(node)


FAST_LEASE = ("--set", "ha.lease_ms=1500", "--set", "ha.renew_ms=500")


def _until(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    wait_until(check, timeout, interval=0.1, what=what)


def _discovered(client: ManagerClient, pair: Pair, node: str) -> bool:
    """Discovery through the client's address names ``node``, and ``node`` says it leads."""
    return client.discover_leader() and client.base_url == pair.url(node) \
        and client.get_cluster_info({"instance_id": "llm"})["leader_node_id"] == node


def test_leader_discovery_through_get_cluster_info_follows_the_lease(tair_pair):
    pair = tair_pair(*FAST_LEASE)
    leader = pair.leader()
    follower = pair.other(leader)
    assert {n: _http_port(e) for n, e in pair.endpoints.items()} == pair.ports
    assert pair.url("n1") != pair.url("n2")  # so the follower must learn the leader's own port
    # With discovery, the follower's getClusterInfo sends the client to the leader.
    client = ManagerClient(pair.url(follower), instance_id="llm", auto_discover_leader=True)
    try:
        assert client.base_url == pair.url(leader)
        # A client of the follower without discovery is served too: the follower's side port
        # forwards through a kvcm client, which follows SERVER_NOT_LEADER to the leader.
        plain = ManagerClient(pair.url(follower))
        plain.register_instance({"instance_group": "default", "instance_id": "x", "block_size": BLOCK,
                                 "location_spec_infos": [{"name": "tp0", "size": 64}]})
        plain.close()
        _save_and_load(client, "llm")
        # The leader goes away: the follower takes the lease, and discovery now names it.
        # (Until it does, it names the dead leader, with its own HTTP port: the leader cannot say.)
        pair.kill(leader)
        _until("the follower never became the leader", lambda: _discovered(client, pair, follower))
    finally:
        client.close()


def _tair_status(url: str, method: str, body: dict) -> dict:
    """One Tair call; the timeout bounds how long a follower may take to answer (Tair's own client
    gives up after a second by default), so an answer after the RPC timeout fails here."""
    reply = requests.post(f"{url}/api/{method}", json=body, timeout=5)
    assert reply.status_code == 200, reply.text
    return reply.json()["header"]["status"]


#: What a Tair call may answer while the lease changes hands: served, or told to rediscover/retry.
_SWITCH_CODES = {"OK", "SERVER_NOT_LEADER", "SERVICE_NOT_READY"}


class _Prober:
    """Tair calls on a kept-alive session (as Tair's client keeps one) to every node's side port,
    back to back, on a thread each; every answer that is not an HTTP 200 Tair reply with a code
    of :data:`_SWITCH_CODES`, within the call's timeout, is kept as a failure."""

    def __init__(self, urls: list[str]) -> None:
        self.failures: list[str] = []
        self.answers = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._probe, args=(url,), daemon=True) for url in urls]

    def __enter__(self) -> _Prober:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def _probe(self, url: str) -> None:
        with requests.Session() as session:
            while not self._stop.is_set():
                for method in ("getClusterInfo", "registerInstance"):
                    self._one(session, url, method)

    def _one(self, session: requests.Session, url: str, method: str) -> None:
        body = {"trace_id": "probe", "instance_id": "probe"} if method == "getClusterInfo" else {
            "instance_group": "default", "instance_id": "probe", "block_size": BLOCK,
            "location_spec_infos": [{"name": "tp0", "size": 64}]}
        try:
            reply = session.post(f"{url}/api/{method}", json=body, timeout=5)
            code = reply.json()["header"]["status"]["code"] if reply.status_code == 200 else None
        except (requests.RequestException, ValueError, KeyError) as exc:
            self.failures.append(f"{url} {method}: {type(exc).__name__}: {exc}")
            return
        if code not in _SWITCH_CODES:
            self.failures.append(f"{url} {method}: HTTP {reply.status_code} {reply.text[:200]}")
        self.answers += 1


def test_tair_leader_demote_hands_the_lease_over_and_side_ports_answer_throughout(tair_pair):
    """Tair's leaderDemote over HTTP on two real nodes: the follower takes the lease, discovery
    follows, and a Tair call to either side port while both nodes change role is answered (served,
    or SERVER_NOT_LEADER to rediscover on), never a refused or dropped connection."""
    pair = tair_pair(*FAST_LEASE, "--set", "ha.campaign_delay_ms=500")
    leader, follower = "n1", "n2"
    client = ManagerClient(pair.url(follower), instance_id="llm", auto_discover_leader=True)
    kept = http.client.HTTPConnection("127.0.0.1", pair.ports[leader], timeout=10)  # alive across the switch
    try:
        assert client.base_url == pair.url(leader)
        assert _ready(kept) == (200, "leader")
        where = kept.sock.getsockname()
        with _Prober([pair.url(leader), pair.url(follower)]) as prober:
            assert _tair_status(pair.url(leader), "getLeaderElectorConfig", {})["code"] == "OK"
            assert _tair_status(pair.url(leader), "leaderDemote", {"trace_id": "demote"})["code"] == "OK"
            _until("the follower never took the lease the leader handed over",
                   lambda: _discovered(client, pair, follower))
            # A write served by the new leader (the default storage is under n1's data dir: no blocks).
            client.register_instance({"instance_group": "default", "instance_id": "llm", "block_size": BLOCK,
                                      "location_spec_infos": [{"name": "tp0", "size": 64}]})
            time.sleep(0.5 * TIME_FACTOR)  # the prober keeps calling while the demoted node's follower stage serves too
        assert prober.failures == [], prober.failures[:5]
        assert prober.answers > 10
        # The connection opened before the switch is the one the demoted node's new stage answers on.
        assert _ready(kept) == (503, "follower") and kept.sock.getsockname() == where
        # The demoted node is a follower that names the new leader.
        client.close()  # discovery asks the address it was given: now the demoted node's
        client = ManagerClient(pair.url(leader), instance_id="llm", auto_discover_leader=True)
        assert client.base_url == pair.url(follower)
    finally:
        kept.close()
        client.close()


def _ready(conn: http.client.HTTPConnection) -> tuple[int, str]:
    """``GET /readyz`` on a kept-alive connection: (status, the role it names)."""
    conn.request("GET", "/readyz")
    reply = conn.getresponse()
    reply.read()  # the whole reply, so the connection can carry the next request
    return reply.status, reply.getheader("X-Kvcm-Role") or ""


def test_a_follower_answers_server_not_leader_at_once_while_its_leader_is_stopped_or_unknown(tair_pair):
    """The side port follows SERVER_NOT_LEADER only to a leader that answers: a stopped leader
    (its lease not yet expired) or none known is Tair's SERVER_NOT_LEADER, by name and at once,
    naming the leader where one is known, so Tair's client rediscovers instead of timing out."""
    import redis as redis_py

    # A long lease: the stopped leader stays the named holder for the whole test.
    pair = tair_pair("--set", "ha.lease_ms=30000", "--set", "ha.renew_ms=500")
    follower = pair.url("n2")
    register = {"instance_group": "default", "instance_id": "x", "block_size": BLOCK,
                "location_spec_infos": [{"name": "tp0", "size": 64}]}
    # While the leader answers, the follower forwards to it (and Tair's client is served)...
    assert _tair_status(follower, "registerInstance", register)["code"] == "OK"
    os.kill(pair.nodes["n1"].process.pid, signal.SIGSTOP)
    time.sleep(1.2 * TIME_FACTOR)  # past the second the follower trusts its last look at the leader
    # ...and once it stops, every call starts at the follower again and is refused there.
    status = _tair_status(follower, "registerInstance", register)
    assert status["code"] == "SERVER_NOT_LEADER", status
    assert f"the leader is n1 at {pair.endpoints['n1']}" in status["message"] and "does not answer" in status["message"]
    # Reads are the follower's own: answered, whatever the leader does.
    status = _tair_status(follower, "getCacheLocation", {"instance_id": "nobody", "query_type": "QT_BATCH_GET",
                                                          "block_keys": ["1"]})
    assert status["code"] == "INSTANCE_NOT_EXIST", status
    # No leader known (a lease record no node wrote holds the key): refused at once, naming none.
    with redis_py.Redis.from_url(pair.redis_url) as conn:
        conn.set(f"{{{pair.prefix}}}:leader", b"not a record", px=30000)
    deadline = time.monotonic() + 10
    while "no leader is known" not in (status := _tair_status(follower, "startWriteCache", {
            "instance_id": "x", "block_keys": ["1"]}))["message"]:
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    assert status["code"] == "SERVER_NOT_LEADER", status


class _ScriptedNode:
    """A real ZeroMQ RPC peer on loopback answering from a script: ``answer(method, params)`` gives
    ``(error, result)``, or None to leave the request unanswered (a node stopped after it last
    answered). For the one timing no real pair can hit on demand: a leader that stops within the
    second a follower trusts its last look at it."""

    def __init__(self, answer: Callable[[str, dict], tuple[dict | None, dict] | None]) -> None:
        import zmq

        from kvcm.proto import wire

        self._wire = wire
        self._answer = answer
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.asked: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            ident, payload = self._sock.recv_multipart()
            request = self._wire.parse_request(payload)
            self.asked.append(request.method)
            got = self._answer(request.method, request.params)
            if got is not None:
                self._sock.send_multipart([ident, self._wire.pack_response(request.msgid, *got)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        self._ctx.term()


def test_a_tair_call_sent_on_to_a_leader_that_stopped_since_it_last_answered_is_answered_within_seconds():
    """The follower's verdict that its leader answers is kept a second; a leader that stops in that
    second leaves the call it was sent unanswered. The side port waits a bounded time for it, not
    the RPC timeout: an idempotent call is SERVER_NOT_LEADER (Tair's client rediscovers and
    resends it), any other TIMEOUT (it may have run: not resent), and the next call is refused
    at once."""
    from kvcm.config import HttpConfig
    from kvcm.http import SideHttp
    from kvcm.metrics import Metrics

    leader = _ScriptedNode(lambda method, _: (None, {"leader": True}) if method == "get_manager_cluster_info" else None)
    detail = {"leader_endpoint": leader.endpoint, "leader_node_id": "n1"}
    refusal = {"code": 9, "name": "SERVER_NOT_LEADER", "detail": detail,
               "message": f"node n2 is not the leader; the leader is n1 at {leader.endpoint}"}
    follower = _ScriptedNode(lambda method, _: (refusal, None))
    # Two side ports of the follower, each with its own verdict: each asks the leader afresh.
    sides = [SideHttp(HttpConfig(port=0), Metrics(), follower.endpoint, lambda: True, lambda: True,
                      role=lambda: "follower") for _ in range(2)]
    try:
        for side in sides:
            side.start()
        url, other = (f"http://127.0.0.1:{side.port}" for side in sides)
        register = {"instance_group": "default", "instance_id": "x", "block_size": BLOCK,
                    "location_spec_infos": [{"name": "tp0", "size": 64}]}
        # A timeout well below the RPC timeout (30 s): waiting that long fails here.
        reply = requests.post(f"{url}/api/registerInstance", json=register, timeout=15).json()
        status = reply["header"]["status"]
        assert status["code"] == "SERVER_NOT_LEADER", status
        assert "did not answer register_instance within" in status["message"] and "retry" in status["message"]
        assert leader.asked.count("register_instance") == 1  # sent on once, after one look
        # The next call is refused at once: the leader is taken as not answering, not asked again.
        status = _tair_status(url, "registerInstance", register)
        assert status["code"] == "SERVER_NOT_LEADER" and "does not answer now" in status["message"], status
        assert leader.asked.count("register_instance") == 1
        # A write is not resent behind the caller's back: its outcome is unknown.
        status = requests.post(f"{other}/api/startWriteCache", json={"instance_id": "x", "block_keys": ["1"]},
                               timeout=15).json()["header"]["status"]
        assert status["code"] == "SERVICE_NOT_READY", status
        assert "TIMEOUT" in status["message"] and "may have run there; not resent" in status["message"], status
    finally:
        for side in sides:
            side.stop()
        leader.close()
        follower.close()
