"""A Redis that loses kvcm's data, keeps no AOF, or is shared by two deployments; a password file
others can read. Real redis-servers (restarted without persistence under a running kvcm), real
``kvcm serve`` processes and HA nodes: a lost store turns kvcm unready and every request is
refused typed (never answered from memory, never written into the empty store), a restart on it
refuses to start naming the remedy, the lease's epoch never goes back, a second deployment on a
prefix is refused."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import uuid

import pytest
import redis

from kvcm.backends.metastore.redis import RECORD_FILE, RedisStore, StoreLost
from kvcm.config import Config, load
from kvcm.errors import Code, StartRefused, Unavailable
from kvcm.ha.floor import EpochFloor
from kvcm.ha.lease import Lease
from kvcm.node.ha import HaNode
from kvcm.node.stores import open_store, redis_password
from kvcm.testing import RunningServer, start_subprocess, stop_subprocess
from tests.backends.test_redis_outage import _http_port, _probe, _refusal, _role
from tests.helpers import locate, register, write
from tests.node.test_ha import LEASE_MS, RENEW_MS, Pair, wait_until

NO_CONFIG = ("--user", "kvcm", "on", "nopass", "~*", "&*", "+@all", "-config")  # a managed Redis: no CONFIG
NO_CONFIG_NO_INFO = (*NO_CONFIG, "-info")


def _prefix() -> str:
    return f"x{uuid.uuid4().hex[:10]}"


def _store_args(url: str, prefix: str, *extra: str) -> list[str]:
    return ["--set", "store.backend=redis", "--set", f"store.redis_url={url}", "--set", f"store.redis_prefix={prefix}",
            "--set", "cache.session_check_ms=50", *extra]


def _ha_args(node: str = "n1", *extra: str) -> list[str]:
    return ["--set", "ha.enabled=true", "--set", f"ha.node_id={node}", "--set", f"ha.lease_ms={LEASE_MS}",
            "--set", f"ha.renew_ms={RENEW_MS}", *extra]


def _serve(data: str, endpoint: str, args: list[str]) -> RunningServer:
    return start_subprocess(data, endpoint, args)


def _refused(data: str, endpoint: str, args: list[str]) -> str:
    """``kvcm serve`` that must refuse to start: exit 2, and its one ``kvcm: ...`` line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_") or k.startswith("KVCM_TEST_")}
    done = subprocess.run([sys.executable, "-m", "kvcm", "serve", "--endpoint", endpoint, "--data-dir", data,
                           "--http-port", "0", "--set", "storage.allowed_roots=/tmp", *args],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    return _one_refusal(done.stderr)


def _one_refusal(stderr: str) -> str:
    """The refusal: one ``kvcm: ...`` line, the last thing the process wrote (what ran before may
    have logged, a Redis outage included)."""
    lines = [line for line in stderr.splitlines() if line.startswith("kvcm: ")]
    assert len(lines) == 1 and stderr.strip().splitlines()[-1] == lines[0], stderr[-3000:]
    return lines[0]


def _keys(url: str, prefix: str) -> list[bytes]:
    with redis.Redis.from_url(url) as raw:
        return sorted(raw.scan_iter(match=f"{{{prefix}}}*"))


def _restart_empty(server) -> None:
    """Stop redis-server and start it again on the same port: without persistence, empty."""
    server.stop(kill=True)
    server.start()


# -- a Redis that lost kvcm's data ------------------------------------------------------------------


def test_a_redis_restarted_without_persistence_turns_kvcm_unready_refuses_typed_and_the_restart_names_the_remedy(
        redis_factory, tmp_path):
    server = redis_factory()
    prefix, data, endpoint = _prefix(), str(tmp_path / "data"), f"ipc://{tmp_path}/rpc.sock"
    kvcm = _serve(data, endpoint, _store_args(server.url, prefix))
    try:
        with kvcm.client(timeout=5.0) as c:
            register(c, "inst")
            write(c, [1, 2])
            assert len(locate(c, [1, 2])) == 2  # in the node's memory now
        port = _http_port(endpoint)
        assert _probe(port) == 200
        _restart_empty(server)
        # Noticed without any request: the node's own watch turns it unready.
        wait_until(lambda: _probe(port) == 503, timeout=5)
        for method, params in (
            ("get_cache_location", {"instance_id": "inst", "query_type": "prefix_match", "block_keys": [1, 2]}),
            ("start_write_cache", {"instance_id": "inst", "block_keys": [3]}),
            ("register_instance", {"instance_group": "default", "instance_id": "other", "block_size": 4,
                                   "location_spec_infos": [{"name": "tp0", "size": 1024}]}),
            ("check_health", {}),
        ):
            err = _refusal(endpoint, method, params)
            assert isinstance(err, Unavailable) and err.code == Code.SERVICE_NOT_READY, (method, err)
            assert "lost this deployment's data" in err.message, (method, err.message)
        assert _keys(server.url, prefix) == []  # nothing was written into the empty store
    finally:
        assert stop_subprocess(kvcm) == 0
    line = _refused(data, endpoint, _store_args(server.url, prefix))
    record = os.path.join(data, RECORD_FILE)
    assert "lost this deployment's data" in line and f"remove {record}" in line, line
    assert _keys(server.url, prefix) == []  # the refused start wrote nothing either
    # The remedy, taken: the record goes, and the storages' blocks of the lost store are the
    # orphans kvcm asks about as for any lost metadata.
    os.remove(record)
    assert "--discard-orphans" in _refused(data, endpoint, _store_args(server.url, prefix))
    kvcm = _serve(data, endpoint, [*_store_args(server.url, prefix), "--discard-orphans"])
    try:
        with kvcm.client(timeout=5.0) as c:
            register(c, "inst")
            assert locate(c, [1, 2]) == []
    finally:
        assert stop_subprocess(kvcm) == 0


def test_a_commit_into_a_store_that_lost_its_deployment_key_writes_nothing(redis_server, tmp_path):
    """The commit script checks the deployment key itself: no write lands in a lost store, even
    before the watch has noticed."""
    prefix = _prefix()
    store = RedisStore(redis_server.url, str(tmp_path / "d"), prefix=prefix)
    raw = redis.Redis.from_url(redis_server.url)
    try:
        store.claim(str(tmp_path / "d"))
        with store.write() as txn:
            txn.put("blocks", b"a", b"1")
        raw.delete(store.deployment_key)
        with pytest.raises(StoreLost) as info, store.write() as txn:
            txn.put("blocks", b"b", b"2")
        assert info.value.code == Code.SERVICE_NOT_READY and "is gone" in info.value.message
        assert raw.hkeys(store.hash_key("blocks")) == [b"a"]
        assert store.reachable() is False
        with pytest.raises(StoreLost), store.read() as view:
            view.get("blocks", b"a")
    finally:
        store.close()
        raw.close()


def test_a_store_holding_another_deployment_is_lost_to_its_writer_and_its_followers(redis_server, tmp_path):
    """A store whose key names another deployment (rebuilt by someone else) is refused like a
    lost one: by the writer's watch and by a follower's freshness check."""
    prefix = _prefix()
    writer = RedisStore(redis_server.url, str(tmp_path / "w"), prefix=prefix)
    follower = RedisStore(redis_server.url, None, prefix=prefix)
    raw = redis.Redis.from_url(redis_server.url)
    try:
        writer.check_start(str(tmp_path / "w"), writer=True)
        writer.claim(str(tmp_path / "w"))
        follower.claim(str(tmp_path / "f"), create=False)
        assert follower.deployment == writer.deployment and follower.versions(["blocks"]) == (0,)
        raw.set(writer.deployment_key, "someone-else")
        writer.watch()
        assert "names deployment someone-else" in writer.lost
        with pytest.raises(StoreLost):
            follower.versions(["blocks"])
    finally:
        for s in (writer, follower):
            s.close()
        raw.close()


# -- appendonly ---------------------------------------------------------------------------------------


def _config(url: str, data: str, ha: bool, **ha_values: object) -> Config:
    return load(None, environ={}, overrides={
        "store": {"backend": "redis", "redis_url": url, "redis_prefix": _prefix(), "data_dir": data},
        "http": {"enabled": False},
        "ha": {"enabled": ha, "node_id": "n1", **ha_values} if ha else {}})


def _ha_node_start(config: Config) -> None:
    node = HaNode(config)
    node.lease._client.close()


@pytest.mark.parametrize(("server_args", "user", "how"), [
    ((), "", "CONFIG GET appendonly"),
    (NO_CONFIG, "kvcm@", "INFO persistence"),
], ids=["config", "managed-no-config"])
def test_appendonly_off_refuses_the_lease_and_warns_without_it(redis_factory, tmp_path, caplog, server_args, user, how):
    server = redis_factory(*server_args)
    url = server.url.replace("redis://", f"redis://{user}")
    with pytest.raises(StartRefused) as info:
        _ha_node_start(_config(url, str(tmp_path / "n1"), ha=True))
    assert f"appendonly no, by {how}" in info.value.message and "ha.require_aof" in info.value.message
    with pytest.raises(StartRefused):  # a leader stage's own start checks too
        open_store(_config(url, str(tmp_path / "n2"), ha=True))
    with caplog.at_level(logging.WARNING, logger="kvcm.backends.metastore"):
        _ha_node_start(_config(url, str(tmp_path / "n3"), ha=True, require_aof=False))
        open_store(_config(url, str(tmp_path / "solo"), ha=False)).close()
    warned = [r.getMessage() for r in caplog.records if "append-only" in r.getMessage()]
    assert len(warned) == 2 and all(f"by {how}" in w for w in warned), warned


@pytest.mark.parametrize(("server_args", "user"), [((), ""), (NO_CONFIG, "kvcm@")], ids=["config", "managed-no-config"])
def test_appendonly_on_starts_the_lease_without_a_warning(redis_factory, tmp_path, caplog, server_args, user):
    server = redis_factory("--appendonly", "yes", *server_args)
    url = server.url.replace("redis://", f"redis://{user}")
    with caplog.at_level(logging.WARNING, logger="kvcm.backends.metastore"):
        _ha_node_start(_config(url, str(tmp_path / "n1"), ha=True))
        open_store(_config(url, str(tmp_path / "solo"), ha=False)).close()
    assert not [r for r in caplog.records if "append-only" in r.getMessage()]


def test_a_redis_that_answers_neither_config_nor_info_says_so(redis_factory, tmp_path, caplog):
    server = redis_factory("--appendonly", "yes", *NO_CONFIG_NO_INFO)
    url = server.url.replace("redis://", "redis://kvcm@")
    with pytest.raises(StartRefused) as info:
        _ha_node_start(_config(url, str(tmp_path / "n1"), ha=True))
    message = info.value.message
    assert "cannot tell whether Redis keeps an append-only file" in message
    assert "CONFIG GET appendonly:" in message and "INFO persistence:" in message and "ha.require_aof" in message
    with caplog.at_level(logging.WARNING, logger="kvcm.backends.metastore"):
        open_store(_config(url, str(tmp_path / "solo"), ha=False)).close()
    assert [r for r in caplog.records if "cannot tell" in r.getMessage()]


def test_kvcm_serve_under_the_lease_on_a_redis_without_aof_exits_naming_the_setting(redis_factory, tmp_path):
    server = redis_factory()
    line = _refused(str(tmp_path / "d"), f"ipc://{tmp_path}/rpc.sock", [*_store_args(server.url, _prefix()), *_ha_args()])
    assert "appendonly no" in line and "ha.require_aof = false" in line, line


# -- the lease's epoch ---------------------------------------------------------------------------------


def test_the_epoch_floor_lifts_a_lease_on_a_redis_that_lost_its_epoch(redis_factory, tmp_path):
    """n1 held three terms; n2 only saw them as a follower. Redis loses everything: whichever
    acquires next starts above every epoch it has seen, not at 1."""
    server = redis_factory()
    client = redis.Redis.from_url(server.url, socket_timeout=2)
    prefix = _prefix()

    def node(name: str) -> Lease:
        return Lease(client, prefix, name, f"ipc:///tmp/{name}", lease_ms=5000, renew_ms=1000,
                     floor=EpochFloor(str(tmp_path / f"{name}-epoch")))

    try:
        n1, n2 = node("n1"), node("n2")
        for term in (1, 2, 3):
            assert n1.try_acquire() and n1.epoch == term
            assert not n2.try_acquire() and n2.holder is not None and n2.holder.epoch == term
            n1.release()
        assert (tmp_path / "n1-epoch").read_text() == "3\n" and (tmp_path / "n2-epoch").read_text() == "3\n"
        _restart_empty(server)
        assert node("n2").try_acquire()  # a new process: the floor comes from the data dir
        assert int(client.get(f"{{{prefix}}}:epoch")) == 4
        _restart_empty(server)
        later = node("n1")
        assert later.try_acquire() and later.epoch == 4  # n1's floor is 3: it never saw n2's term 4
    finally:
        client.close()


def test_an_ha_node_on_a_lost_store_stops_naming_the_remedy_and_its_next_term_is_a_new_epoch(
        redis_factory, tmp_path):
    server = redis_factory()
    prefix, data, endpoint = _prefix(), str(tmp_path / "n1"), f"ipc://{tmp_path}/rpc.sock"
    args = [*_store_args(server.url, prefix), *_ha_args("n1", "--set", "ha.require_aof=false")]
    node = _serve(data, endpoint, args)
    try:
        wait_until(lambda: _role(endpoint) == (True, 1))
        with node.client(timeout=5.0) as c:
            register(c, "inst")
        _restart_empty(server)
        # The lease's key went with the data: the node steps down, wins the empty Redis's lease,
        # and its leader stage refuses the lost store: the process ends.
        assert node.process is not None
        assert node.process.wait(30) == 2
        stderr = node.process.stderr.read().decode() if node.process.stderr else ""
    finally:
        stop_subprocess(node, kill=True)
    record = os.path.join(data, RECORD_FILE)
    assert "lost this deployment's data" in _one_refusal(stderr) and f"remove {record}" in stderr
    assert "lost this deployment's data" in _refused(data, endpoint, args)
    # Every epoch issued is in the node's floor: the term it won on the empty Redis too (whose
    # leader stage then refused), so never less than 2.
    floor = int((tmp_path / "n1" / "ha-epoch").read_text())
    assert floor >= 2
    os.remove(record)
    _restart_empty(server)  # Redis's own epoch is gone again: INCR would say 1
    node = _serve(data, endpoint, [*args, "--discard-orphans"])
    try:
        wait_until(lambda: _role(endpoint) == (True, floor + 1))
    finally:
        stop_subprocess(node)


# -- two deployments on one prefix -----------------------------------------------------------------------


def test_a_second_deployment_on_a_prefix_another_kvcm_writes_is_refused(redis_factory, tmp_path):
    server = redis_factory("--appendonly", "yes")
    prefix = _prefix()
    a = _serve(str(tmp_path / "a"), f"ipc://{tmp_path}/a.sock", _store_args(server.url, prefix))
    try:
        line = _refused(str(tmp_path / "b"), f"ipc://{tmp_path}/b.sock", _store_args(server.url, prefix))
        assert "is written by another kvcm" in line and str(tmp_path / "a") in line, line
        line = _refused(str(tmp_path / "c"), f"ipc://{tmp_path}/c.sock", [*_store_args(server.url, prefix), *_ha_args()])
        assert "written by a kvcm without ha.enabled" in line, line
    finally:
        assert stop_subprocess(a) == 0
    with redis.Redis.from_url(server.url) as raw:
        assert raw.get(f"{{{prefix}}}:writer") is None  # a clean stop gives the mark up
    a = _serve(str(tmp_path / "a"), f"ipc://{tmp_path}/a.sock", _store_args(server.url, prefix))
    stop_subprocess(a, kill=True)  # the mark stays until it expires ...
    a = _serve(str(tmp_path / "a"), f"ipc://{tmp_path}/a.sock", _store_args(server.url, prefix))  # ... but is its own
    stop_subprocess(a)


def test_a_data_dir_of_another_deployment_is_refused_on_a_prefix(redis_factory, tmp_path):
    server = redis_factory("--appendonly", "yes")
    mine, theirs = _prefix(), _prefix()
    for prefix, name in ((mine, "a"), (theirs, "b")):
        stop_subprocess(_serve(str(tmp_path / name), f"ipc://{tmp_path}/{name}.sock", _store_args(server.url, prefix)))
    ids = {name: json.loads((tmp_path / name / RECORD_FILE).read_text())["deployment"] for name in ("a", "b")}
    assert ids["a"] != ids["b"]
    line = _refused(str(tmp_path / "b"), f"ipc://{tmp_path}/b.sock", _store_args(server.url, mine))
    assert f"holds deployment {ids['a']}" in line and f"belongs to deployment {ids['b']}" in line, line
    line = _refused(str(tmp_path / "b"), f"ipc://{tmp_path}/b.sock", [*_store_args(server.url, mine), *_ha_args()])
    assert f"holds deployment {ids['a']}" in line, line


def test_a_kvcm_without_the_lease_is_refused_on_a_prefix_an_ha_deployment_leads(redis_factory, tmp_path):
    server = redis_factory("--appendonly", "yes")
    prefix = _prefix()
    node = _serve(str(tmp_path / "n1"), f"ipc://{tmp_path}/n1.sock", [*_store_args(server.url, prefix), *_ha_args()])
    try:
        wait_until(lambda: _role(f"ipc://{tmp_path}/n1.sock") == (True, 1))
        line = _refused(str(tmp_path / "solo"), f"ipc://{tmp_path}/solo.sock", _store_args(server.url, prefix))
        assert "is led by a node under the leader lease" in line, line
    finally:
        stop_subprocess(node)


def test_the_nodes_of_one_ha_deployment_share_its_prefix_and_its_deployment(redis_factory, tmp_path):
    """What the checks must leave alone: nodes of one deployment, each with its own data dir,
    on one prefix; a follower restarted joins again."""
    server = redis_factory("--appendonly", "yes", "--appendfsync", "always")
    sock_dir = str(tmp_path / "s")
    os.makedirs(sock_dir)
    pair = Pair(server.url, str(tmp_path), sock_dir)
    try:
        pair.start("n1")
        wait_until(lambda: pair.leader() == "n1")
        pair.start("n2")
        with redis.Redis.from_url(server.url) as raw:
            stored = raw.get(f"{{{pair.prefix}}}:deployment").decode()
        records = {n: json.loads((tmp_path / n / RECORD_FILE).read_text()) for n in ("n1", "n2")}
        assert {r["deployment"] for r in records.values()} == {stored}
        assert {r["prefix"] for r in records.values()} == {pair.prefix}
        stop_subprocess(pair.nodes.pop("n2"), kill=True)
        pair.start("n2")
        assert pair.info("n2")["leader"] is False and pair.leader() == "n1"
    finally:
        pair.stop()


# -- the password file ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "warned"), [(0o644, True), (0o640, True), (0o600, False)])
def test_a_redis_password_file_others_can_read_is_warned_about(tmp_path, caplog, mode, warned):
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    os.chmod(pw, mode)
    config = load(None, environ={}, overrides={"store": {"backend": "redis", "redis_password_file": str(pw)}})
    with caplog.at_level(logging.WARNING, logger="kvcm.app"):
        assert redis_password(config) == "s3cret"
    found = [r.getMessage() for r in caplog.records if "readable by other users" in r.getMessage()]
    assert bool(found) == warned, found
    if warned:
        assert str(pw) in found[0] and oct(stat.S_IMODE(mode))[2:] in found[0] and "s3cret" not in found[0]

