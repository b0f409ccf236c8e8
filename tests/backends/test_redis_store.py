"""The Redis store beyond the shared contract: atomic commits, fencing, key layout, durability
(WAIT, AOF), connection forms, and a real ``kvcm serve`` on Redis through crashes and outages."""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
import uuid

import pytest
import redis
from redis.crc import key_slot

from kvcm.backends.metastore import u64
from kvcm.backends.metastore.redis import Fenced, NotReplicated, RedisStore, redact
from kvcm.errors import Code, KvcmError, ServerError, Unavailable
from kvcm.testing import start_subprocess, stop_subprocess
from tests.helpers import TIME_FACTOR, finish, hard_close, register, start, wait_for


def _prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def rstore(redis_server, tmp_path):
    s = RedisStore(redis_server.url, str(tmp_path / "data"), prefix=_prefix())
    yield s
    s.close()


def _raw(server) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def test_a_script_error_applies_nothing_of_the_commit(rstore, redis_server):
    """Redis keeps the writes a failing script made before its error: the commit script checks
    every key's type first, so a commit that fails on its last database wrote nothing."""
    with rstore.write() as txn:
        txn.put("blocks", b"old", b"1")
    raw = _raw(redis_server)
    raw.set(rstore.zset_key("sessions"), b"not a sorted set")
    released = []
    with pytest.raises(ServerError, match="KVCMTYPE"), rstore.write() as txn:
        txn.on_abort(lambda: released.append(1))
        txn.put("blocks", b"new", b"2")
        txn.delete("blocks", b"old")
        txn.put("sessions", b"s", b"3")
    assert released == [1]
    with rstore.read() as view:
        assert view.get("blocks", b"new") is None and view.get("blocks", b"old") == b"1"
    assert raw.hkeys(rstore.hash_key("blocks")) == [b"old"]


def test_a_commit_cut_off_while_sent_applies_nothing(rstore, redis_server):
    """A client that dies half-way through sending the commit command: Redis never runs it."""
    with rstore.write() as txn:
        txn.put("blocks", b"a", b"1")
    keys = [rstore.epoch_key, rstore.commit_key, rstore.versions_key, rstore.deployment_key,
            rstore.hash_key("blocks"), rstore.zset_key("blocks")]
    args = [b"", b"cut", b"", b"1", b"0", b"b", b"2"]
    parts = [b"EVALSHA", rstore.commit_script.sha.encode(), b"6", *keys, *args]
    command = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
    with socket.create_connection(("127.0.0.1", redis_server.port)) as conn:
        conn.sendall(command[: len(command) - 9])  # everything but the end of the last argument
    time.sleep(0.2 * TIME_FACTOR)  # proving a negative: the cut script is still not applied after a while
    raw = _raw(redis_server)
    assert raw.hkeys(rstore.hash_key("blocks")) == [b"a"] and raw.get(rstore.commit_key) != b"cut"
    with rstore.write() as txn:  # the same script sent whole is applied: the cut was what stopped it
        txn.put("blocks", b"b", b"2")
    assert sorted(raw.hkeys(rstore.hash_key("blocks"))) == [b"a", b"b"]


class _LosingProxy:
    """A loopback TCP proxy to Redis that, while ``lose`` is set, closes a connection instead of
    relaying the reply to a commit (EVALSHA): the command ran, its client never hears so."""

    def __init__(self, port: int) -> None:
        import threading

        self.target = port
        self.lose = False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            last: list[bytes] = [b""]
            threading.Thread(target=self._pipe, args=(client, server, last, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, last, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, last: list[bytes], replies: bool) -> None:
        try:
            while data := src.recv(65536):
                if not replies:
                    last[0] = data
                elif self.lose and b"EVALSHA" in last[0]:
                    raise OSError("reply lost")
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            hard_close(sock)

    def close(self) -> None:
        self.listener.close()


def test_a_commit_whose_reply_is_lost_is_found_applied(redis_server, tmp_path):
    proxy = _LosingProxy(redis_server.port)
    s = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", str(tmp_path / "d"), prefix=_prefix())
    fired = []
    try:
        with s.write() as txn:  # loads the script while replies still come back
            txn.put("blocks", b"a", b"1")
        proxy.lose = True
        with s.write() as txn:
            txn.put("blocks", b"b", b"2")
            txn.on_commit(lambda: fired.append("commit"))
            txn.on_abort(lambda: fired.append("abort"))
        assert fired == ["commit"]  # applied, so reported as committed, not failed
        assert _raw(redis_server).hget(s.hash_key("blocks"), b"b") == b"2"
    finally:
        s.close()
        proxy.close()


def test_fencing_refuses_the_whole_commit_once_the_epoch_is_higher(rstore, redis_server):
    rstore.fencing_token = 5
    with rstore.write() as txn:  # no epoch stored yet: this writer may commit
        txn.put("blocks", b"a", b"1")
    raw = _raw(redis_server)
    raw.set(rstore.epoch_key, 5)
    with rstore.write() as txn:  # the same epoch: still the writer
        txn.put("blocks", b"b", b"2")
    raw.set(rstore.epoch_key, 6)  # a later leader took over
    released = []
    with pytest.raises(Fenced) as info, rstore.write() as txn:
        txn.on_abort(lambda: released.append(1))
        txn.put("blocks", b"c", b"3")
        txn.put("instances", b"i", b"4")
    assert info.value.code == Code.SERVER_NOT_LEADER and released == [1]
    with rstore.read() as view:
        assert [k for k, _ in view.scan("blocks")] == [b"a", b"b"] and view.count("instances") == 0
    rstore.fencing_token = None  # no token: no check
    with rstore.write() as txn:
        txn.put("blocks", b"c", b"3")


def test_savepoints_roll_back_alone_and_their_reads_see_the_overlay(rstore):
    with rstore.write() as outer:
        outer.put("blocks", b"a", b"1")
        with pytest.raises(RuntimeError), rstore.write() as inner:
            inner.put("blocks", b"a", b"changed")
            inner.delete("blocks", b"a")
            inner.put("blocks", b"b", b"2")
            assert inner.get("blocks", b"a") is None and inner.count("blocks") == 1
            raise RuntimeError
        assert outer.get("blocks", b"a") == b"1" and outer.get("blocks", b"b") is None
        with rstore.write() as kept:
            kept.put("blocks", b"c", b"3")
        assert [k for k, _ in outer.scan("blocks")] == [b"a", b"c"]
    with rstore.read() as view:
        assert dict(view.scan("blocks")) == {b"a": b"1", b"c": b"3"}
    # A block that rolls back takes down what its committed inner blocks changed.
    with rstore.group():
        with pytest.raises(RuntimeError), rstore.write() as outer:
            with rstore.write() as inner:
                inner.put("blocks", b"d", b"4")
                inner.delete("blocks", b"a")
            raise RuntimeError
        with rstore.write() as txn:
            assert txn.get("blocks", b"d") is None and txn.get("blocks", b"a") == b"1"
    with rstore.read() as view:
        assert dict(view.scan("blocks")) == {b"a": b"1", b"c": b"3"}


def test_a_read_transaction_never_straddles_a_commit_of_this_process(rstore):
    """Redis has no snapshots: a commit of another thread waits for open read transactions, so
    two reads in one ``read()`` block see the same committed state."""
    import threading

    with rstore.write() as txn:
        txn.put_many("blocks", [(b"x", b"old"), (b"y", b"old")])
    committed = threading.Event()

    def writer():
        with rstore.write() as txn:
            txn.put_many("blocks", [(b"x", b"new"), (b"y", b"new")])
        committed.set()

    with rstore.read() as view:
        assert view.get("blocks", b"x") == b"old"
        thread = threading.Thread(target=writer)
        thread.start()
        committed.wait(0.5)  # time for the commit, had it not to wait for this read
        assert view.get("blocks", b"y") == b"old" and not committed.is_set()
    thread.join(10)
    assert committed.is_set()
    with rstore.read() as view:
        assert view.get_many("blocks", [b"x", b"y"]) == [b"new", b"new"]


def test_scan_orders_binary_keys_across_pages_and_overlay(rstore):
    keys = [b"\x00", b"\x00\x00", b"\x00\xff", b"\x7f", b"\xff", b"\xff\x00", b"\xff\xff", b"\xff\xff\xff"]
    many = [b"\x01" + u64(i) for i in range(1200)]  # more than one scan page
    with rstore.write() as txn:
        txn.put_many("blocks", [(k, k) for k in keys + many])
    with rstore.read() as view:
        got = [k for k, _ in view.scan("blocks")]
        assert got == sorted(keys + many)
        assert [k for k, _ in view.scan("blocks", prefix=b"\xff\xff")] == [b"\xff\xff", b"\xff\xff\xff"]
        assert [k for k, _ in view.scan("blocks", prefix=b"\x00")] == [b"\x00", b"\x00\x00", b"\x00\xff"]
        assert [k for k, _ in view.scan("blocks", start=b"\x7f", limit=3)] == [b"\x7f", b"\xff", b"\xff\x00"]
        assert len(list(view.scan("blocks", prefix=b"\x01"))) == 1200
    with rstore.write() as txn:
        txn.delete("blocks", b"\x7f")
        txn.put("blocks", b"\x80", b"new")
        assert [k for k, _ in txn.scan("blocks", start=b"\x02", limit=3)] == [b"\x80", b"\xff", b"\xff\x00"]
    picked = rstore.sample("blocks", 10, prefix=b"\xff")  # more than there are: each once
    assert sorted(picked) == [(k, k) for k in keys if k.startswith(b"\xff")]
    assert len({k for k, _ in rstore.sample("blocks", 50, prefix=b"\x01")}) == 50


def test_every_key_carries_the_hash_tag(rstore, redis_server):
    rstore.fencing_token = 1
    with rstore.write() as txn:
        for db in ("meta", "blocks", "sessions", "engine_blocks"):
            txn.put(db, b"k", b"v")
    keys = list(_raw(redis_server).scan_iter(match=f"*{rstore.prefix}*"))
    assert len(keys) == 10  # a hash and a sorted set per database, the commit marker, the versions
    assert all(k.startswith(b"{" + rstore.prefix.encode() + b"}:") for k in keys)
    assert len({key_slot(k) for k in keys}) == 1  # one Redis Cluster slot: multi-key scripts work there


def test_wait_replicas_acknowledged_by_a_real_replica(redis_factory, tmp_path):
    primary = redis_factory(name="primary")
    replica = redis_factory("--replicaof", "127.0.0.1", str(primary.port), name="replica")
    raw = _raw(primary)
    wait_for(lambda: raw.info("replication")["connected_slaves"] == 1, timeout=20)
    s = RedisStore(primary.url, str(tmp_path / "d"), prefix=_prefix(), wait_replicas=1, wait_timeout_ms=5000)
    try:
        with s.write() as txn:
            txn.put("blocks", b"a", b"1")
        assert _raw(replica).hget(s.hash_key("blocks"), b"a") == b"1"  # on the replica once acknowledged
    finally:
        s.close()


def test_wait_replicas_without_a_replica_times_out_as_an_error(redis_server, tmp_path):
    s = RedisStore(redis_server.url, str(tmp_path / "d"), prefix=_prefix(), wait_replicas=1, wait_timeout_ms=100)
    fired = []
    try:
        with pytest.raises(NotReplicated, match="0 replica") as info, s.write() as txn:
            txn.put("blocks", b"a", b"1")
            txn.on_commit(lambda: fired.append("commit"))
        assert info.value.code == Code.TIMEOUT
        # Applied on the primary: memory follows the store (on_commit ran), only the client hears "not confirmed".
        assert fired == ["commit"]
        with s.read() as view:
            assert view.get("blocks", b"a") == b"1"
    finally:
        s.close()


def test_password_file_and_password_in_the_url(redis_factory, tmp_path):
    from kvcm.config import load
    from kvcm.node.stores import open_store

    server = redis_factory("--requirepass", "s3cret-pw")
    with pytest.raises(Unavailable):
        RedisStore(server.url, None, prefix=_prefix())
    pw = tmp_path / "pw"
    pw.write_text("s3cret-pw\n")
    config = load(environ={}, overrides={"store": {
        "backend": "redis", "redis_url": server.url, "redis_password_file": str(pw),
        "data_dir": str(tmp_path / "d1"), "redis_prefix": _prefix()}})
    s = open_store(config)
    try:
        with s.write() as txn:
            txn.put("meta", b"k", b"v")
        assert "s3cret" not in s.describe()
    finally:
        s.close()
    in_url = f"redis://:s3cret-pw@127.0.0.1:{server.port}/0"
    assert "s3cret" not in redact(in_url)
    s = RedisStore(in_url, str(tmp_path / "d2"), prefix=_prefix())
    s.close()


def test_unix_socket_url(redis_factory, tmp_path):
    sock_dir = tempfile.mkdtemp(prefix="kvcm-redis-", dir="/tmp")  # short: sun_path has 108 bytes
    try:
        path = f"{sock_dir}/redis.sock"
        redis_factory("--unixsocket", path, "--unixsocketperm", "700")
        s = RedisStore(f"unix://{path}?db=0", str(tmp_path / "d"), prefix=_prefix())
        try:
            with s.write() as txn:
                txn.put("blocks", b"a", b"1")
            with s.read() as view:
                assert view.get("blocks", b"a") == b"1"
        finally:
            s.close()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_a_redis_restart_with_aof_always_keeps_committed_data(redis_factory, tmp_path):
    server = redis_factory("--appendonly", "yes", "--appendfsync", "always")
    s = RedisStore(server.url, str(tmp_path / "d"), prefix=_prefix())
    try:
        with s.write() as txn:
            txn.put_many("blocks", [(u64(i), b"v%d" % i) for i in range(100)])
        server.stop(kill=True)  # SIGKILL: only what was fsynced survives
        with pytest.raises(Unavailable), s.read() as view:
            view.get("blocks", u64(1))
        server.start()
        with s.read() as view:  # the same store object reconnects
            assert view.count("blocks") == 100 and view.get("blocks", u64(99)) == b"v99"
        with s.write() as txn:  # the scripts are loaded again after the restart (NOSCRIPT)
            txn.put("blocks", b"after", b"1")
    finally:
        s.close()


def test_a_second_store_on_the_same_data_dir_is_refused(redis_server, tmp_path):
    from kvcm.backends.metastore import DataDirLocked

    s = RedisStore(redis_server.url, str(tmp_path / "d"), prefix=_prefix())
    try:
        with pytest.raises(DataDirLocked):
            RedisStore(redis_server.url, str(tmp_path / "d"), prefix=_prefix())
    finally:
        s.close()


# -- a real kvcm serve on Redis --------------------------------------------------------------


@pytest.fixture
def sock_dir():
    path = tempfile.mkdtemp(prefix="kvcm-redis-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _serve(data, sock_dir, url, prefix):
    return start_subprocess(data, f"ipc://{sock_dir}/rpc", [
        "--set", "store.backend=redis", "--set", f"store.redis_url={url}", "--set", f"store.redis_prefix={prefix}",
        "--set", "cache.session_check_ms=50"])


def _found(c, keys):
    got = c.call("get_cache_location", {"instance_id": "inst", "query_type": "batch_get", "block_keys": keys})
    return [k for k, loc in zip(keys, got["locations"]) if loc["location_specs"][0]["uri"]]


def test_kvcm_on_redis_keeps_written_blocks_through_sigkill(redis_server, tmp_path, sock_dir):
    data, prefix = str(tmp_path / "data"), _prefix()
    server = _serve(data, sock_dir, redis_server.url, prefix)
    try:
        with server.client() as c:
            register(c, "inst")
            finish(c, start(c, [1, 2, 3], "inst"), instance="inst")
    finally:
        stop_subprocess(server, kill=True)
    assert _raw(redis_server).hlen(f"{{{prefix}}}:h:blocks".encode()) == 3
    server = _serve(data, sock_dir, redis_server.url, prefix)
    try:
        with server.client() as c:
            assert _found(c, [1, 2, 3, 4]) == [1, 2, 3]
    finally:
        stop_subprocess(server)


def test_kvcm_answers_typed_errors_while_redis_is_down_and_recovers(redis_factory, tmp_path, sock_dir):
    redis_srv = redis_factory()
    server = _serve(str(tmp_path / "data"), sock_dir, redis_srv.url, _prefix())
    try:
        with server.client() as c:
            register(c, "inst")
            finish(c, start(c, [1, 2], "inst"), instance="inst")
            redis_srv.stop(kill=True)
            for call in (lambda: _found(c, [1, 2]), lambda: start(c, [5], "inst")):
                with pytest.raises(KvcmError) as info:
                    call()
                assert info.value.code == Code.SERVICE_NOT_READY, info.value
            assert server.process.poll() is None  # kvcm keeps running
            redis_srv.start()  # no persistence: the data is gone, but kvcm serves again
            wait_for(lambda: _ok(lambda: c.call("check_health")), timeout=20)
            assert _found(c, [1]) == []
    finally:
        stop_subprocess(server)


def _ok(fn) -> bool:
    try:
        fn()
        return True
    except KvcmError:
        return False


# -- configuration and start-up ----------------------------------------------------------------


@pytest.mark.parametrize(("key", "value", "message"), [
    ("redis_url", "http://127.0.0.1:6379", "store.redis_url must be"),
    ("redis_url", "redis://127.0.0.1:99999/0", "store.redis_url is not a URL"),
    ("redis_prefix", "a{b}", "store.redis_prefix must be"),
    ("redis_prefix", "", "store.redis_prefix must be"),
    ("redis_wait_replicas", "-1", "store.redis_wait_replicas"),
    ("redis_wait_timeout_ms", "0", "store.redis_wait_timeout_ms"),
    ("redis_password_file", "/nonexistent/pw", "store.redis_password_file: no such file"),
    ("backend", "sqlite", "store.backend must be one of: lmdb, memory, redis"),
])
def test_bad_redis_settings_fail_naming_the_key(key, value, message):
    from kvcm.config import ConfigError, load

    with pytest.raises(ConfigError, match=message.replace("{", r"\{")):
        load(environ={}, overrides={"store": {key: value}})


def test_password_given_twice_is_refused(tmp_path):
    from kvcm.config import ConfigError, load

    pw = tmp_path / "pw"
    pw.write_text("x")
    with pytest.raises(ConfigError, match="give the password once"):
        load(environ={}, overrides={"store": {"redis_url": "redis://:p@h:1/0", "redis_password_file": str(pw)}})


def test_an_unreachable_redis_refuses_the_start(tmp_path):
    from kvcm.config import load
    from kvcm.errors import StartRefused
    from kvcm.node.stores import open_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free: nothing listens there
    config = load(environ={}, overrides={"store": {
        "backend": "redis", "redis_url": f"redis://:hidden-pw@127.0.0.1:{port}/0", "data_dir": str(tmp_path / "d")}})
    with pytest.raises(StartRefused, match="cannot be reached") as info:
        open_store(config)
    assert "hidden-pw" not in str(info.value)
    assert not (tmp_path / "d" / "kvcm.lock").exists()  # the refused start left no lock behind


def test_an_empty_prefix_beside_stored_blocks_refuses_the_start(redis_server, tmp_path, sock_dir):
    """A wrong URL, database or prefix must not make kvcm sweep the storages' blocks as orphans."""
    from kvcm.config import load
    from kvcm.errors import StartRefused
    from kvcm.node.stores import open_store

    data, prefix = str(tmp_path / "data"), _prefix()
    server = _serve(data, sock_dir, redis_server.url, prefix)
    try:
        with server.client() as c:
            register(c, "inst")
            finish(c, start(c, [1, 2], "inst"), instance="inst")
    finally:
        stop_subprocess(server)
    config = load(environ={}, overrides={"store": {"backend": "redis", "redis_url": redis_server.url,
                                                   "redis_prefix": _prefix(), "data_dir": data}})
    with pytest.raises(StartRefused, match="missing but"):
        open_store(config)
    open_store(config, orphans="adopt").close()  # the operator's explicit choice goes on


def test_versions_count_the_commits_that_touched_each_database(rstore):
    """A follower's cue to forget: one more per commit that touched the database, none for
    the others, none for an empty commit."""
    assert rstore.versions(["blocks", "instances"]) == (0, 0)
    with rstore.write() as txn:
        txn.put("blocks", b"a", b"1")
        txn.put("blocks", b"b", b"1")
    with rstore.write() as txn:
        txn.put("instances", b"i", b"1")
        txn.delete("blocks", b"a")
    with rstore.write():
        pass
    assert rstore.versions(["blocks", "instances", "storages"]) == (2, 1, 0)


def test_a_read_only_store_refuses_every_commit_and_writes_nothing(rstore):
    from kvcm.errors import Code, Unavailable

    rstore.read_only = "node f is a follower"
    with pytest.raises(Unavailable) as info, rstore.write() as txn:
        txn.put("blocks", b"a", b"1")
    assert info.value.code == Code.SERVER_NOT_LEADER and "follower" in info.value.message
    with rstore.read() as view:
        assert view.get("blocks", b"a") is None
    assert rstore.versions(["blocks"]) == (0,)
