"""Followers serve reads from the shared Redis store (``ha.follower_reads``), fresh after every
leader commit, and never write: two real ``kvcm serve`` nodes on one Redis prefix."""

from __future__ import annotations

import re
import shutil
import tempfile

import pytest
import redis
import requests

from kvcm import Client
from kvcm.errors import Code, KvcmError
from tests.helpers import add_file_storage, add_group, register, wait_until, write
from tests.node.test_ha import Pair, _raw_call


def _follower(p: Pair) -> tuple[str, str]:
    leader = p.leader()
    return leader, "n2" if leader == "n1" else "n1"


def _served(endpoint: str, keys: list[int], instance: str = "inst") -> list[int]:
    """The keys whose locations the node at ``endpoint`` itself serves (no following)."""
    err, got = _raw_call(endpoint, "get_cache_location",
                         {"instance_id": instance, "query_type": "batch_get", "block_keys": keys})
    assert err is None, err
    return [k for k, loc in zip(keys, got["locations"]) if loc["location_specs"] and loc["location_specs"][0]["uri"]]


def _pair(redis_factory, root: str, extra: list[str] | None = None):
    server = redis_factory("--appendonly", "yes", "--appendfsync", "always")
    sock_dir = tempfile.mkdtemp(prefix="kvcm-fr-", dir="/tmp")
    p = Pair(server.url, root, sock_dir, extra=extra)
    try:
        p.start("n1")
        p.start("n2")
        yield p
    finally:
        p.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.fixture
def pair(redis_factory, tmp_path):
    yield from _pair(redis_factory, str(tmp_path))


@pytest.fixture
def no_reads_pair(redis_factory, tmp_path):
    yield from _pair(redis_factory, str(tmp_path), ["--set", "ha.follower_reads=false"])


def test_a_follower_answers_reads_with_what_the_leader_just_committed(pair):
    leader, follower = _follower(pair)
    at = pair.endpoints[follower]
    with Client(pair.endpoints[leader], timeout=5.0) as c:
        register(c, "inst")
        write(c, [1, 2, 3])
        for _ in range(20):  # warm the follower's search cache, so forgetting it is what is tested
            assert _served(at, [1, 2, 3, 4]) == [1, 2, 3]
        c.call("remove_cache", {"instance_id": "inst", "block_keys": [2]})
        assert _served(at, [1, 2, 3, 4]) == [1, 3]  # a copy marked deleting is gone at once
        write(c, [4])
        assert _served(at, [1, 2, 3, 4]) == [1, 3, 4]
        err, length = _raw_call(at, "get_cache_location_len", {"instance_id": "inst", "query_type": "prefix_match",
                                                               "block_keys": [1, 3, 4, 2]})
        assert err is None and length == {"cache_location_len": 3}
        err, meta = _raw_call(at, "get_cache_meta", {"instance_id": "inst", "block_keys": [1, 2]})
        assert err is None and [m["status"] for m in meta["metas"]] == ["serving", "deleting"]
        err, _ = _raw_call(at, "get_instance_info", {"instance_id": "later"})
        assert err["code"] == Code.INSTANCE_NOT_EXIST
        register(c, "later")  # the registry read again: a new instance is known at once
        err, info = _raw_call(at, "get_instance_info", {"instance_id": "later"})
        assert err is None and info["instance_group"] == "default"
        err, specs = _raw_call(at, "get_storage_specs", {"instance_id": "later"})
        assert err is None and specs["storages"]
    # Writes are still the leader's: refused naming it, and the follower wrote nothing.
    err, _ = _raw_call(at, "start_write_cache", {"instance_id": "inst", "block_keys": [9]})
    assert err["code"] == Code.SERVER_NOT_LEADER and err["detail"]["leader_node_id"] == leader
    assert _served(at, [9]) == []


def test_a_storage_the_leader_disables_is_not_served_by_the_follower(pair, tmp_path):
    leader, follower = _follower(pair)
    with Client(pair.endpoints[leader], timeout=5.0) as c:
        add_file_storage(c, "nfs", str(tmp_path / "nfs"))
        add_group(c, "g", ["nfs"])
        register(c, "inst", group="g")
        write(c, [1, 2])
        assert _served(pair.endpoints[follower], [1, 2]) == [1, 2]
        c.call("disable_storage", {"storage_unique_name": "nfs"})
        assert _served(pair.endpoints[follower], [1, 2]) == []
        c.call("enable_storage", {"storage_unique_name": "nfs"})
        assert _served(pair.endpoints[follower], [1, 2]) == [1, 2]


def test_a_client_of_the_follower_reads_there_and_writes_on_the_leader(pair):
    leader, follower = _follower(pair)
    with Client(pair.endpoints[follower], timeout=5.0) as c:
        register(c, "inst")  # followed to the leader
        write(c, [1, 2])
        assert c.endpoint == pair.endpoints[leader]
    with Client(pair.endpoints[follower], timeout=5.0) as c:
        got = c.get_cache_location(instance_id="inst", query_type="prefix_match", block_keys=[1, 2, 3])
        assert len(got.locations) == 2 and c.endpoint == pair.endpoints[follower]  # served where asked


def test_without_follower_reads_a_follower_refuses_reads_too(no_reads_pair):
    leader, follower = _follower(no_reads_pair)
    with Client(no_reads_pair.endpoints[leader], timeout=5.0) as c:
        register(c, "inst")
    err, _ = _raw_call(no_reads_pair.endpoints[follower], "get_instance_info", {"instance_id": "inst"})
    assert err["code"] == Code.SERVER_NOT_LEADER


def test_a_follower_stage_store_refuses_every_commit(redis_server, tmp_path):
    """Whatever code path on a follower tries to write, its store refuses it."""
    from kvcm.config import load
    from kvcm.errors import Unavailable
    from kvcm.node.stores import open_redis as _open_redis

    config = load(None, environ={}, overrides={
        "store": {"backend": "redis", "redis_url": redis_server.url, "redis_prefix": "ro-test",
                  "data_dir": str(tmp_path)},
        "ha": {"enabled": True, "node_id": "f1"}})
    store = _open_redis(config, follower=True)
    try:
        with pytest.raises(Unavailable) as info, store.write() as txn:
            txn.put("meta", b"x", b"1")
        assert info.value.code == Code.SERVER_NOT_LEADER and "f1 is a follower" in info.value.message
    finally:
        store.close()


def _engine_match(endpoint: str, tokens: list[int]) -> dict[str, int]:
    err, got = _raw_call(endpoint, "match_engines", {"instance_id": "llm", "token_ids": tokens})
    assert err is None, err
    return {s["source_id"]: s["matched_blocks"] for s in got["sources"]}


def test_every_node_follows_the_event_sources_defined_once(pair):
    """A source added through the leader is defined in the shared store: the follower
    subscribes to it too and keeps its own engine index, so a router may ask either node; a
    source removed through the leader is dropped by both."""
    from kvcm.testing import FakeEnginePublisher
    from tests.helpers import wait_for

    leader, follower = _follower(pair)
    tokens = list(range(100, 116))
    with FakeEnginePublisher().start() as engine, Client(pair.endpoints[leader], timeout=5.0) as c:
        c.call("register_instance", {"instance_group": "default", "instance_id": "llm", "block_size": 4,
                                     "location_spec_infos": [{"name": "tp0", "size": 1024}]})
        c.call("add_event_source", {"source_id": "pod-a", "instance_id": "llm", "endpoint": engine.endpoint,
                                    "replay_endpoint": engine.replay_endpoint})
        err, listed = _raw_call(pair.endpoints[follower], "list_event_sources", {})
        assert err is None and [s["source_id"] for s in listed["sources"]] == ["pod-a"]
        engine.store([11, 12, 13], tokens[:12], block_size=4)
        for node in (leader, follower):
            assert wait_for(lambda n=node: _engine_match(pair.endpoints[n], tokens) == {"pod-a": 3}, timeout=10)
        err, state = _raw_call(pair.endpoints[follower], "get_host_cache_state", {"instance_id": "llm",
                                                                                  "token_ids": tokens})
        assert err is None, err  # the Tair-named alias is a read a follower answers too
        assert [(h["host_ip_port"], h["local"]) for h in state["hosts"]] == [("pod-a", 3)]
        c.call("remove_event_source", {"source_id": "pod-a"})
        assert _engine_match(pair.endpoints[follower], tokens) == {}


def test_a_leader_start_defines_its_own_sources_once_then_follows_the_shared_ones(redis_server, tmp_path):
    """The first leader on a Redis store (or a data dir from before shared definitions) defines
    the sources it follows; once the shared store defines any, a starting leader follows those."""
    import uuid

    from kvcm.backends.metastore.redis import RedisStore
    from kvcm.testing import serve_in_thread

    prefix = f"ad{uuid.uuid4().hex[:8]}"
    overrides = {"store": {"backend": "redis", "redis_url": redis_server.url, "redis_prefix": prefix}}
    data = str(tmp_path / "d")

    def sources(server) -> list[str]:
        with server.client() as c:
            return [s["source_id"] for s in c.call("list_event_sources", {})["sources"]]

    with serve_in_thread(data, overrides) as server, server.client() as c:
        c.call("register_instance", {"instance_group": "default", "instance_id": "llm", "block_size": 4,
                                     "location_spec_infos": [{"name": "tp0", "size": 1024}]})
        for sid in ("a", "b"):
            c.call("add_event_source", {"source_id": sid, "instance_id": "llm", "endpoint": "tcp://127.0.0.1:1"})
    shared = RedisStore(redis_server.url, None, prefix=prefix)
    try:
        with shared.write() as txn:  # as a store from before shared definitions: none defined
            txn.delete("source_defs", b"a")
            txn.delete("source_defs", b"b")
        with serve_in_thread(data, overrides) as server:
            assert sources(server) == ["a", "b"]
        with shared.read() as view:
            assert sorted(k for k, _ in view.scan("source_defs")) == [b"a", b"b"]
        with shared.write() as txn:  # another leader removed "b" meanwhile
            txn.delete("source_defs", b"b")
        with serve_in_thread(data, overrides) as server:
            assert sources(server) == ["a"]
    finally:
        shared.close()


def test_a_follower_s_front_door_is_the_leader_s_curve_on_rpc_and_credentials_on_http(redis_server, tmp_path):
    """A follower serves reads and /metrics: with CURVE and auth configured, its RPC port takes
    only the allowed client keys and its side port asks for credentials, as the leader's do."""
    import threading
    import urllib.error
    import urllib.request
    import uuid

    import redis
    from zmq.auth import create_certificates

    from kvcm.config import load
    from kvcm.ha.lease import Lease
    from kvcm.node.follower import FollowerStage

    _, server_secret = create_certificates(str(tmp_path), "server")
    alice_public, alice_secret = create_certificates(str(tmp_path), "alice")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copy(alice_public, allowed)
    prefix = f"fd{uuid.uuid4().hex[:8]}"
    config = load(None, environ={}, overrides={
        "server": {"endpoint": f"ipc://{tmp_path}/f.sock", "curve_secret_key_file": server_secret,
                   "curve_allowed_clients_dir": str(allowed)},
        "store": {"backend": "redis", "redis_url": redis_server.url, "redis_prefix": prefix,
                  "data_dir": str(tmp_path / "d")},
        "http": {"port": 0}, "auth": {"enabled": True},
        "ha": {"enabled": True, "node_id": "f1", "follower_reads": False}})
    lease = Lease(redis.Redis.from_url(redis_server.url), prefix, "f1", config.server.endpoint)
    stage = FollowerStage(config, lease, lambda: None)  # type: ignore[arg-type, return-value]
    thread = threading.Thread(target=stage.run, daemon=True)
    thread.start()
    try:
        with Client(stage.endpoint, timeout=1.0, retries=0) as plain, pytest.raises(KvcmError):
            plain.call("check_health", retry=False)  # plaintext: never answered
        with Client(stage.endpoint, timeout=5.0, curve_server_key=server_secret.replace(".key_secret", ".key"),
                    curve_client_keys=alice_secret) as kv:
            assert kv.call("check_health")["is_leader"] is False
        assert stage.http is not None
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{stage.http.port}/metrics", timeout=5)
        assert refused.value.code == 401
    finally:
        stage.request_stop()
        thread.join(10)


def test_a_turn_after_no_commit_costs_the_follower_one_get_not_every_version(pair):
    """The follower names the last commit it saw; only when Redis names another one does it read
    every database's version (and what changed)."""
    leader, follower = _follower(pair)
    at = pair.endpoints[follower]
    raw = redis.Redis.from_url(pair.redis_url)
    versions, marker = f"{{{pair.prefix}}}:versions".encode(), f"{{{pair.prefix}}}:commit".encode()
    with Client(pair.endpoints[leader], timeout=5.0) as c:
        register(c, "inst")
        write(c, [1, 2])
        assert _served(at, [1, 2]) == [1, 2]

        def commands(action) -> list[list[bytes]]:
            seen: list[list[bytes]] = []
            with raw.monitor() as m:
                action()
                raw.ping()  # a command of our own marks the end of what the action caused
                for entry in m.listen():
                    parts = entry["command"].encode("latin-1", "replace").split(b" ")
                    if parts[0] == b"PING":
                        break
                    seen.append(parts)
            return seen

        quiet = commands(lambda: [_served(at, [1, 2]) for _ in range(5)])
        assert sum(1 for cmd in quiet if cmd[0] == b"GET" and cmd[1] == marker) >= 5
        assert not [cmd for cmd in quiet if cmd[0] == b"HMGET" and cmd[1] == versions]
        write(c, [3])
        after = commands(lambda: _served(at, [1, 2, 3]))
        assert [cmd for cmd in after if cmd[0] == b"HMGET" and cmd[1] == versions]
        assert _served(at, [1, 2, 3]) == [1, 2, 3]


def test_every_node_lists_both_nodes_and_a_client_seeded_with_one_reads_from_both(pair):
    leader, follower = _follower(pair)

    def members(node: str) -> dict[str, str]:
        with Client(pair.endpoints[node], timeout=5.0, retries=0) as c:
            return {m["node_id"]: m["endpoint"] for m in c.call("get_manager_cluster_info")["members"]}

    wait_until(lambda: members(leader) == pair.endpoints and members(follower) == pair.endpoints,
               what="both nodes listed by both")
    raw = redis.Redis.from_url(pair.redis_url)
    assert set(raw.hkeys(f"{{{pair.prefix}}}:members".encode())) == {b"n1", b"n2"}
    with Client(pair.endpoints[leader], timeout=5.0, read_from="any") as kv:
        register(kv, "inst")
        write(kv, [1, 2])
        for _ in range(6):
            assert len(kv.get_cache_location(instance_id="inst", query_type="prefix_match",
                                             block_keys=[1, 2]).locations) == 2
    assert _ran(pair.endpoints[follower], "get_cache_location") == 3  # seeded with the leader only
    assert _ran(pair.endpoints[leader], "get_cache_location") == 3


def _ran(endpoint: str, method: str) -> float:
    """How many ``method`` requests the node at ``endpoint`` ran (its ``/metrics``)."""
    with Client(endpoint, timeout=5.0, retries=0) as c:
        port = c.call("check_health")["node"]["http_port"]
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    found = re.search(rf'^kvcm_rpc_requests_total{{method="{method}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0
