"""Two ``kvcm serve`` processes on one host, one shared data dir, the leader elected with a lock
file (``ha.coordination = file:///dir``), no Redis: exactly one leads; the follower answers
health, cluster info and reads from the same LMDB environment (over kvcm's RPC and Tair's HTTP)
and refuses writes naming the leader; ``leader_demote`` hands over; ``kill -9`` of the leader under
a writer hands over within ``lease_ms + renew_ms`` with every acknowledged block kept; and
``kvcm serve --standby`` is the same mode."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import pytest
import requests
import zmq

from kvcm import Client
from kvcm.config import ConfigError, load
from kvcm.errors import Code, KvcmError
from kvcm.testing import start_subprocess, stop_subprocess
from tests.helpers import TIME_FACTOR, one_leader, register, write
from tests.helpers import wait_until as _poll

LEASE_MS, RENEW_MS = 1000, 200

wait_until = functools.partial(_poll, timeout=20.0)


@pytest.fixture
def sock_dir():
    path = tempfile.mkdtemp(prefix="kvcm-fha-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Pair:
    """Two nodes (n1, n2) on one data dir, electing with a lock file."""

    def __init__(self, root: Path, sock_dir: str, standby: bool = False) -> None:
        self.data_dir = str(root / "data")
        self.coord = root / "coord"
        self.coord.mkdir(mode=0o700)
        self.standby = standby
        self.endpoints = {n: f"ipc://{sock_dir}/{n}" for n in ("n1", "n2")}
        self.nodes = {}

    def start(self, node: str):
        if self.standby:
            args = ["--standby"]
        else:
            args = ["--set", "ha.enabled=true", "--set", f"ha.coordination=file://{self.coord}",
                    "--set", f"ha.node_id={node}"]
        args += ["--set", f"ha.lease_ms={LEASE_MS}", "--set", f"ha.renew_ms={RENEW_MS}",
                 "--set", "ha.campaign_delay_ms=2000"]
        self.nodes[node] = start_subprocess(self.data_dir, self.endpoints[node], args)
        return self.nodes[node]

    def health(self, node: str) -> dict:
        with Client(self.endpoints[node], timeout=1.0, retries=0) as c:
            return c.call("check_health")

    def info(self, node: str) -> dict:
        with Client(self.endpoints[node], timeout=1.0, retries=0) as c:
            return c.call("get_manager_cluster_info")

    def leader(self, among: tuple[str, ...] = ("n1", "n2")) -> str:
        return one_leader({node: self.endpoints[node] for node in among})

    def stop(self) -> None:
        for server in self.nodes.values():
            stop_subprocess(server, kill=True)


@pytest.fixture
def pair(tmp_path, sock_dir):
    p = Pair(tmp_path, sock_dir)
    p.start("n1")
    p.start("n2")
    yield p
    p.stop()


def _raw_call(endpoint: str, method: str, params: dict, timeout: float = 10.0):
    """One request on a bare DEALER: the reply as the node answered it, no leader following."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(msgpack.packb([0, 7, method, [params]], use_bin_type=True))
        assert sock.poll(int(timeout * 1000), zmq.POLLIN), f"no reply from {endpoint}"
        _, _, err, result = msgpack.unpackb(sock.recv(), raw=False)
        return err, result
    finally:
        sock.close(0)


def _found(endpoint: str, keys: list[int]) -> list[int]:
    """The keys ``endpoint`` itself (no leader following) says it holds, 500 per call."""
    out: list[int] = []
    for at in range(0, len(keys), 500):
        chunk = keys[at:at + 500]
        err, result = _raw_call(endpoint, "get_cache_location",
                                {"instance_id": "inst", "query_type": "batch_get", "block_keys": chunk})
        assert err is None, err
        out += [k for k, loc in zip(chunk, result["locations"]) if loc["location_specs"][0]["uri"]]
    return out


def _tair(port: int, method: str) -> dict:
    reply = requests.post(f"http://127.0.0.1:{port}/api/{method}", json={}, timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_one_leader_the_follower_answers_health_info_and_reads(pair):
    leader = pair.leader()
    follower = "n2" if leader == "n1" else "n1"
    health = pair.health(follower)
    assert health["is_health"] is True and health["is_leader"] is False
    info = pair.info(follower)
    assert info["leader"] is False and info["leader_node_id"] == leader
    assert info["leader_endpoint"]["endpoint"] == pair.endpoints[leader]
    err, _ = _raw_call(pair.endpoints[follower], "register_instance", {"instance_id": "x"})
    assert err["code"] == Code.SERVER_NOT_LEADER
    assert err["detail"] == {"leader_endpoint": pair.endpoints[leader], "leader_node_id": leader}
    # Tair's HTTP surface on the follower: healthy, not the leader, and it names the leader.
    port = health["node"]["http_port"]
    tair_health = _tair(port, "checkHealth")
    assert tair_health["is_health"] is True and tair_health["is_leader"] is False
    named = _tair(port, "getManagerClusterInfo")["leader_endpoint"]
    assert (named["node_id"], named["meta_http_port"]) == (leader, pair.health(leader)["node"]["http_port"])
    # A block the leader acknowledged is readable on the follower within 100 ms.
    lags = []
    with Client(pair.endpoints[leader], timeout=5.0) as c:
        register(c, "inst")
        for key in range(1, 21):
            write(c, [key])
            acked = time.monotonic()
            while _found(pair.endpoints[follower], [key]) != [key]:
                assert time.monotonic() - acked < 0.1 * TIME_FACTOR, f"block {key} not on the follower in 100 ms"
            lags.append(time.monotonic() - acked)
    assert _found(pair.endpoints[follower], list(range(1, 22))) == list(range(1, 21))
    err, _ = _raw_call(pair.endpoints[follower], "get_instance_info", {"instance_id": "later"})
    assert err["code"] == Code.INSTANCE_NOT_EXIST
    with Client(pair.endpoints[leader], timeout=5.0) as c:
        register(c, "later")  # the follower reads its registry again at once
    err, result = _raw_call(pair.endpoints[follower], "get_instance_info", {"instance_id": "later"})
    assert err is None and result["instance_group"] == "default"
    err, specs = _raw_call(pair.endpoints[follower], "get_storage_specs", {"instance_id": "later"})
    assert err is None and specs["storages"]
    print(f"follower read lag after the ack: median {sorted(lags)[10] * 1000:.1f} ms, worst {max(lags) * 1000:.1f} ms")


def test_demote_hands_the_lead_over_and_the_old_leader_follows(pair):
    leader = pair.leader()
    follower = "n2" if leader == "n1" else "n1"
    with Client(pair.endpoints[leader], timeout=5.0) as c:
        register(c, "inst")
        write(c, [1, 2, 3])
        assert c.call("leader_demote")["demoted"] is True
    wait_until(lambda: pair.leader() == follower, what="the lead handed over")
    # The old leader's reading of the record is at most 0.1 s old: it names the new one soon after.
    wait_until(lambda: pair.info(leader)["leader_node_id"] == follower, what="the old leader naming the new one")
    assert pair.info(leader)["leader"] is False
    assert pair.info(follower)["epoch"] == 2
    with Client(pair.endpoints[follower], timeout=5.0) as c:
        write(c, [4])
    assert _found(pair.endpoints[leader], [1, 2, 3, 4]) == [1, 2, 3, 4]  # the old leader reads the new one's writes


def test_kill_9_of_the_leader_hands_over_in_time_with_every_acknowledged_block(pair):
    leader = pair.leader()
    follower = "n2" if leader == "n1" else "n1"
    acked: list[int] = []
    stop = threading.Event()

    def writer() -> None:
        key = 100
        with Client(f"{pair.endpoints[leader]},{pair.endpoints[follower]}", timeout=1.0) as c:
            register(c, "inst")
            while not stop.is_set():
                key += 1
                try:
                    write(c, [key])
                except KvcmError:
                    continue  # not acknowledged: not counted
                acked.append(key)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    wait_until(lambda: len(acked) >= 30)
    pair.nodes[leader].process.kill()
    killed = time.monotonic()
    while True:
        try:
            if pair.health(follower)["is_leader"]:
                break
        except KvcmError:
            pass
        assert time.monotonic() - killed < 10 * TIME_FACTOR, "no takeover"
        time.sleep(0.01)
    took = time.monotonic() - killed
    n_before = len(acked)
    wait_until(lambda: len(acked) >= n_before + 10)  # the writer goes on with the new leader
    stop.set()
    thread.join(10)
    assert _found(pair.endpoints[follower], acked) == acked
    print(f"takeover after kill -9: {took * 1000:.0f} ms (lease {LEASE_MS} + renew {RENEW_MS} ms)")
    assert took < (LEASE_MS + RENEW_MS) / 1000 * TIME_FACTOR


def test_standby_is_the_shorthand_of_this_mode(tmp_path, sock_dir):
    pair = Pair(tmp_path, sock_dir, standby=True)
    try:
        pair.start("n1")
        pair.start("n2")
        leader = pair.leader()
        follower = "n2" if leader == "n1" else "n1"
        health = pair.health(follower)
        assert health["is_health"] is True and health["is_leader"] is False
        facts = pair.info(follower)
        assert facts["leader_endpoint"]["endpoint"] == pair.endpoints[leader]
        assert (Path(pair.data_dir) / "leader.json").exists()  # the data dir is the coordination dir
        pair.nodes[leader].process.kill()
        assert pair.leader(among=(follower,)) == follower
    finally:
        pair.stop()


@pytest.mark.parametrize(("values", "store", "message"), [
    ({"enabled": True, "node_id": "n1", "coordination": "file:///tmp/x"}, "redis",
     'ha.enabled requires store.backend = "redis", or "lmdb" with ha.coordination'),
    ({"enabled": True, "node_id": "n1"}, "lmdb", 'ha.enabled requires store.backend = "redis"'),
    ({"coordination": "file://host/x"}, "lmdb", "ha.coordination must be"),
    ({"coordination": "/tmp/x"}, "lmdb", "ha.coordination must be"),
])
def test_coordination_settings_are_checked(values, store, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load(None, environ={}, overrides={"ha": values, "store": {"backend": store}})


def test_a_coordination_dir_others_may_write_refuses_the_start(tmp_path, sock_dir):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(RuntimeError, match="writable by nobody else"):
        start_subprocess(str(tmp_path / "data"), f"ipc://{sock_dir}/x", [
            "--set", "ha.enabled=true", "--set", f"ha.coordination=file://{shared}", "--set", "ha.node_id=x"],
            ready_timeout=15)
    assert os.listdir(shared) == []


LOCK_HOLDER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from kvcm.lockfile import hold_lock_file
hold_lock_file(sys.argv[1], "another kvcm", "data dir")
print("held", flush=True)
sys.stdin.readline()
"""


def test_a_new_leader_waits_for_the_data_dir_and_gives_the_term_up_if_it_stays_held(tmp_path, sock_dir):
    """The lease won, the data dir's own lock still held (the last leader's store closing, or a
    kvcm without the lease): the node waits for it, gives its term up past lease_ms, and leads
    once the lock is free."""
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    coord = tmp_path / "coord"
    coord.mkdir(mode=0o700)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(data / "kvcm.lock"), root],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    endpoint = f"ipc://{sock_dir}/w"
    log = tmp_path / "node.log"
    node = None
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_") or k.startswith("KVCM_TEST_")}
        with open(log, "wb") as out:
            node = subprocess.Popen([sys.executable, "-m", "kvcm", "serve", "--endpoint", endpoint, "--data-dir",
                                     str(data), "--http-port", "0", "--set", "ha.enabled=true",
                                     "--set", f"ha.coordination=file://{coord}", "--set", "ha.node_id=w",
                                     "--set", f"ha.lease_ms={LEASE_MS}", "--set", f"ha.renew_ms={RENEW_MS}",
                                     "--set", "ha.campaign_delay_ms=300"], env=env, stdout=out, stderr=subprocess.STDOUT)
        wait_until(lambda: "giving the leader term up" in log.read_text(errors="replace"), what="the term given up")
        assert node.poll() is None, log.read_text(errors="replace")
        holder.communicate("go\n", timeout=20)  # the data dir is free now
        wait_until(lambda: _health_or_none(endpoint) is not None and _health_or_none(endpoint)["is_leader"])
    finally:
        holder.kill()
        if node is not None:
            node.terminate()
            assert node.wait(20) == 0, log.read_text(errors="replace")


def _health_or_none(endpoint: str) -> dict | None:
    try:
        with Client(endpoint, timeout=0.5, retries=0) as c:
            return c.call("check_health")
    except KvcmError:
        return None
