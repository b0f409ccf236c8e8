"""kill -9 of ``redis-server`` (``appendfsync always``) under writing clients: kvcm answers the
data plane with ``SERVICE_NOT_READY`` at once (never a client timeout), ``/readyz`` turns 503, and
once redis-server is back on the same port and dir kvcm recovers by itself with every write it
acknowledged before the kill. The same for a node under the leader lease, whose lease lapses:
it steps down, and leads again (a higher epoch) once Redis is back."""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request
import uuid

import pytest

from kvcm import Client
from kvcm.errors import Code, KvcmError, Unavailable
from kvcm.testing import RunningServer, start_subprocess, stop_subprocess
from tests.helpers import register
from tests.node.test_ha import LEASE_MS, RENEW_MS, TIME_FACTOR, Load, _found_all, _readyz, check_offline, wait_until

# Well under the client's default 5 s: an answer within this is kvcm's own, not a timeout.
FAST_S = 2.0 * TIME_FACTOR


@pytest.fixture
def aof_redis(redis_factory):
    return redis_factory("--appendonly", "yes", "--appendfsync", "always")


def _serve(redis_url: str, prefix: str, data: str, endpoint: str, ha: bool = False) -> RunningServer:
    args = ["--set", "store.backend=redis", "--set", f"store.redis_url={redis_url}",
            "--set", f"store.redis_prefix={prefix}", "--set", "cache.session_check_ms=50"]
    if ha:
        args += ["--set", "ha.enabled=true", "--set", "ha.node_id=n1", "--set", f"ha.lease_ms={LEASE_MS}",
                 "--set", f"ha.renew_ms={RENEW_MS}"]
    return start_subprocess(data, endpoint, args)


def _refusal(endpoint: str, method: str, params: dict) -> KvcmError:
    """The error of one call with no retry and a client timeout well above FAST_S."""
    with Client(endpoint, timeout=2 * FAST_S, retries=0) as c:
        began = time.monotonic()
        with pytest.raises(KvcmError) as info:
            c.call(method, params)
    info.value.took = time.monotonic() - began  # type: ignore[attr-defined]
    return info.value


def _http_port(endpoint: str) -> int:
    with Client(endpoint, timeout=5.0) as c:
        return int(c.call("check_health")["node"]["http_port"])


def _probe(port: int) -> int:
    """``/readyz``'s status (the side port answers whatever the store does)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _kill(redis) -> None:
    os.kill(redis.proc.pid, signal.SIGKILL)
    redis.proc.wait(10)
    redis.proc = None


def test_kill_9_of_redis_under_load_refuses_fast_turns_unready_and_recovers(aof_redis, tmp_path):
    prefix = f"o{uuid.uuid4().hex[:10]}"
    endpoint = f"ipc://{tmp_path}/rpc"
    server = _serve(aof_redis.url, prefix, str(tmp_path / "data"), endpoint)
    try:
        with Client(endpoint, timeout=5.0) as c:
            register(c, "inst")
        port = _http_port(endpoint)
        assert _probe(port) == 200
        load = Load([endpoint], writers=6, readers=2).start()
        try:
            wait_until(lambda: load.acked_count() > 50)
            _kill(aof_redis)
            with load._lock:
                acked_before = list(load.acked)
            for method, params in (
                ("start_write_cache", {"instance_id": "inst", "block_keys": [1]}),
                ("get_cache_location", {"instance_id": "inst", "query_type": "batch_get", "block_keys": [1, 2]}),
                ("get_cache_meta", {"instance_id": "inst", "block_keys": [1, 2]}),
                ("remove_cache", {"instance_id": "inst", "block_keys": acked_before[:1]}),
            ):
                err = _refusal(endpoint, method, params)
                assert isinstance(err, Unavailable) and err.code == Code.SERVICE_NOT_READY, (method, err)
                assert err.took < FAST_S, (method, err.took)  # type: ignore[attr-defined]
            # What the node holds in memory it still serves (the single writer's memory is the
            # store's state); health and anything that must ask Redis are refused, typed.
            with Client(endpoint, timeout=2 * FAST_S, retries=0) as c:
                assert _found_all(c, acked_before[:8]) == acked_before[:8]
            assert _refusal(endpoint, "check_health", {}).code == Code.SERVICE_NOT_READY
            wait_until(lambda: _probe(port) == 503, timeout=5)
            errors_down = dict(load.errors)
            aof_redis.start()  # same port, same dir: the AOF is read back
            wait_until(lambda: _probe(port) == 200, timeout=10)
            before = load.acked_count()
            wait_until(lambda: load.acked_count() > before + 50)  # writes go through again
        finally:
            load.stop()
        # While Redis was away every failed call said so, typed; nothing timed out or broke.
        assert set(errors_down) <= {"SERVICE_NOT_READY"} and errors_down, errors_down
        assert set(load.errors) <= {"SERVICE_NOT_READY"}, load.errors
        assert load.missing == [], load.missing[:5]
        with Client(endpoint, timeout=5.0) as c:
            assert _found_all(c, acked_before) == acked_before  # nothing acknowledged before the kill lost
            assert _found_all(c, load.acked) == load.acked
    finally:
        stop_subprocess(server, kill=True)
    # A commit whose reply the kill lost ("outcome unknown") was settled once Redis was back: its
    # slots were given back only if Redis had not applied it, so storages agree with the metadata.
    check_offline(aof_redis.url, prefix, str(tmp_path / "check"), load.acked)


def _role(endpoint: str) -> tuple[bool, int] | None:
    try:
        with Client(endpoint, timeout=0.5, retries=0) as c:
            info = c.call("get_manager_cluster_info")
    except KvcmError:
        return None  # no answer: the node is between stages (its port is not bound)
    return bool(info["leader"]), int(info["epoch"])


def test_kill_9_of_redis_under_an_ha_leader_it_steps_down_and_leads_again(aof_redis, tmp_path):
    """What the lease does without Redis: renews fail, the leader steps down at its deadline
    (80 % of lease_ms) and serves as a follower (without follower reads: they need Redis too),
    answering writes with SERVER_NOT_LEADER while it keeps trying the lease every renew_ms. Once
    Redis is back it acquires a new term (the epoch survived in the AOF) and serves everything
    acknowledged before."""
    prefix = f"o{uuid.uuid4().hex[:10]}"
    endpoint = f"ipc://{tmp_path}/rpc"
    server = _serve(aof_redis.url, prefix, str(tmp_path / "data"), endpoint, ha=True)
    try:
        wait_until(lambda: _role(endpoint) == (True, 1))
        with Client(endpoint, timeout=5.0) as c:
            register(c, "inst")
        load = Load([endpoint], writers=4, readers=1).start()
        try:
            wait_until(lambda: load.acked_count() > 30)
            _kill(aof_redis)
            killed = time.monotonic()
            with load._lock:
                acked_before = list(load.acked)
            wait_until(lambda: _role(endpoint) == (False, 1), timeout=10)  # a follower now, not gone
            stepped_down = time.monotonic() - killed
            assert _readyz_or_none(server) != 200
            aof_redis.start()
            # Leading again, in a new term (the epoch survived in the AOF): asked in one call, as a
            # second one could land while the node still binds its leader stage's ports.
            wait_until(lambda: _role(endpoint) == (True, 2), timeout=20)
            before = load.acked_count()
            wait_until(lambda: load.acked_count() > before + 20)
        finally:
            load.stop()
        assert stepped_down < LEASE_MS / 1000 + FAST_S, stepped_down
        assert load.missing == [], load.missing[:5]
        with Client(endpoint, timeout=5.0) as c:
            assert _found_all(c, acked_before) == acked_before
            assert _found_all(c, load.acked) == load.acked
    finally:
        stop_subprocess(server, kill=True)
    check_offline(aof_redis.url, prefix, str(tmp_path / "check"), load.acked)  # as above


def _readyz_or_none(server: RunningServer) -> int | None:
    try:
        return _readyz(server)[0]
    except KvcmError:
        return None


def test_the_readiness_probe_pings_redis_at_most_once_a_second_however_hot(redis_server, tmp_path):
    import redis as redis_py

    from kvcm.backends.metastore.redis import PROBE_EVERY_S, RedisStore

    store = RedisStore(redis_server.url, str(tmp_path / "data"), prefix=f"o{uuid.uuid4().hex[:10]}")
    raw = redis_py.Redis.from_url(redis_server.url)
    try:
        def pings() -> int:
            return int(raw.info("commandstats").get("cmdstat_ping", {}).get("calls", 0))

        before = pings()
        began = time.monotonic()
        assert all(store.reachable() for _ in range(200))
        spent = time.monotonic() - began
        # One PING per started PROBE_EVERY_S, whatever the number of probes.
        assert pings() - before <= 2 + int(spent / PROBE_EVERY_S), (pings() - before, spent)
    finally:
        store.close()
        raw.close()
