"""Two ``kvcm serve`` nodes on one Redis prefix under the leader lease: one leader, followers
refuse and name it, clients follow; kill -9 of the leader under 16 clients, five times in a row
on alternating nodes; a SIGSTOPped leader resumed cannot commit. Plus the ``[ha]`` config rules
and the client's leader following against a real follower."""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import msgpack
import pytest
import zmq

from kvcm import Client
from kvcm.config import ConfigError, load
from kvcm.errors import Code, KvcmError
from kvcm.testing import start_subprocess, stop_subprocess
from tests.helpers import TIME_FACTOR, register
from tests.helpers import wait_until as _poll

LEASE_MS, RENEW_MS = 1500, 500

wait_until = functools.partial(_poll, timeout=20.0)  # a failover outlasts the default 10 s


# -- config ------------------------------------------------------------------------------------


def _ha(**values):
    store = {"backend": "redis"} if values.pop("redis", True) else {}
    return load(None, environ={}, overrides={"ha": values, "store": store})


def test_ha_config_defaults_and_rules():
    cfg = load(None, environ={})
    assert (cfg.ha.enabled, cfg.ha.node_id, cfg.ha.lease_ms, cfg.ha.renew_ms) == (False, "", 3000, 1000)
    assert _ha(enabled=True, node_id="n1").ha.node_id == "n1"
    env = load(None, environ={"KVCM_HA_NODE_ID": "n7", "KVCM_HA_LEASE_MS": "5000"})
    assert (env.ha.node_id, env.ha.lease_ms) == ("n7", 5000)


@pytest.mark.parametrize(("values", "message"), [
    ({"enabled": True}, "ha.node_id is required"),
    ({"enabled": True, "node_id": "n1", "redis": False}, 'ha.enabled requires store.backend = "redis"'),
    ({"renew_ms": 1500}, "ha.renew_ms must be positive and below ha.lease_ms / 2"),
    ({"lease_ms": 2000, "renew_ms": 1000}, "ha.renew_ms must be positive and below ha.lease_ms / 2"),
    ({"renew_ms": 0}, "ha.renew_ms"),
    ({"lease_ms": 50}, "ha.lease_ms must be in"),
    ({"node_id": "a b"}, "ha.node_id must be"),
    ({"advertise_endpoint": "http://x"}, "ha.advertise_endpoint must be"),
    ({"lease": 5}, "unknown config key ha.lease"),
])
def test_bad_ha_settings_fail_naming_the_key(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        _ha(**values)


# -- two real nodes ------------------------------------------------------------------------------


@pytest.fixture
def sock_dir():
    path = tempfile.mkdtemp(prefix="kvcm-ha-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Pair:
    """Two kvcm nodes (n1, n2) on one Redis prefix."""

    def __init__(self, redis_url: str, root: str, sock_dir: str, extra: list[str] | None = None) -> None:
        self.redis_url = redis_url
        self.extra = list(extra or [])
        self.root = root
        self.prefix = f"h{uuid.uuid4().hex[:10]}"
        self.endpoints = {n: f"ipc://{sock_dir}/{n}" for n in ("n1", "n2")}
        self.nodes = {}

    def start(self, node: str):
        self.nodes[node] = start_subprocess(os.path.join(self.root, node), self.endpoints[node], [
            "--set", "store.backend=redis", "--set", f"store.redis_url={self.redis_url}",
            "--set", f"store.redis_prefix={self.prefix}", "--set", "ha.enabled=true",
            "--set", f"ha.node_id={node}", "--set", f"ha.lease_ms={LEASE_MS}", "--set", f"ha.renew_ms={RENEW_MS}",
            "--set", "cache.session_check_ms=50", "--set", "http.port=0", *self.extra])
        return self.nodes[node]

    def info(self, node: str) -> dict:
        with Client(self.endpoints[node], timeout=1.0, retries=0) as c:
            return c.call("get_manager_cluster_info")

    def leader(self) -> str:
        deadline = time.monotonic() + 20 * TIME_FACTOR
        while time.monotonic() < deadline:
            for node in self.nodes:
                try:
                    if self.info(node)["leader"]:
                        return node
                except KvcmError:
                    pass
            time.sleep(0.02)
        raise AssertionError("no leader")

    def stop(self) -> None:
        for server in self.nodes.values():
            stop_subprocess(server, kill=True)


@pytest.fixture
def pair(redis_factory, tmp_path, sock_dir):
    server = redis_factory("--appendonly", "yes", "--appendfsync", "always")
    p = Pair(server.url, str(tmp_path), sock_dir)
    p.start("n1")
    p.start("n2")
    yield p
    p.stop()


def _raw_call(endpoint: str, method: str, params: dict, timeout: float = 10.0):
    """One request on a bare DEALER: the reply as it is, no following (what the node answered)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(msgpack.packb([0, 7, method, [params]], use_bin_type=True))
        assert sock.poll(int(timeout * 1000), zmq.POLLIN), f"no reply from {endpoint}"
        _, msgid, err, result = msgpack.unpackb(sock.recv(), raw=False)
        assert msgid == 7
        return err, result
    finally:
        sock.close(0)


def _readyz(node) -> tuple[int, str]:
    with Client(node.endpoint, timeout=1.0) as c:
        port = c.call("check_health")["node"].get("http_port")
    if port is None:
        return 0, ""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_one_leader_followers_refuse_writes_naming_it_and_clients_follow(pair):
    leader = pair.leader()
    follower = "n2" if leader == "n1" else "n1"
    info = pair.info(follower)
    assert info["leader"] is False and info["leader_node_id"] == leader
    assert info["leader_endpoint"]["endpoint"] == pair.endpoints[leader]
    lead_info = pair.info(leader)
    assert lead_info["epoch"] == 1 and lead_info["self_leader_expiration_time"] > time.time() * 1000
    assert 0 < lead_info["self_leader_since_time"] <= time.time() * 1000 and info["self_leader_since_time"] == 0
    err, _ = _raw_call(pair.endpoints[follower], "register_instance", {"instance_id": "x"})
    assert err["code"] == Code.SERVER_NOT_LEADER
    assert err["detail"] == {"leader_endpoint": pair.endpoints[leader], "leader_node_id": leader}
    err, _ = _raw_call(pair.endpoints[follower], "get_cache_location",
                       {"instance_id": "x", "query_type": "batch_get", "block_keys": [1]})
    assert err["code"] == Code.INSTANCE_NOT_EXIST  # reads are answered by the follower itself
    # A client of the follower alone follows to the leader, for a write and the typed path.
    with Client(pair.endpoints[follower], timeout=2.0) as c:
        register(c, "inst")
        session = c.start_write_cache(instance_id="inst", block_keys=[1, 2])
        c.finish_write_cache(instance_id="inst", write_session_id=session.write_session_id,
                             success_blocks={"offset": 2})
        assert c.endpoint == pair.endpoints[leader]
    with Client(f"{pair.endpoints[follower]},{pair.endpoints[leader]}", timeout=2.0) as c:
        assert _found(c, [1, 2, 3]) == [1, 2]
    assert _readyz(pair.nodes[leader])[0] == 200 and "role: leader" in _readyz(pair.nodes[leader])[1]
    status, body = _readyz(pair.nodes[follower])
    assert status == 503 and "role: follower" in body


def test_aio_client_follows_the_leader(pair):
    import asyncio

    import kvcm.aio

    leader = pair.leader()
    follower = "n2" if leader == "n1" else "n1"

    async def go():
        async with kvcm.aio.Client([pair.endpoints[follower]], timeout=2.0) as c:
            await c.call("register_instance", {"instance_group": "default", "instance_id": "inst", "block_size": 4,
                                               "location_spec_infos": [{"name": "tp0", "size": 1024}],
                                               "model_deployment": {"model_name": "m", "dtype": "fp16"}})
            got = await asyncio.gather(*[c.get_cache_location(instance_id="inst", query_type="batch_get",
                                                              block_keys=[k]) for k in range(5)])
            return c.endpoint, len(got)

    assert asyncio.run(go()) == (pair.endpoints[leader], 5)


def _found(c, keys, instance: str = "inst"):
    got = c.call("get_cache_location", {"instance_id": instance, "query_type": "batch_get", "block_keys": keys})
    return [k for k, loc in zip(keys, got["locations"]) if loc["location_specs"][0]["uri"]]


class Load:
    """Clients writing (start + finish, one new key each) and reading back acknowledged keys,
    each thread with its own :class:`kvcm.Client` of ``endpoints``. ``paused()`` holds them
    between calls (a quiet moment to compare usage with a recount)."""

    def __init__(self, endpoints: list[str], writers: int = 2, readers: int = 1, instance: str = "inst") -> None:
        self.endpoints = endpoints
        self.instance = instance
        self.acked: list[int] = []
        self.tried: list[int] = []
        self.errors: dict[str, int] = {}
        self.reads = 0
        self.missing: list[int] = []  # acknowledged keys a read did not find (must stay empty)
        self._stop = threading.Event()
        self._go = threading.Event()
        self._go.set()
        self._n = writers + readers
        self._busy = threading.Semaphore(self._n)
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._write, args=(w,), daemon=True) for w in range(writers)]
        self._threads += [threading.Thread(target=self._read, daemon=True) for _ in range(readers)]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        for t in self._threads:
            t.join(30)

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._go.clear()
        for _ in range(self._n):  # every client between two calls
            assert self._busy.acquire(timeout=30 * TIME_FACTOR)
        try:
            yield
        finally:
            for _ in range(self._n):
                self._busy.release()
            self._go.set()

    def acked_count(self) -> int:
        with self._lock:
            return len(self.acked)

    def _turns(self) -> Iterator[None]:
        while not self._stop.is_set():
            self._go.wait()
            with self._busy:
                yield

    def _count(self, exc: KvcmError) -> None:
        with self._lock:
            self.errors[exc.code.name] = self.errors.get(exc.code.name, 0) + 1

    def _write(self, w: int) -> None:
        key = (w + 1) << 32
        with Client(self.endpoints, timeout=1.0) as c:
            for _ in self._turns():
                key += 1
                with self._lock:
                    self.tried.append(key)
                try:
                    s = c.start_write_cache(instance_id=self.instance, block_keys=[key], write_timeout_seconds=2.0)
                    c.finish_write_cache(instance_id=self.instance, write_session_id=s.write_session_id,
                                         success_blocks={"offset": 1})
                except KvcmError as exc:
                    self._count(exc)
                    continue
                with self._lock:
                    self.acked.append(key)

    def _read(self) -> None:
        with Client(self.endpoints, timeout=1.0) as c:
            for _ in self._turns():
                with self._lock:
                    keys = self.acked[-32:]
                if not keys:
                    time.sleep(0.01)  # pacing: nothing acknowledged to read yet
                    continue
                try:
                    found = set(_found(c, keys, self.instance))
                except KvcmError as exc:
                    self._count(exc)
                    continue
                with self._lock:
                    self.reads += 1
                    self.missing += [k for k in keys if k not in found]


KILLS = int(os.environ.get("KVCM_TEST_HA_KILLS", "5"))


def test_kill_9_of_the_leader_under_16_clients_five_times(pair):
    """16 clients (12 writing, 4 reading, each its own client of both nodes); kill -9 of the
    leader, alternating nodes, the killed node restarted as the follower each time. After each
    kill: a takeover within lease + renew (plus a start-up tolerance, below), every acknowledged
    write readable, no copy left ``writing`` past its session, usage equal to a recount."""
    endpoints = [pair.endpoints["n1"], pair.endpoints["n2"]]
    with Client(endpoints, timeout=2.0) as c:
        register(c, "inst")
    load = Load(endpoints, writers=12, readers=4).start()
    takeovers: list[float] = []  # kill -> the new leader serving
    won: list[float] = []  # kill -> the follower sending the acquire that won the lease
    killed_nodes: list[str] = []
    try:
        for _ in range(KILLS):
            wait_until(lambda: load.acked_count() > 20)  # writes through the current leader
            leader = pair.leader()
            other = "n2" if leader == "n1" else "n1"
            with load._lock:
                tried_before = list(load.tried)
            killed_wall = time.time()
            os.kill(pair.nodes[leader].process.pid, signal.SIGKILL)
            killed = time.monotonic()
            pair.nodes[leader].process.wait(10)
            seen: dict = {}

            def leads_now(o: str = other, seen: dict = seen) -> bool:
                try:
                    seen["info"] = pair.info(o)  # one call: the node is busy switching stages
                except KvcmError:
                    return False
                return bool(seen["info"]["leader"])

            wait_until(leads_now)
            takeovers.append(time.monotonic() - killed)
            won.append(seen["info"]["self_leader_since_time"] / 1000 - killed_wall)
            killed_nodes.append(leader)
            pair.start(leader)  # back as the follower: the next kill takes the other node
            assert pair.info(leader)["leader"] is False
            before = load.acked_count()
            wait_until(lambda b=before: load.acked_count() > b + 20)  # the load goes on at the new leader
            _check_after_kill(pair.endpoints[other], load, tried_before)
    finally:
        load.stop()
    print(f"takeover after kill -9 (lease {LEASE_MS} ms, renew {RENEW_MS} ms, 16 clients): lease won after "
          + ", ".join(f"{t * 1000:.0f}" for t in won) + " ms; serving after "
          + ", ".join(f"{t * 1000:.0f}" for t in takeovers) + " ms")
    assert all(a != b for a, b in itertools.pairwise(killed_nodes)), killed_nodes  # alternating
    # The lease runs out lease_ms after the last renew (before the kill) and the follower tries
    # every renew_ms: it wins within lease + renew of the kill. The 0.1 s is its lease thread
    # waking late on a 2-core machine busy with 16 clients and the other node.
    assert all(0 < t < (LEASE_MS + RENEW_MS) / 1000 + 0.1 * TIME_FACTOR for t in won), won
    # Then it builds its leader stage (reads the metadata, binds its ports) before it serves.
    assert max(takeovers) < (LEASE_MS + RENEW_MS) / 1000 + 1.0 * TIME_FACTOR, takeovers
    assert load.reads > 0 and load.missing == [], (load.missing[:5], load.errors)
    assert set(load.errors) <= {"TIMEOUT", "SERVER_NOT_LEADER", "SERVICE_NOT_READY", "SHUTTING_DOWN"}, load.errors
    pair.stop()
    check_offline(pair.redis_url, pair.prefix, os.path.join(pair.root, "check"), load.acked)


def _check_after_kill(leader_endpoint: str, load: Load, tried_before: list[int]) -> None:
    with Client(leader_endpoint, timeout=5.0) as c:
        with load._lock:
            acked = list(load.acked)
        assert _found_all(c, acked) == acked  # every acknowledged finish so far is readable
        # The dead leader's sessions (2 s) expire on the new leader: none of its copies stays writing.
        wait_until(lambda: _writing(c, tried_before) == [], timeout=10)
        with load.paused():
            with load._lock:
                tried = list(load.tried)
            # The reclaimer's gauge of the group's copies equals the copies get_cache_meta finds.
            wait_until(lambda: _usage_keys(c) == len(tried) - _statuses(c, tried).get("not_found", 0), timeout=10)


def _usage_keys(c) -> int:
    rows = c.call("get_metrics")["metrics"].get("kvcm_group_usage_keys", [])
    return int(sum(r["value"] for r in rows if r.get("labels", {}).get("group") == "default"))


def _statuses(c, keys) -> dict[str, int]:
    out: dict[str, int] = {}
    for at in range(0, len(keys), 500):
        metas = c.call("get_cache_meta", {"instance_id": "inst", "block_keys": keys[at:at + 500]})["metas"]
        for m in metas:
            out[m["status"]] = out.get(m["status"], 0) + 1
    return out


def _found_all(c, keys, instance: str = "inst") -> list[int]:
    out: list[int] = []
    for at in range(0, len(keys), 500):
        out += _found(c, keys[at:at + 500], instance)
    return out


def check_offline(redis_url: str, prefix: str, data_dir: str, acked: list[int], instance: str = "inst",
                  storages: bool = True) -> None:
    """The metadata on ``prefix`` read by a fresh in-process App (no HA) once every kvcm is down:
    every acknowledged key served, and the cache's invariants (usage equals a recount, no
    ``writing`` copy without its session; storages agree with the metadata unless not
    ``storages``) once the open sessions expired."""
    from unittest import mock

    import redis as redis_py

    from kvcm.cache import consistency
    from kvcm.node.app import App
    from kvcm.testing import make_test_config

    # A killed node's lease and a killed writer's mark stay until they expire; every kvcm is down,
    # so they are stale, and this App (without the lease, on its own data dir) would be refused.
    with redis_py.Redis.from_url(redis_url) as raw:
        raw.delete(f"{{{prefix}}}:leader", f"{{{prefix}}}:writer")
    config = make_test_config(data_dir, f"ipc://{data_dir}.rpc", {
        "store": {"backend": "redis", "redis_url": redis_url, "redis_prefix": prefix},
        "cache": {"session_check_ms": 50, "delete_poll_ms": 20}, "reclaim": {"enabled": False}})
    app = App(config).start()
    try:
        with Client(app.endpoint, timeout=5.0) as c:
            assert _found_all(c, acked, instance) == acked
        wait_until(lambda: len(app.cache.sessions) == 0 and app.cache.deleter.pending() == 0, timeout=10)
        if storages:
            app.cache.check()
        else:
            with mock.patch.object(consistency, "check_storages", lambda s: None):
                app.cache.check()
    finally:
        app.stop()


def _writing(c, keys) -> list[int]:
    out = []
    for at in range(0, len(keys), 500):
        chunk = keys[at:at + 500]
        metas = c.call("get_cache_meta", {"instance_id": "inst", "block_keys": chunk})["metas"]
        out += [k for k, m in zip(chunk, metas) if m["status"] == "writing"]
    return out


def test_a_sigstopped_leader_resumed_cannot_commit(pair):
    endpoints = [pair.endpoints["n1"], pair.endpoints["n2"]]
    with Client(endpoints, timeout=2.0) as c:
        register(c, "inst")
    leader = pair.leader()
    other = "n2" if leader == "n1" else "n1"
    pid = pair.nodes[leader].process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: _leads(pair, other), timeout=20)
        result: dict = {}
        # Queued in the stopped process's socket: it runs the request once resumed.
        sender = threading.Thread(target=lambda: result.update(reply=_raw_call(
            pair.endpoints[leader], "start_write_cache", {"instance_id": "inst", "block_keys": [99]},
            timeout=60 * TIME_FACTOR)))
        sender.start()
        time.sleep(0.3 * TIME_FACTOR)  # the request reaches the stopped process's socket: not observable
    finally:
        os.kill(pid, signal.SIGCONT)
    sender.join(90 * TIME_FACTOR)
    assert "reply" in result, "the resumed leader never answered the request queued while it was stopped"
    err, _ = result["reply"]
    assert err is not None and err["code"] == Code.SERVER_NOT_LEADER, err
    assert err["detail"]["leader_endpoint"] == pair.endpoints[other]
    wait_until(lambda: pair.info(leader)["leader"] is False)
    # The deposed node tore its leader stage down and serves as a follower now.
    wait_until(lambda: _health(pair.endpoints[leader]).get("is_leader") is False)
    assert pair.info(other)["epoch"] == 2
    with Client(endpoints, timeout=2.0) as c:
        metas = c.call("get_cache_meta", {"instance_id": "inst", "block_keys": [99]})["metas"]
        assert metas[0]["status"] == "not_found"  # nothing of the deposed leader's request


def _health(endpoint: str) -> dict:
    try:
        with Client(endpoint, timeout=1.0, retries=0) as c:
            return c.call("check_health")
    except KvcmError:
        return {}


def test_the_leader_stage_commits_with_its_epoch_and_is_fenced_by_a_newer_one(redis_server, sock_dir):
    import redis as redis_py

    from kvcm.ha.lease import Lease
    from kvcm.node.app import App
    from kvcm.testing import make_test_config

    prefix = f"h{uuid.uuid4().hex[:10]}"
    raw = redis_py.Redis.from_url(redis_server.url)
    lease = Lease(raw, prefix, "n1", f"ipc://{sock_dir}/rpc", lease_ms=60000, renew_ms=1000)
    assert lease.try_acquire()
    config = make_test_config(os.path.join(sock_dir, "data"), f"ipc://{sock_dir}/rpc", {
        "store": {"backend": "redis", "redis_url": redis_server.url, "redis_prefix": prefix},
        "ha": {"enabled": True, "node_id": "n1", "require_aof": False}})  # the session's Redis keeps no AOF
    app = App(config, lease=lease)
    try:
        assert app.store.fencing_token == lease.epoch == 1
        call = app.dispatcher.call
        call("register_instance", {"instance_group": "default", "instance_id": "inst", "block_size": 4,
                                   "location_spec_infos": [{"name": "tp0", "size": 1024}],
                                   "model_deployment": {"model_name": "m", "dtype": "fp16"}})
        # Background work runs only while the term is valid: an expired session stays while not.
        call("start_write_cache", {"instance_id": "inst", "block_keys": [7], "write_timeout_seconds": 0.05})
        time.sleep(0.1 * TIME_FACTOR)  # past the session's 0.05 s timeout on the app's real clocks
        expiry = next(t.fn for t in app.timers if t.name == "write-session-expiry")
        valid_until = lease._deadline
        lease._deadline = 0.0  # past the renew deadline
        assert expiry() is None and app.cache.recount_inflight()["inst"][0] == 1
        lease._deadline = valid_until
        assert expiry() == 1 and app.cache.recount_inflight().get("inst", [0])[0] == 0
        raw.incr(f"{{{prefix}}}:epoch")  # a newer term began (this lease still thinks it leads)
        with pytest.raises(KvcmError) as info:
            call("start_write_cache", {"instance_id": "inst", "block_keys": [1]})
        assert info.value.code == Code.SERVER_NOT_LEADER and "epoch" in info.value.message
    finally:
        app.stop()
        raw.close()


def _leads(pair, node) -> bool:
    try:
        return bool(pair.info(node)["leader"])
    except KvcmError:
        return False



# -- the client's endpoint list, against silent servers (real sockets that never answer) -------


class Silent:
    """A ROUTER that counts the requests it gets and answers none (a dead or hung server)."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)

    def methods(self) -> list[str]:
        got = []
        while self.sock.poll(50, zmq.POLLIN):
            frames = self.sock.recv_multipart()
            got.append(msgpack.unpackb(frames[-1], raw=False)[2])
        return got

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def silent_pair(sock_dir):
    a, b = Silent(f"ipc://{sock_dir}/a"), Silent(f"ipc://{sock_dir}/b")
    yield a, b, [f"ipc://{sock_dir}/a", f"ipc://{sock_dir}/b"]
    a.close()
    b.close()


def test_a_timed_out_idempotent_call_is_resent_to_the_next_endpoint(silent_pair):
    a, b, endpoints = silent_pair
    with Client(",".join(endpoints), timeout=0.2, retries=1) as c:
        with pytest.raises(KvcmError) as info:
            c.check_health()
        assert info.value.code == Code.TIMEOUT
    assert (a.methods(), b.methods()) == (["check_health"], ["check_health"])


def test_a_timed_out_write_is_never_resent_and_the_next_call_asks_the_next_endpoint(silent_pair):
    a, b, endpoints = silent_pair
    with Client(endpoints, timeout=0.2, retries=2) as c:
        with pytest.raises(KvcmError) as info:
            c.start_write_cache(instance_id="inst", block_keys=[1])
        assert info.value.code == Code.TIMEOUT
        assert (a.methods(), b.methods()) == (["start_write_cache"], [])
        with pytest.raises(KvcmError):
            c.call("finish_write_cache", {"instance_id": "inst", "write_session_id": "s"})
        assert (a.methods(), b.methods()) == ([], ["finish_write_cache"])


def test_aio_client_timeouts_follow_the_same_rule(silent_pair):
    import asyncio

    import kvcm.aio

    a, b, endpoints = silent_pair

    async def go():
        async with kvcm.aio.Client(endpoints, timeout=0.2, retries=1) as c:
            for call in (c.check_health(), c.start_write_cache(instance_id="inst", block_keys=[1])):
                with pytest.raises(KvcmError) as info:
                    await call
                assert info.value.code == Code.TIMEOUT

    asyncio.run(go())
    # check_health: a, then b; start_write_cache (the client now on a again): once, not resent.
    assert (a.methods(), b.methods()) == (["check_health", "start_write_cache"], ["check_health"])


def test_endpoint_lists_are_validated():
    with pytest.raises(KvcmError):
        Client(" , ")
    with Client("ipc:///tmp/x1, ipc:///tmp/x2") as c:
        assert c.endpoints.all == ["ipc:///tmp/x1", "ipc:///tmp/x2"] and c.endpoint == "ipc:///tmp/x1"


def test_leader_demote_hands_the_lease_over_and_holds_off_for_its_campaign_delay(pair):
    """``leader_demote``: the leader gives the lease up at its lease thread's next round and a
    follower takes over at once (not after the lease runs out); the demoted node does not contend
    again before its ``campaign_delay_time_ms``, even with no leader left."""
    leader = pair.leader()
    other = "n2" if leader == "n1" else "n1"
    err, _ = _raw_call(pair.endpoints[other], "leader_demote", {})
    assert err["code"] == Code.SERVER_NOT_LEADER and err["detail"]["leader_node_id"] == leader
    err, got = _raw_call(pair.endpoints[other], "get_leader_elector_config", {})
    assert err is None and got["campaign_delay_time_ms"] == 5000 and got["lease_ms"] == LEASE_MS
    err, got = _raw_call(pair.endpoints[leader], "update_leader_elector_config", {"campaign_delay_time_ms": 60_000})
    assert err is None and got["campaign_delay_time_ms"] == 60_000
    demoted_at = time.monotonic()
    err, got = _raw_call(pair.endpoints[leader], "leader_demote", {})
    assert err is None and got["demoted"] is True
    wait_until(lambda: _leads(pair, other))
    # Released, not left to expire: the follower, contending every renew, wins within about one.
    assert time.monotonic() - demoted_at < (LEASE_MS + RENEW_MS) / 1000, "handed over no faster than an expiry"
    assert pair.info(leader)["leader"] is False
    os.kill(pair.nodes[other].process.pid, signal.SIGKILL)  # no leader left now ...
    pair.nodes[other].process.wait(10)
    time.sleep((LEASE_MS + 3 * RENEW_MS) / 1000 * TIME_FACTOR)  # proving a negative: past a whole lease, no leader
    assert pair.info(leader)["leader"] is False  # ... and the demoted node still holds off
