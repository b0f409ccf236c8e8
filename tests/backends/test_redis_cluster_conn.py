"""kvcm on a Redis Cluster finds its deployment's master from seeds (``resolve``), on a real
three-master cluster: the master of each hash tag's slot, which takes that tag's keys with no
``MOVED``; a seed that does not answer is passed over; no answer at all, or a malformed URL,
is a typed error that never shows the password; a URL that names no cluster is left alone."""

from __future__ import annotations

import pytest
import redis
from redis.crc import key_slot
from redis.exceptions import MovedError

from kvcm.backends.metastore import redis_conn
from kvcm.backends.metastore.redis_conn import is_cluster, redact, resolve
from kvcm.errors import Code, InvalidArgument, Unavailable
from kvcm.testing.redis_cluster import RedisCluster, cluster_port
from tests.conftest import _redis_binary
from tests.helpers import TIME_FACTOR, free_port

# The split ``redis-cli --cluster create`` makes for three masters, master i holding range i:
# written out here, so the tests check RedisCluster's assignment rather than reuse it.
RANGES = ((0, 5460), (5461, 10922), (10923, 16383))
PASSWORD = "s3cret-pw"


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    binary = _redis_binary()  # skips (or fails under KVCM_TEST_REQUIRE_REDIS=1) without a server
    with RedisCluster(str(tmp_path_factory.mktemp("cluster")), binary=binary, start_timeout=10 * TIME_FACTOR,
                      ready_timeout=20 * TIME_FACTOR) as c:
        yield c


def _slot(tag: str) -> int:
    return key_slot(("{" + tag + "}").encode())


def _tag_on(master: int, stem: str) -> str:
    """A hash tag whose slot master ``master`` holds."""
    first, last = RANGES[master]
    return next(t for t in (f"{stem}{n}" for n in range(10_000)) if first <= _slot(t) <= last)


def _seeds(*ports: int) -> str:
    return ",".join(f"127.0.0.1:{p}" for p in ports)


@pytest.mark.redis
def test_the_cluster_serves_every_slot_from_three_masters(redis_cluster):
    ports = [node.port for node in redis_cluster.nodes]
    assert len(set(ports)) == 3
    assert redis_cluster.url == f"redis+cluster://{_seeds(*ports)}"
    assert redis_cluster.seed_url == f"redis://127.0.0.1:{ports[0]}/0"
    for node in redis_cluster.nodes:
        with redis.Redis(port=node.port, decode_responses=True) as conn:
            info = conn.execute_command("CLUSTER INFO")  # one word: redis-py parses it into fields
            assert (info["cluster_state"], info["cluster_known_nodes"], info["cluster_size"]) == ("ok", "3", "3")
            assert info["cluster_slots_assigned"] == info["cluster_slots_ok"] == "16384"
            assert conn.info("replication")["role"] == "master"
            served = {(int(first), int(last)): int(master[1]) for first, last, master, *_ in
                      conn.execute_command("CLUSTER", "SLOTS")}
            assert served == dict(zip(RANGES, ports))  # all 16384, master i holding range i
            assert conn.config_get("appendonly")["appendonly"] == "yes"
    for master in range(3):
        assert redis_cluster.node_for(_tag_on(master, "n")) is redis_cluster.nodes[master]


@pytest.mark.redis
@pytest.mark.parametrize("seeds", ["all", "one_other"])
def test_resolve_gives_the_master_of_each_tags_slot(redis_cluster, seeds):
    """Two tags on the second and third masters: neither is the first seed (nor, with one seed,
    the seed asked), and each resolved URL takes its tag's keys."""
    nodes = redis_cluster.nodes
    for master in (1, 2):
        tag = _tag_on(master, f"deployment-{seeds}-")
        seed_ports = [n.port for n in nodes] if seeds == "all" else [nodes[3 - master].port]
        url = resolve(f"redis+cluster://{_seeds(*seed_ports)}", tag, None)
        assert url == f"redis://127.0.0.1:{nodes[master].port}/0"
        with redis.Redis.from_url(url) as owner:
            assert owner.set(f"{{{tag}}}:x", b"1")  # no MOVED: this master serves the slot
            assert owner.get(f"{{{tag}}}:x") == b"1"
        wrong = nodes[(master + 1) % 3]
        with redis.Redis(port=wrong.port) as other, pytest.raises(redis.ResponseError) as moved:
            other.set(f"{{{tag}}}:x", b"1")
        assert isinstance(moved.value, MovedError)
        assert (moved.value.slot_id, moved.value.port) == (_slot(tag), nodes[master].port)


@pytest.mark.parametrize("dead", ["closed_port", "closed_ipv6_port", "standalone_redis"])
@pytest.mark.redis
def test_a_seed_that_cannot_answer_is_passed_over(redis_cluster, request, dead):
    if dead == "standalone_redis":  # answers, but has no cluster support
        first = f"127.0.0.1:{request.getfixturevalue('redis_server').port}"
    else:
        first = f"127.0.0.1:{free_port()}" if dead == "closed_port" else f"[::1]:{free_port()}"
    tag = _tag_on(1, "passed-over-")
    url = f"redis+cluster://{first},{_seeds(redis_cluster.nodes[2].port)}/"
    assert resolve(url, tag, None) == f"redis://127.0.0.1:{redis_cluster.nodes[1].port}/0"


def test_every_seed_down_is_unavailable_and_keeps_the_password_hidden():
    ports = free_port(), free_port()
    url = f"rediss+cluster://kvcm:{PASSWORD}@{_seeds(*ports)}/0"
    with pytest.raises(Unavailable) as info:
        resolve(url, "t", None)
    message = str(info.value)
    assert info.value.code == Code.SERVICE_NOT_READY
    assert PASSWORD not in message
    assert redact(url) in message and "kvcm:***@" in message
    assert all(f"; 127.0.0.1:{p}: " in message or f": 127.0.0.1:{p}: " in message for p in ports)  # why each failed


def test_a_cluster_that_serves_not_the_slot_is_unavailable(redis_factory):
    """A lone cluster node with no slots yet answers CLUSTER SLOTS with nothing."""
    lone = redis_factory("--cluster-enabled", "yes", "--cluster-node-timeout", "2000", port=cluster_port())
    with pytest.raises(Unavailable, match=r"no master serves slot \d+"):
        resolve(f"redis+cluster://127.0.0.1:{lone.port}", "t", None)


@pytest.mark.redis
def test_the_password_reaches_the_slot_master(redis_cluster):
    """From the URL's userinfo (kept in the resolved URL) or from the ``password`` argument."""
    ports = [n.port for n in redis_cluster.nodes]
    tag = _tag_on(2, "secured-")
    _require_password(redis_cluster, PASSWORD)
    try:
        url = resolve(f"redis+cluster://:{PASSWORD}@{_seeds(*ports)}/0", tag, None)
        assert url == f"redis://:{PASSWORD}@127.0.0.1:{ports[2]}/0"
        with redis.Redis.from_url(url) as owner:
            assert owner.set(f"{{{tag}}}:x", b"1")
        url = resolve(f"redis+cluster://{_seeds(*ports)}", tag, PASSWORD)
        assert url == f"redis://127.0.0.1:{ports[2]}/0"
        with redis_conn.connect(url, PASSWORD) as owner:
            assert owner.set(f"{{{tag}}}:x", b"2")
        with pytest.raises(Unavailable) as refused:
            resolve(f"redis+cluster://:wrong-pw@{_seeds(*ports)}", tag, None)
        assert "wrong-pw" not in str(refused.value)
    finally:
        _require_password(redis_cluster, "", current=PASSWORD)


def _require_password(cluster: RedisCluster, password: str, current: str | None = None) -> None:
    for node in cluster.nodes:
        with redis.Redis(port=node.port, password=current) as conn:
            conn.config_set("requirepass", password)


@pytest.mark.parametrize(("url", "why"), [
    ("redis+cluster://", "no host:port"),
    ("redis+cluster:///0", "no host:port"),
    ("redis+cluster://u:p@,/", "no host:port"),
    ("redis+cluster://127.0.0.1", "not host:port"),
    ("redis+cluster://:6379", "not host:port"),
    ("redis+cluster://127.0.0.1:abc", "port must be a number"),
    ("redis+cluster://127.0.0.1:6379,127.0.0.1:", "port must be a number"),
    ("redis+cluster://127.0.0.1:70000", "port must be a number"),
    ("redis+cluster://127.0.0.1:0", "port must be a number"),
    ("redis+cluster://::1:6379", "in brackets"),
    ("redis+cluster://[::1]6379", "not \\[address\\]:port"),
    ("redis+cluster://[::1:6379", "not \\[address\\]:port"),
    ("redis+cluster://" + _seeds(*range(7001, 7018)), "17 seeds, at most 16"),
    ("redis+cluster://127.0.0.1:7001/1", "database '1'"),
    ("redis+cluster://127.0.0.1:7001/0/x", "database '0/x'"),
    ("rediss+cluster://127.0.0.1:7001/0?ssl_cert_reqs=none", "database"),
])
def test_a_malformed_cluster_url_is_an_invalid_argument(url, why):
    with pytest.raises(InvalidArgument, match=why):
        resolve(url, "t", None)


def test_a_malformed_url_hides_its_password():
    with pytest.raises(InvalidArgument) as info:
        resolve(f"redis+cluster://kvcm:{PASSWORD}@127.0.0.1:x", "t", None)
    assert PASSWORD not in str(info.value) and "kvcm:***@" in str(info.value)


def test_an_empty_tag_is_an_invalid_argument():
    with pytest.raises(InvalidArgument, match="non-empty hash tag"):
        resolve("redis+cluster://127.0.0.1:7001", "", None)


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/3",
    f"rediss://kvcm:{PASSWORD}@redis.example:6380/0",
    "unix:///run/redis.sock?db=2",
    "redis://cluster.example:6379/0",
    "not a url",
])
def test_a_url_that_names_no_cluster_is_returned_unchanged(url):
    assert not is_cluster(url)
    assert resolve(url, "t", None) is url


def test_cluster_schemes_are_recognised():
    assert is_cluster("redis+cluster://h:1") and is_cluster("rediss+cluster://h:1,h:2/0")
    assert not is_cluster("redis+clusterx://h:1") and not is_cluster("redis+cluster:h:1")


@pytest.mark.parametrize(("answer", "expected"), [
    (("10.0.0.7", 7002), "rediss://u:pw@10.0.0.7:7002/0"),
    (("fd00::7", 7002), "rediss://u:pw@[fd00::7]:7002/0"),  # IPv6 bracketed
    (("", 7002), "rediss://u:pw@[fd00::1]:7002/0"),  # no address given: the seed's own
])
def test_the_node_url_keeps_tls_and_the_credentials(monkeypatch, answer, expected):
    """The URL built from a seed's answer (no TLS cluster here: the answer is stubbed)."""
    asked: list[str] = []

    def owner(seed_url: str, password: str | None, slot: int) -> tuple[str, int]:
        asked.append(seed_url)
        return answer

    monkeypatch.setattr(redis_conn, "_slot_owner", owner)
    assert resolve("rediss+cluster://u:pw@[fd00::1]:7001", "t", None) == expected
    assert asked == ["rediss://u:pw@[fd00::1]:7001/0"]


def test_redact_hides_a_cluster_password():
    assert redact(f"redis+cluster://kvcm:{PASSWORD}@h1:7001,h2:7002/0") == "redis+cluster://kvcm:***@h1:7001,h2:7002/0"
    assert redact(f"rediss+cluster://:{PASSWORD}@[::1]:7001") == "rediss+cluster://:***@[::1]:7001"
    assert redact("redis+cluster://h1:7001,h2:7002") == "redis+cluster://h1:7001,h2:7002"
