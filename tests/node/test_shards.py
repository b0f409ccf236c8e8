"""Shards on a real 3-master Redis Cluster: two shards of two ``kvcm serve`` nodes each, one
directory. A client given one seed reaches both shards' instances (real bytes at the URIs they
hand out), is redirected (``WRONG_SHARD``) the first time and routed after; a kill -9 of one
shard's leader fails over within the lease while the other shard's writer sees nothing; every
acknowledged write is readable after; the directory outlives a restart of every node."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest
import redis
from redis.crc import key_slot

from kvcm import Client
from kvcm.blocks import BlockIO
from kvcm.errors import Code, KvcmError
from kvcm.proto.results import Mask
from kvcm.testing import start_subprocess, stop_subprocess
from kvcm.testing.redis_cluster import RedisCluster
from tests.conftest import _redis_binary
from tests.helpers import TIME_FACTOR, one_leader
from tests.helpers import wait_until as _poll
from tests.node.test_ha import _raw_call

LEASE_MS, RENEW_MS = 1500, 500
wait_until = functools.partial(_poll, timeout=20.0 * TIME_FACTOR)
SPECS = [{"name": "tp0", "size": 64}]


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    _redis_binary()  # skips (or fails under KVCM_TEST_REQUIRE_REDIS=1) without a server
    with RedisCluster(str(tmp_path_factory.mktemp("cluster"))) as c:
        yield c


def _tags_on_different_masters(cluster: RedisCluster, stem: str) -> tuple[str, str]:
    """Two shard prefixes whose slots two different masters hold."""
    first = f"{stem}a"
    for n in range(200):
        other = f"{stem}b{n}"
        if cluster.node_for(other).port != cluster.node_for(first).port:
            return first, other
    raise AssertionError("no two prefixes on different masters")


class Shards:
    """Two shards (a, b) of two nodes (1, 2) on the cluster, sharing one directory."""

    def __init__(self, cluster: RedisCluster, root: str, sock_dir: str) -> None:
        self.cluster = cluster
        self.root = root
        stem = f"s{uuid.uuid4().hex[:8]}"
        self.directory = f"d{stem}"
        self.prefix = dict(zip("ab", _tags_on_different_masters(cluster, stem)))
        self.endpoints = {f"{s}{n}": f"ipc://{sock_dir}/{s}{n}" for s in "ab" for n in "12"}
        self.nodes: dict = {}

    def args(self, node: str) -> list[str]:
        shard = node[0]
        return ["--set", "store.backend=redis", "--set", f"store.redis_url={self.cluster.url}",
                "--set", f"store.redis_prefix={self.prefix[shard]}", "--set", "ha.enabled=true",
                "--set", f"ha.node_id={node}", "--set", f"ha.lease_ms={LEASE_MS}", "--set", f"ha.renew_ms={RENEW_MS}",
                "--set", f"shard.directory={self.directory}", "--set", f"shard.name={shard}",
                "--set", "cache.session_check_ms=50", "--set", "http.port=0", "--set", "reclaim.enabled=false"]

    def start(self, node: str) -> None:
        self.nodes[node] = start_subprocess(os.path.join(self.root, node), self.endpoints[node], self.args(node))

    def start_all(self) -> None:
        for node in self.endpoints:
            self.start(node)
        for shard in "ab":
            self.leader(shard)

    def leader(self, shard: str) -> str:
        return one_leader({n: e for n, e in self.endpoints.items() if n[0] == shard})

    def kill(self, node: str) -> None:
        stop_subprocess(self.nodes.pop(node), kill=True)

    def stop(self) -> None:
        for server in self.nodes.values():
            stop_subprocess(server, kill=True)
        self.nodes.clear()


@pytest.fixture
def shards(redis_cluster):
    sock_dir = tempfile.mkdtemp(prefix="kvcm-sh-", dir="/tmp")
    root = tempfile.mkdtemp(prefix="kvcm-shroot-")
    s = Shards(redis_cluster, root, sock_dir)
    s.start_all()
    yield s
    s.stop()
    shutil.rmtree(sock_dir, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)


def _group(c: Client, name: str, shard: str) -> None:
    c.call("create_instance_group", {"shard": shard, "instance_group": {
        "name": name, "storage_candidates": ["default-file"], "quota": {"capacity": 0},
        "reclaim_strategy": {"used_percentage": 1.0}}})


def _register(c: Client, instance: str, group: str) -> None:
    c.call("register_instance", {"instance_group": group, "instance_id": instance, "block_size": 4,
                                 "location_spec_infos": SPECS})


def _pattern(instance: str, key: int) -> bytes:
    return (f"{instance}/{key}/".encode() * 64)[:64]


def _write(c: Client, io: BlockIO, instance: str, keys: list[int]) -> None:
    session = c.start_write_cache(instance_id=instance, block_keys=keys, write_timeout_seconds=5.0)
    for key, location in zip(keys, session.locations):
        io.write(location.location_specs[0].uri, _pattern(instance, key))
    c.finish_write_cache(instance_id=instance, write_session_id=session.write_session_id,
                         success_blocks=Mask(offset=len(keys)))


def _read_back(c: Client, io: BlockIO, instance: str, keys: list[int]) -> None:
    found = c.get_cache_location(instance_id=instance, query_type="prefix_match", block_keys=keys)
    assert len(found.locations) == len(keys), f"{instance}: {len(found.locations)} of {len(keys)} keys found"
    for key, location in zip(keys, found.locations):
        out = bytearray(64)
        io.read_into(location.location_specs[0].uri, memoryview(out))
        assert bytes(out) == _pattern(instance, key), f"{instance}/{key}: wrong bytes"


def _setup(c: Client) -> None:
    _group(c, "ga", "a")
    _group(c, "gb", "b")
    _register(c, "ia", "ga")
    _register(c, "ib", "gb")


def test_each_shard_lives_on_its_own_master_and_the_directory_on_its_slot(shards):
    a, b = (shards.cluster.node_for(shards.prefix[s]) for s in "ab")
    assert a.port != b.port
    for shard in "ab":
        owner = redis.Redis(port=shards.cluster.node_for(shards.prefix[shard]).port)
        assert owner.exists(f"{{{shards.prefix[shard]}}}:deployment"), f"shard {shard}'s keys are not on its master"
    directory = redis.Redis(port=shards.cluster.node_for(f"kvcmdir:{shards.directory}").port)
    nodes = directory.hkeys(f"{{kvcmdir:{shards.directory}}}:nodes")
    assert sorted(n.decode() for n in nodes) == ["a/a1", "a/a2", "b/b1", "b/b2"]
    assert key_slot(f"{{kvcmdir:{shards.directory}}}:nodes".encode()) == key_slot(
        f"{{kvcmdir:{shards.directory}}}:groups".encode())


def test_one_seed_reaches_both_shards_with_real_bytes(shards):
    seed = shards.endpoints["a1"]
    with Client(seed, timeout=5.0) as c:
        _setup(c)
        ios = {i: BlockIO.for_instance(c, i) for i in ("ia", "ib")}
        for instance in ("ia", "ib"):
            _write(c, ios[instance], instance, [1, 2, 3, 4])
        for instance in ("ia", "ib"):
            _read_back(c, ios[instance], instance, [1, 2, 3, 4])
        for io in ios.values():
            io.close()
    # Each instance lives on its own shard only: its owner knows it, the other does not.
    with Client(shards.endpoints[shards.leader("b")], routed=False) as b:
        assert b.get_instance_info(instance_id="ib").instance_group == "gb"
        with pytest.raises(KvcmError) as wrong:
            b.get_instance_info(instance_id="ia")
        assert wrong.value.code is Code.WRONG_SHARD


def test_a_call_to_the_wrong_shard_names_the_owner_and_a_client_is_redirected_once(shards):
    with Client(shards.endpoints["a1"]) as c:
        _setup(c)
    leader_b = shards.endpoints[shards.leader("b")]
    for node in ("a1", "a2"):  # the leader and the follower of shard a answer alike
        err, result = _raw_call(shards.endpoints[node], "get_cache_location_len",
                                {"instance_id": "ib", "query_type": "prefix_match", "block_keys": [1]})
        assert err is not None and err["code"] == Code.WRONG_SHARD, (node, err, result)
        assert err["detail"]["shard"] == "b" and err["detail"]["leader_endpoint"] == leader_b
        assert set(err["detail"]["endpoints"].split(",")) == {shards.endpoints["b1"], shards.endpoints["b2"]}
    leader_a = shards.endpoints[shards.leader("a")]
    for method, params in (("start_write_cache", {"block_keys": [9]}), ("get_cache_location", {"block_keys": [1], "query_type": "prefix_match"}),
                           ("get_cache_meta", {"block_keys": [1]}), ("remove_cache", {"block_keys": [1]}),
                           ("match_engines", {"block_keys": [1]}), ("get_storage_specs", {}),
                           ("get_cache_location_len", {"token_ids": list(range(8)), "query_type": "prefix_match"}),
                           ("pin_cache", {"block_keys": [1], "ttl_seconds": 5})):
        err, _ = _raw_call(leader_a, method, {"instance_id": "ib", **params})  # costed, prepared or not
        assert err is not None and err["code"] == Code.WRONG_SHARD and err["detail"]["shard"] == "b", (method, err)
    with Client(shards.endpoints["a1"]) as c:
        c.get_cache_location_len(instance_id="ib", query_type="prefix_match", block_keys=[1])
        assert set(c._shard_clients) == {"b"}  # learnt from the one redirect
        # ... with the shard map, once: the seed's shard's other node joins the client's endpoints
        assert c.endpoints.all == [shards.endpoints["a1"], shards.endpoints["a2"]]
        before = _served(shards, "a")
        for _ in range(20):
            c.get_cache_location_len(instance_id="ib", query_type="prefix_match", block_keys=[1])
        assert _served(shards, "a") - before <= 1, "routed calls must not go through shard a again"


def _served(shards: Shards, shard: str) -> int:
    """Requests shard ``shard``'s nodes answered (their rpc metrics)."""
    total = 0
    for node, endpoint in shards.endpoints.items():
        if node[0] != shard or node not in shards.nodes:
            continue
        with Client(endpoint, routed=False, retries=0, timeout=2.0) as c:
            series = c.call("get_metrics")["metrics"].get("kvcm_rpc_requests_total", [])
        total += int(sum(s["value"] for s in series if s["labels"].get("method") == "get_cache_location_len"))
    return total


def test_lists_span_both_shards_and_kvcm_shards_lists_them(shards):
    with Client(shards.endpoints["b2"]) as c:
        _setup(c)
        groups = {g["name"] for g in c.call("list_instance_groups")["instance_group"]}
        assert {"ga", "gb"} <= groups
        instances = {i["instance_id"] for i in c.call("list_instance_info")["instance_info"]}
        assert instances == {"ia", "ib"}
    out = subprocess.run([sys.executable, "-m", "kvcm", "shards", "--endpoint", shards.endpoints["a2"]],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()[2:]}
    assert set(lines) == {"a", "b"}
    for shard in "ab":
        assert shards.endpoints[shards.leader(shard)] in lines[shard]
        assert lines[shard].split()[1] == "1"  # its own group ("default" is every shard's own, not placed)


def test_a_group_is_placed_on_the_least_loaded_shard(shards):
    with Client(shards.endpoints["a1"]) as c:
        _group(c, "g1", "a")
        _group(c, "g2", "a")
        c.call("create_instance_group", {"instance_group": {"name": "g3", "storage_candidates": ["default-file"]}})
        shard_map = c.call("get_shard_map")
    groups = {s["name"]: s["groups"] for s in shard_map["shards"]}
    assert groups == {"a": 2, "b": 1}, groups  # "default" is each shard's own, not placed


def test_killing_one_shard_s_leader_fails_over_and_the_other_shard_never_notices(shards):
    with Client(shards.endpoints["a1"]) as c:
        _setup(c)
    acked: dict[str, list[int]] = {"ia": [], "ib": []}
    errors: dict[str, list[str]] = {"ia": [], "ib": []}
    stop = threading.Event()

    def writer(instance: str) -> None:
        # Given shard a's two nodes, as a client of an HA deployment is; shard b's it learns.
        with Client([shards.endpoints["a1"], shards.endpoints["a2"]], timeout=2.0, retries=2) as c:
            key = 1000
            while not stop.is_set():
                key += 1
                try:
                    s = c.start_write_cache(instance_id=instance, block_keys=[key], write_timeout_seconds=5.0)
                    c.finish_write_cache(instance_id=instance, write_session_id=s.write_session_id,
                                         success_blocks=Mask(offset=1))
                except KvcmError as exc:
                    errors[instance].append(str(exc))
                    time.sleep(0.02)
                    continue
                acked[instance].append(key)

    threads = [threading.Thread(target=writer, args=(i,)) for i in acked]
    for t in threads:
        t.start()
    wait_until(lambda: len(acked["ia"]) > 20 and len(acked["ib"]) > 20, what="both writers going")
    victim = shards.leader("a")
    killed_wall = time.time()
    shards.kill(victim)
    survivor = "a2" if victim == "a1" else "a1"
    wait_until(lambda: shards.leader("a") == survivor, what="shard a's follower leads")
    with Client(shards.endpoints[survivor], routed=False) as c:
        took = c.call("get_manager_cluster_info")["self_leader_since_time"] / 1000 - killed_wall
    counted = len(acked["ia"])
    wait_until(lambda: len(acked["ia"]) > counted + 10, what="writes on shard a again")
    stop.set()
    for t in threads:
        t.join(30)
    # the lease won within lease + renew (plus 0.1 s for a late lease thread, as tests/node/test_ha.py)
    assert 0 < took <= (LEASE_MS + RENEW_MS) / 1000 + 0.1 * TIME_FACTOR, f"takeover took {took:.2f} s"
    assert errors["ib"] == [], f"shard b noticed: {errors['ib'][:3]}"
    with Client(shards.endpoints["b1"]) as c:
        for instance, keys in acked.items():
            found = c.get_cache_location_len(instance_id=instance, query_type="batch_get", block_keys=keys)
            assert found.cache_location_len == len(keys), f"{instance}: acknowledged writes lost"


def test_the_directory_outlives_a_restart_of_every_node(shards):
    with Client(shards.endpoints["a1"]) as c:
        _setup(c)
        io = BlockIO.for_instance(c, "ib")
        _write(c, io, "ib", [7, 8])
        io.close()
    shards.stop()
    shards.start_all()
    with Client(shards.endpoints["a2"]) as c:  # a seed of the other shard, a fresh client
        io = BlockIO.for_instance(c, "ib")
        _read_back(c, io, "ib", [7, 8])
        io.close()
        assert {s["name"] for s in c.call("get_shard_map")["shards"]} == {"a", "b"}


ADMIN_PW = "shard-admin-pw"


@pytest.fixture
def auth_shards(redis_cluster):
    sock_dir = tempfile.mkdtemp(prefix="kvcm-sha-", dir="/tmp")
    root = tempfile.mkdtemp(prefix="kvcm-sharoot-")
    s = Shards(redis_cluster, root, sock_dir)
    real_args = s.args
    s.args = lambda node: [*real_args(node), "--set", "auth.enabled=true",  # type: ignore[method-assign]
                           "--set", f"auth.admin_password={ADMIN_PW}"]
    for node in s.endpoints:
        s.start(node)
    yield s
    s.stop()
    shutil.rmtree(sock_dir, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)


def _led(s: Shards, shard: str, auth: dict) -> str:
    """The endpoint of ``shard``'s leader, asked with credentials."""
    found: list[str] = []

    def one() -> bool:
        found.clear()
        for node, endpoint in s.endpoints.items():
            if node[0] != shard:
                continue
            try:
                with Client(endpoint, timeout=1.0, retries=0, auth=auth, routed=False) as c:
                    if c.call("check_health")["is_leader"]:
                        found.append(endpoint)
            except KvcmError:
                pass
        return len(found) == 1
    wait_until(one, what=f"one leader of shard {shard}")
    return found[0]


def test_with_auth_a_redirect_goes_only_to_a_caller_that_may_use_the_owning_group(auth_shards):
    s = auth_shards
    admin = {"user": "admin", "password": ADMIN_PW}
    leaders = {shard: _led(s, shard, admin) for shard in "ab"}
    with Client(s.endpoints["a1"], auth=admin) as c:
        _setup(c)
        for shard in "ab":  # accounts are each shard's own: defined on both
            node = leaders[shard]
            with Client(node, auth=admin, routed=False) as one:
                one.call("add_account", {"user_name": "bob", "password": "bob-pw", "role": "user", "groups": ["gb"]})
                one.call("add_account", {"user_name": "eve", "password": "eve-pw", "role": "user", "groups": ["ga"]})
    params = {"instance_id": "ib", "query_type": "prefix_match", "block_keys": [1]}
    bob = _raw_call(s.endpoints["a1"], "get_cache_location_len", {**params, "auth": {"user": "bob", "password": "bob-pw"}})
    eve = _raw_call(s.endpoints["a1"], "get_cache_location_len", {**params, "auth": {"user": "eve", "password": "eve-pw"}})
    assert bob[0]["code"] == Code.WRONG_SHARD and bob[0]["detail"]["shard"] == "b"
    # eve may not use gb: on shard a, as on shard b, ib does not exist for her (no shard named)
    assert eve[0]["code"] == Code.INSTANCE_NOT_EXIST and "detail" not in eve[0]
    with Client(s.endpoints["a1"], auth={"user": "bob", "password": "bob-pw"}) as c:
        assert c.get_cache_location_len(**params).cache_location_len == 0


def test_event_sources_belong_to_their_instance_s_shard_and_a_router_is_redirected(shards):
    with Client(shards.endpoints["a1"]) as c:
        _setup(c)
        c.call("add_event_source", {"instance_id": "ib", "endpoint": "tcp://127.0.0.1:1", "source_id": "engine-b"})
        c.call("add_event_source", {"instance_id": "ia", "endpoint": "tcp://127.0.0.1:2", "source_id": "engine-a"})
        listed = {src["source_id"] for src in c.call("list_event_sources")["sources"]}
        assert listed == {"engine-a", "engine-b"}  # fanned out over both shards, merged
        matched = c.call("match_engines", {"instance_id": "ib", "block_keys": [1, 2], "include_stale": True})
        assert matched["instance_id"] == "ib"  # answered by shard b: shard a holds no "ib" to match
    for shard, source in (("a", "engine-a"), ("b", "engine-b")):
        with Client(shards.endpoints[shards.leader(shard)], routed=False) as one:
            assert {src["source_id"] for src in one.call("list_event_sources")["sources"]} == {source}


def test_the_asyncio_client_is_routed_alike(shards):
    import asyncio

    from kvcm.aio import Client as AsyncClient

    with Client(shards.endpoints["a1"]) as c:
        _setup(c)

    async def run() -> tuple[str, int]:
        async with AsyncClient(shards.endpoints["a1"]) as c:
            session = await c.start_write_cache(instance_id="ib", block_keys=[5, 6], write_timeout_seconds=5.0)
            await c.finish_write_cache(instance_id="ib", write_session_id=session.write_session_id,
                                       success_blocks=Mask(offset=2))
            found = await c.get_cache_location_len(instance_id="ib", query_type="prefix_match", block_keys=[5, 6])
            groups = await c.call("list_instance_groups")
            return ",".join(sorted(c._shard_clients)), found.cache_location_len, {g["name"] for g in groups["instance_group"]}

    shards_seen, found, groups = asyncio.run(run())
    assert (shards_seen, found) == ("a,b" if "a" in shards_seen else "b", 2)
    assert {"ga", "gb"} <= groups


def test_removals_leave_the_directory_after_their_commit(shards):
    directory = redis.Redis(port=shards.cluster.node_for(f"kvcmdir:{shards.directory}").port)
    key = f"{{kvcmdir:{shards.directory}}}"
    with Client(shards.endpoints["a1"]) as c:
        _setup(c)
        assert directory.hget(f"{key}:instances", "ib") == b"gb"
        c.call("remove_instance", {"instance_id": "ib"})
        wait_until(lambda: directory.hget(f"{key}:instances", "ib") is None, what="ib forgotten")
        c.call("remove_instance_group", {"name": "gb"})
        wait_until(lambda: directory.hget(f"{key}:groups", "gb") is None, what="gb's placement forgotten")
        _group(c, "gb", "a")  # the name is free again, on any shard
        assert directory.hget(f"{key}:groups", "gb") == b"a"


def test_a_cluster_that_is_down_or_moved_is_unavailable_not_an_io_error():
    from kvcm.backends.metastore.redis_errors import translate

    for exc in (redis.exceptions.ClusterDownError("The cluster is down"), redis.exceptions.TryAgainError("x"),
                redis.exceptions.MovedError("3999 127.0.0.1:6381"), redis.exceptions.AskError("3999 127.0.0.1:6381")):
        got = translate(exc)
        assert getattr(got, "code", None) is Code.SERVICE_NOT_READY, (exc, got)


def test_accounts_are_defined_on_every_shard_by_one_call_and_storages_stay_each_shard_s(shards, tmp_path):
    with Client(shards.endpoints["b1"]) as c:
        _setup(c)  # the client knows the deployment is sharded from its first redirect
        c.call("add_account", {"user_name": "carol", "password": "carol-pw", "role": "user", "groups": ["ga"]})
        with Client(shards.endpoints[shards.leader("a")], routed=False) as a:  # only shard a has dave
            a.call("add_account", {"user_name": "dave", "password": "dave-pw", "role": "user", "groups": ["ga"]})
        with pytest.raises(KvcmError) as again:
            c.call("add_account", {"user_name": "dave", "password": "dave-pw", "role": "user", "groups": ["ga"]})
        # a storage's root belongs to one deployment: added on the seed's shard only
        c.call("add_storage", {"storage": {"global_unique_name": "local", "storage_type": "file",
                                           "storage_spec": {"root_path": str(tmp_path / "blocks-b")}}})
    assert again.value.code is Code.DUPLICATE_ENTITY
    assert again.value.detail["taken_by"] == "b" and "not by: a" in again.value.message
    for shard in "ab":
        with Client(shards.endpoints[shards.leader(shard)], routed=False) as one:
            assert {"carol", "dave"} <= {a["user_name"] for a in one.call("list_account")["accounts"]}
            storages = {s["global_unique_name"] for s in one.call("list_storage")["storage"]}
            assert ("local" in storages) == (shard == "b")


def test_a_connector_given_one_seed_writes_and_reads_another_shard_s_instance(shards):
    from kvcm.connector import Connector

    with Client(shards.endpoints["a1"]) as c:
        _setup(c)
    tokens = list(range(100, 112))  # three blocks of 4
    with Connector(shards.endpoints["a1"], instance_id="ib", block_size=4) as conn:
        assert conn.lookup(tokens).blocks == 0
        with conn.begin_write(tokens) as session:
            for block in session.new_blocks:
                block.write("tp0", _pattern("ib", block.index))
        assert conn.lookup(tokens).blocks == 3
        for block in conn.read(tokens):
            assert bytes(block.read("tp0")) == _pattern("ib", block.index)


def test_a_refused_registration_or_placement_leaves_nothing_in_the_directory(shards):
    directory = redis.Redis(port=shards.cluster.node_for(f"kvcmdir:{shards.directory}").port)
    key = f"{{kvcmdir:{shards.directory}}}"
    with Client(shards.endpoints["a1"]) as c:
        c.call("create_instance_group", {"shard": "a", "instance_group": {
            "name": "full", "storage_candidates": ["default-file"], "max_instance_count": 1}})
        _register(c, "one", "full")
        for n in range(5):  # past the group's capacity: refused, and not recorded
            with pytest.raises(KvcmError) as refused:
                _register(c, f"more{n}", "full")
            assert refused.value.code is Code.REACH_MAX_ENTITY_CAPACITY
        with pytest.raises(KvcmError) as unknown:
            c.call("create_instance_group", {"shard": "zz", "instance_group": {"name": "g-nowhere"}})
        assert unknown.value.code is Code.INVALID_ARGUMENT
    assert {k.decode() for k in directory.hkeys(f"{key}:instances")} == {"one"}
    assert directory.hget(f"{key}:groups", "g-nowhere") is None


def test_lookups_of_made_up_names_are_bounded_per_second(redis_cluster):
    import msgpack
    import zmq

    sock_dir = tempfile.mkdtemp(prefix="kvcm-shl-", dir="/tmp")
    root = tempfile.mkdtemp(prefix="kvcm-shlroot-")
    s = Shards(redis_cluster, root, sock_dir)
    real_args = s.args
    s.args = lambda node: [*real_args(node), "--set", "shard.max_lookups_per_s=20"]  # type: ignore[method-assign]
    try:
        s.start_all()
        leader = s.endpoints[s.leader("a")]
        directory = redis.Redis(port=s.cluster.node_for(f"kvcmdir:{s.directory}").port)

        def hgets() -> int:
            return int(directory.info("commandstats").get("cmdstat_hget", {}).get("calls", 0))

        before, began = hgets(), time.monotonic()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(leader)
        for n in range(300):  # 300 made-up instance ids, as fast as they go
            sock.send(msgpack.packb([0, n, "get_instance_info", [{"instance_id": f"nobody-{n}"}]]))
        codes = []
        for _ in range(300):
            assert sock.poll(10_000), "a request went unanswered"
            codes.append(msgpack.unpackb(sock.recv(), raw=False)[2]["code"])
        sock.close()
        elapsed = time.monotonic() - began
        looked_up = hgets() - before
    finally:
        s.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    limited = codes.count(Code.RATE_LIMITED)
    assert set(codes) <= {Code.RATE_LIMITED, Code.INSTANCE_NOT_EXIST} and limited > 150, (limited, set(codes))
    # an instance costs at most two reads (its group, then the group's shard); a little slack for
    # the nodes' own placements
    assert looked_up <= 2 * (20 + 20 * elapsed) + 10, (looked_up, elapsed)
