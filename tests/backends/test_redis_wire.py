"""The Redis store's hot commands on redis-py's pooled connections (kvcm.backends.metastore.redis_wire):
the same replies as ``execute_command``, redis-py's retry of a dropped connection, a script Redis
forgot loaded again, errors typed, and the packer without hiredis."""

from __future__ import annotations

import uuid

import pytest
import redis

from kvcm.backends.metastore import redis_wire
from kvcm.backends.metastore.redis import RedisStore
from kvcm.backends.metastore.redis_wire import Wire
from kvcm.errors import Code, ServerError, Unavailable


@pytest.fixture
def rstore(redis_server, tmp_path):
    s = RedisStore(redis_server.url, str(tmp_path / "data"), prefix=f"w{uuid.uuid4().hex[:10]}")
    yield s
    s.close()


def _calls(raw: redis.Redis, command: str) -> int:
    return int(raw.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


@pytest.mark.parametrize("hiredis_packer", [True, False], ids=["hiredis", "redis-py packer"])
def test_replies_are_what_execute_command_returns(redis_server, monkeypatch, hiredis_packer):
    if not hiredis_packer:
        monkeypatch.setattr(redis_wire, "_PACK", None)
    client = redis.Redis.from_url(redis_server.url)
    wire = Wire(client)
    key = f"w{uuid.uuid4().hex}".encode()
    client.hset(key, mapping={b"a": b"1", b"\x00\xff": b"\r\n$3"})
    for command in ([b"HGET", key, b"a"], [b"HGET", key, memoryview(b"\x00\xff")], [b"HGET", key, b"zz"],
                    [b"HMGET", key, b"a", b"zz", b"\x00\xff"], [b"HLEN", key]):
        assert wire.command(*command) == client.execute_command(*command), command


def test_a_commit_after_redis_forgot_the_script_loads_it_again(rstore, redis_server):
    raw = redis.Redis.from_url(redis_server.url)
    with rstore.write() as txn:
        txn.put("blocks", b"a", b"1")
    raw.script_flush()  # as a restart without persistence, or a failover to a replica, leaves it
    with rstore.write() as txn:
        txn.put("blocks", b"b", b"2")
    assert sorted(raw.hkeys(rstore.hash_key("blocks"))) == [b"a", b"b"]


def test_a_pooled_connection_redis_dropped_is_replaced_without_an_error(rstore, redis_server, monkeypatch):
    """The connection dies between leaving the pool and its command (the pool's own check at
    checkout passed): redis-py's retry policy drops it and sends once more on a new one."""
    raw = redis.Redis.from_url(redis_server.url)
    with rstore.write() as txn:
        txn.put("blocks", b"a", b"1")
    pool = rstore.client.connection_pool
    checkout = pool.get_connection
    killed: list[int] = []

    def dying(*args, **kwargs):
        conn = checkout(*args, **kwargs)
        if conn._sock is not None and len(killed) < 2:
            port = conn._sock.getsockname()[1]
            for client in raw.client_list():
                if client["addr"].endswith(f":{port}"):
                    raw.client_kill_filter(_id=int(client["id"]))
                    killed.append(port)
        return conn

    monkeypatch.setattr(pool, "get_connection", dying)
    with rstore.read() as view:
        assert view.get("blocks", b"a") == b"1"
    with rstore.write() as txn:  # and the commit path the same
        txn.put("blocks", b"b", b"2")
    assert len(killed) == 2, killed
    assert raw.hget(rstore.hash_key("blocks"), b"b") == b"2"


def test_errors_come_out_typed(rstore, redis_server, redis_factory, tmp_path):
    raw = redis.Redis.from_url(redis_server.url)
    raw.set(rstore.hash_key("blocks"), b"not a hash")
    with pytest.raises(ServerError, match="WRONGTYPE") as refused, rstore.read() as view:
        view.get("blocks", b"a")
    assert refused.value.code == Code.IO_ERROR
    gone = redis_factory(name="gone")
    store = RedisStore(gone.url, str(tmp_path / "gone"), prefix="g")
    try:
        gone.stop()
        with pytest.raises(Unavailable) as down, store.read() as view:
            view.get_many("blocks", [b"a", b"b"])
        assert down.value.code == Code.SERVICE_NOT_READY
    finally:
        store.close()
