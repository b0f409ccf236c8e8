"""The leader lease against a real redis-server: acquire, renew, lose, release, epochs, two
contenders, and a SIGSTOPped holder (a real subprocess) fenced after it resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import redis

from kvcm.backends.metastore.redis import Fenced, RedisStore
from kvcm.errors import Code
from kvcm.ha.lease import VALID_SHARE, Lease, not_leader, parse_holder
from tests.helpers import TIME_FACTOR, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def prefix() -> str:
    return f"l{uuid.uuid4().hex[:12]}"


@pytest.fixture
def client(redis_server):
    c = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    yield c
    c.close()


def lease(client, prefix, node: str, lease_ms: int = 1000, renew_ms: int = 200, **kw) -> Lease:
    return Lease(client, prefix, node, f"ipc:///tmp/{node}", lease_ms=lease_ms, renew_ms=renew_ms, **kw)


def test_acquire_names_the_holder_and_increments_the_epoch(client, prefix):
    fenced: list[int] = []
    a = lease(client, prefix, "n1", fence=fenced.append)
    assert a.try_acquire() and a.is_leader()
    assert a.epoch == 1 and fenced == [1]
    holder = parse_holder(client.get(f"{{{prefix}}}:leader"))
    assert holder is not None and (holder.node_id, holder.endpoint, holder.epoch) == ("n1", "ipc:///tmp/n1", 1)
    assert int(client.get(f"{{{prefix}}}:epoch")) == 1
    assert 0 < client.pttl(f"{{{prefix}}}:leader") <= 1000
    a.release()
    assert not a.is_leader() and client.get(f"{{{prefix}}}:leader") is None
    assert a.try_acquire() and a.epoch == 2 and fenced == [1, 2]


def test_a_second_contender_is_follower_and_sees_the_leader(client, prefix):
    a, b = lease(client, prefix, "n1"), lease(client, prefix, "n2")
    assert a.try_acquire()
    assert not b.try_acquire() and not b.is_leader()
    assert b.holder is not None and b.holder.node_id == "n1"
    err = not_leader(b.holder, "n2")
    assert err.code == Code.SERVER_NOT_LEADER and err.detail["leader_endpoint"] == "ipc:///tmp/n1"
    assert err.to_wire()["detail"] == {"leader_endpoint": "ipc:///tmp/n1", "leader_node_id": "n1"}
    assert int(client.get(f"{{{prefix}}}:epoch")) == 1  # a failed attempt takes no epoch


def test_renew_extends_and_a_foreign_value_is_not_renewed(client, prefix):
    a = lease(client, prefix, "n1", lease_ms=1000)
    assert a.try_acquire()
    client.pexpire(f"{{{prefix}}}:leader", 100)
    assert a.renew() and client.pttl(f"{{{prefix}}}:leader") > 500
    client.set(f"{{{prefix}}}:leader", b'{"node_id": "n9", "endpoint": "x", "epoch": 7}')
    assert not a.renew() and not a.is_leader()
    assert client.get(f"{{{prefix}}}:leader").startswith(b'{"node_id": "n9"')  # untouched
    a.release()  # compare-and-delete: not ours, kept
    assert client.get(f"{{{prefix}}}:leader") is not None


def test_a_late_release_leaves_the_next_term_alone(client, prefix):
    a, b = lease(client, prefix, "n1"), lease(client, prefix, "n2")
    assert a.try_acquire()
    client.pexpire(f"{{{prefix}}}:leader", 1)  # a's term ran out while it was not looking
    _wait(lambda: b.try_acquire())
    a.release()  # compare-and-delete: b's record is not a's
    holder = parse_holder(client.get(f"{{{prefix}}}:leader"))
    assert holder is not None and holder.node_id == "n2" and b.renew()


def test_a_holder_that_cannot_renew_stops_before_the_lease_expires(client, prefix):
    a = lease(client, prefix, "n1", lease_ms=600, renew_ms=100)
    assert a.try_acquire()
    began = time.monotonic()
    wait_until(lambda: not a.is_leader(), interval=0.005)
    stepped_down = time.monotonic() - began
    assert stepped_down <= VALID_SHARE * 0.6 + 0.01
    assert client.pttl(f"{{{prefix}}}:leader") > 0  # Redis still holds the key: it had not expired
    a.step()  # the thread's next round notices and drops the record
    assert not a.is_leader()


def test_lost_redis_means_follower_by_the_deadline(redis_factory, prefix):
    server = redis_factory()
    c = redis.Redis.from_url(server.url, socket_timeout=0.2, socket_connect_timeout=0.2)
    changes: list[bool] = []
    a = lease(c, prefix, "n1", lease_ms=800, renew_ms=100, on_change=changes.append).start()
    try:
        _wait(a.is_leader)
        server.stop(kill=True)
        began = time.monotonic()
        _wait(lambda: not a.is_leader())
        assert time.monotonic() - began < 0.8
        _wait(lambda: changes == [True, False])
    finally:
        a.stop(release=False)
        c.close()


def test_two_contenders_are_never_both_leader(client, prefix):
    """The holder stops renewing (its thread stopped, nothing released: as if it hung) four times;
    the other takes over only once the lease expired, and the stopped one still answers
    is_leader() by its deadline meanwhile: the two are never leader at once."""
    live = {n: lease(client, prefix, n, lease_ms=300, renew_ms=50).start() for n in ("n1", "n2")}
    hung: list[Lease] = []
    samples = 0
    try:
        for _ in range(4):
            _wait(lambda: any(x.is_leader() for x in live.values()))
            holder = next(x for x in live.values() if x.is_leader())
            holder.stop(release=False)
            hung.append(holder)
            other = next(x for x in live.values() if x is not holder)
            deadline = time.monotonic() + 5 * TIME_FACTOR
            while not other.is_leader():
                assert time.monotonic() < deadline, "no takeover"
                assert not (holder.is_leader() and other.is_leader())
                samples += 1
                time.sleep(0.001)  # sampling: the invariant is checked on every look
            assert not holder.is_leader()
            live[holder.node_id] = lease(client, prefix, holder.node_id, lease_ms=300, renew_ms=50).start()
    finally:
        for x in live.values():
            x.stop()
    assert samples > 20
    # At least one term each: the first and four takeovers. More when a starved live holder (a
    # loaded CI machine, 300 ms lease) missed its own renew deadline and took the lease again:
    # a new term then, which is what the epoch is for; never two leaders at once (checked above).
    assert int(client.get(f"{{{prefix}}}:epoch")) >= 5


def test_release_on_stop_lets_the_other_take_over_at_once(client, prefix):
    a = lease(client, prefix, "n1", lease_ms=5000, renew_ms=100).start()
    _wait(a.is_leader)
    b = lease(client, prefix, "n2", lease_ms=5000, renew_ms=100).start()
    try:
        a.stop()
        began = time.monotonic()
        _wait(b.is_leader)
        assert time.monotonic() - began < 2.0 * TIME_FACTOR  # well under the 5 s lease
        assert b.epoch == a.epoch + 1
    finally:
        b.stop()


_HOLDER = textwrap.dedent("""
    import sys, time, redis
    from kvcm.ha.lease import Lease
    from kvcm.backends.metastore.redis import RedisStore, Fenced
    url, prefix, data = sys.argv[1:4]
    store = RedisStore(url, data, prefix=prefix)
    client = redis.Redis.from_url(url, socket_timeout=1)
    lease = Lease(client, prefix, "paused", "ipc:///tmp/paused", lease_ms=600, renew_ms=100,
                  fence=lambda e: setattr(store, "fencing_token", e)).start()
    while not lease.is_leader():
        time.sleep(0.005)  # not a busy loop: it would take a core from the lease's own thread
    print("leader", lease.epoch, flush=True)
    sys.stdin.readline()  # resumed: the test asks for a commit
    leader = lease.is_leader()
    try:
        with store.write() as txn:
            txn.put("blocks", b"k", b"from the paused holder")
        print("committed", leader, flush=True)
    except Fenced as exc:
        print("fenced", leader, exc.code.name, flush=True)
""")


def test_sigstopped_holder_resumes_as_follower_and_its_commit_is_fenced(redis_server, client, prefix, tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, redis_server.url, prefix, str(tmp_path / "paused")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().split() == ["leader", "1"]
        os.kill(child.pid, signal.SIGSTOP)
        successor = lease(client, prefix, "n2", lease_ms=600, renew_ms=100)
        _wait(successor.try_acquire, timeout=5.0)
        assert successor.epoch == 2
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("commit\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["fenced", "False", "SERVER_NOT_LEADER"]
        assert client.hget(f"{{{prefix}}}:h:blocks", b"k") is None
        store = RedisStore(redis_server.url, str(tmp_path / "new"), prefix=prefix, fencing_token=successor.epoch)
        with store.write() as txn:  # the successor's token passes
            txn.put("blocks", b"k", b"v")
        store.close()
        old = RedisStore(redis_server.url, str(tmp_path / "old"), prefix=prefix, fencing_token=1)
        with pytest.raises(Fenced), old.write() as txn:
            txn.put("blocks", b"k", b"stale")
        old.close()
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait(10)


def _wait(cond, timeout: float = 5.0) -> None:
    wait_until(cond, timeout, interval=0.005)
