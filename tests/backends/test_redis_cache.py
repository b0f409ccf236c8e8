"""The Redis writer's cache (:mod:`kvcm.backends.metastore.redis_cache`): a start+finish pair reads
back nothing the writer committed (three round trips: one read of the new key, two commits), what
a write transaction reads from memory is what Redis holds, a read that raced a commit is not
kept, a commit that failed or went in doubt leaves nothing stale, plain reads still go to Redis,
and the cache stays within its bytes."""

from __future__ import annotations

import shutil
import tempfile
import threading
import uuid

import pytest
import redis

from kvcm.backends.metastore.redis import Fenced, InDoubt, RedisStore
from kvcm.backends.metastore.redis_cache import MISS, CommittedCache
from kvcm.testing import start_subprocess, stop_subprocess
from tests.backends.test_redis_in_doubt import CuttingProxy
from tests.helpers import finish, register, start


@pytest.fixture
def sock_dir():
    path = tempfile.mkdtemp(prefix="kvcm-rc-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def writer(redis_server, tmp_path):
    store = RedisStore(redis_server.url, str(tmp_path / "data"), prefix=f"c{uuid.uuid4().hex[:10]}")
    store.enable_cache()
    yield store
    store.close()


def _calls(raw: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): row["calls"] for name, row in raw.info("commandstats").items()}


def test_a_write_pair_reads_back_nothing_the_leader_committed(redis_server, tmp_path, sock_dir):
    prefix = f"c{uuid.uuid4().hex[:10]}"
    server = start_subprocess(str(tmp_path / "data"), f"ipc://{sock_dir}/rpc", [
        "--set", "store.backend=redis", "--set", f"store.redis_url={redis_server.url}",
        "--set", f"store.redis_prefix={prefix}", "--set", "reclaim.enabled=false"])
    raw = redis.Redis.from_url(redis_server.url)
    try:
        with server.client() as c:
            register(c, "inst")
            for key in range(1, 6):  # warm: the usage row and the instance are known after these
                finish(c, start(c, [key], "inst"), instance="inst")
            raw.config_resetstat()
            pairs = 20
            for key in range(100, 100 + pairs):
                finish(c, start(c, [key], "inst"), instance="inst")
            calls = _calls(raw)
            # the new key's block record (it may exist: asked once), and the two commits; the
            # deleter's polls are scripts of their own, counted apart
            assert calls.get("hget", 0) + calls.get("hmget", 0) <= pairs + 1, calls
            assert calls["evalsha"] - calls.get("zrangebylex", 0) == 2 * pairs, calls
            got = c.call("get_cache_location", {"instance_id": "inst", "query_type": "batch_get",
                                                "block_keys": list(range(100, 100 + pairs))})["locations"]
            assert all(loc["location_specs"][0]["uri"] for loc in got)
    finally:
        stop_subprocess(server)


def test_write_transactions_read_what_redis_holds(writer):
    with writer.write() as txn:
        txn.put("blocks", b"a", b"1")
        txn.put("blocks", b"b", b"2")
    with writer.write() as txn:
        txn.delete("blocks", b"b")
    assert writer.cache is not None
    assert writer.cache.get("blocks", b"a") == b"1" and writer.cache.get("blocks", b"b") is None
    with writer.write() as txn:  # answered from memory, and right
        assert txn.get("blocks", b"a") == b"1" and txn.get_many("blocks", [b"a", b"b", b"c"]) == [b"1", None, None]
    with writer.read() as view:
        assert view.get("blocks", b"a") == b"1" and view.get("blocks", b"b") is None


def test_a_failed_commit_and_a_rolled_back_savepoint_leave_nothing_in_the_cache(writer, redis_server):
    with writer.write() as txn:
        txn.put("blocks", b"k", b"old")
    with writer.group(), pytest.raises(RuntimeError), writer.write() as txn:  # a savepoint rolled back
        txn.put("blocks", b"k", b"rolled back")
        raise RuntimeError
    redis.Redis.from_url(redis_server.url).set(writer.epoch_key, 99)
    writer.fencing_token = 1  # a deposed leader: its commit is refused as a whole
    with pytest.raises(Fenced), writer.write() as txn:
        txn.put("blocks", b"k", b"refused")
    writer.fencing_token = None
    with writer.write() as txn:
        assert txn.get("blocks", b"k") == b"old"


def test_plain_reads_go_to_redis(writer, redis_server):
    with writer.write() as txn:
        txn.put("blocks", b"k", b"v")
    raw = redis.Redis.from_url(redis_server.url)
    raw.hset(writer.hash_key("blocks"), b"k", b"changed behind the writer's back")  # never in production
    with writer.read() as view:
        assert view.get("blocks", b"k") == b"changed behind the writer's back"


def test_a_read_that_raced_a_commit_is_not_kept():
    cache = CommittedCache()
    token = cache.before_read()
    cache.begin_commit()  # another thread's commit begins while the read is on its way
    cache.fill(token, "blocks", [(b"k", b"old")])
    assert cache.get("blocks", b"k") is MISS
    cache.end_commit({"blocks": {b"k": b"new"}})
    late = cache.before_read()
    cache.fill(token, "blocks", [(b"k", b"old")])  # the raced read's answer arrives after the commit
    assert cache.get("blocks", b"k") == b"new"
    cache.fill(late, "blocks", [(b"j", None)])
    assert cache.get("blocks", b"j") is None  # known absent


def test_the_cache_holds_its_bytes():
    cache = CommittedCache(max_bytes=10_000)
    for i in range(1000):
        cache.fill(cache.before_read(), "blocks", [(i.to_bytes(8, "big"), b"x" * 100)])
    assert cache.size_bytes <= 10_000 and 0 < len(cache) < 100
    assert cache.get("blocks", (999).to_bytes(8, "big")) == b"x" * 100  # the newest stay
    assert cache.get("blocks", (0).to_bytes(8, "big")) is MISS


def test_a_commit_in_doubt_empties_the_cache_and_it_refills_once_settled(redis_server):
    proxy = CuttingProxy(redis_server.port)
    store = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", None, prefix=f"d{uuid.uuid4().hex[:10]}")
    store.enable_cache()
    try:
        with store.write() as txn:
            txn.put("blocks", b"k", b"before")
        assert store.cache is not None and len(store.cache) == 1
        proxy.cut("request")  # the commit never reaches Redis
        with pytest.raises(InDoubt), store.write() as txn:
            txn.put("blocks", b"k", b"maybe")
        assert len(store.cache) == 0
        proxy.restore()
        with store.write() as txn:  # settles first (not applied), then reads Redis
            assert txn.get("blocks", b"k") == b"before"
        assert store.cache.get("blocks", b"k") == b"before"
    finally:
        store.close()
        proxy.close()


def test_a_follower_store_does_not_cache(redis_server):
    store = RedisStore(redis_server.url, None, prefix=f"f{uuid.uuid4().hex[:10]}")
    try:
        store.read_only = "a follower"
        with pytest.raises(ValueError, match="read-only"):
            store.enable_cache()
    finally:
        store.close()


def test_concurrent_reads_and_commits_never_leave_a_stale_value(writer):
    """Readers hammer a key another thread keeps rewriting; afterwards the writer's view is the
    last value committed."""
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            with writer.read() as view:
                view.get("blocks", b"hot")

    readers = [threading.Thread(target=read) for _ in range(3)]
    for t in readers:
        t.start()
    for i in range(200):
        with writer.write() as txn:
            txn.put("blocks", b"hot", str(i).encode())
    stop.set()
    for t in readers:
        t.join()
    with writer.write() as txn:
        assert txn.get("blocks", b"hot") == b"199"
