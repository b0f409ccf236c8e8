"""Connections to the Redis store: their timeouts, the node of a Redis Cluster that holds a
deployment, the URL as logs show it, the readiness probe, and the persistence check a start makes."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, NoReturn

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from kvcm.backends.metastore.redis_errors import call, text, translate
from kvcm.errors import Code, InvalidArgument, StartRefused, Unavailable

log = logging.getLogger("kvcm.backends.metastore")

CONNECT_TIMEOUT_S = 2.0  # a Redis that does not accept within this is unavailable
SOCKET_TIMEOUT_S = 5.0  # one command's reply; a commit's WAIT has its own timeout on top
PROBE_TIMEOUT_S = 0.5  # a readiness PING: a hung Redis makes the node unready, not the probe slow
PROBE_EVERY_S = 1.0  # at most one readiness PING per this, however hot the probe
#: A Redis Cluster's seeds, and the scheme of the plain URL of the node found from them.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
MAX_SEEDS = 16


def connect(url: str, password: str | None) -> redis.Redis:
    """The data-plane connection pool, checked with a PING. :raises Unavailable: no answer."""
    client = redis.Redis.from_url(
        url, password=password, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S,
        retry=Retry(NoBackoff(), 1),  # once, at once: a pooled connection from before a Redis restart
    )
    call(client.ping)
    return client


def connect_probe(url: str, password: str | None) -> redis.Redis:
    """A connection of its own with short timeouts: a probe never waits behind a data-plane command."""
    return redis.Redis.from_url(url, password=password, socket_timeout=PROBE_TIMEOUT_S,
                                socket_connect_timeout=PROBE_TIMEOUT_S, retry=Retry(NoBackoff(), 0))


def redact(url: str) -> str:
    """``url`` without its password, for logs and messages."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user + ':' if user else ':'}***@{host}"


def is_cluster(url: str) -> bool:
    """``url`` names a Redis Cluster by its seeds (``redis+cluster://`` or ``rediss+cluster://``)."""
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme in CLUSTER_SCHEMES


def resolve(url: str, tag: str, password: str | None) -> str:
    """The plain Redis URL kvcm connects to for the keys of hash tag ``tag``: ``url`` itself,
    unless it names a Redis Cluster, ``redis+cluster://[user:password@]host:port[,host:port...][/0]``
    (``rediss+cluster://`` for TLS). Then the seeds are asked in turn for ``CLUSTER SLOTS`` and the
    answer is the master serving the slot of ``{tag}``, as ``redis://[user:password@]host:port/0``
    (the URL's credentials kept, so they reach that node too).

    Why a plain connection to one master and no cluster client: every key of one deployment
    carries the one hash tag ``{tag}``, so the whole deployment lives on exactly one slot, hence
    on one master; kvcm talks to that master as to a single Redis, and its commit, a Lua script
    over keys of that one slot, runs there unchanged. The slot's master is found once, at the
    connection's start: a slot moved later answers ``MOVED``, which fails like any Redis error.

    :raises InvalidArgument: a malformed cluster URL (no ``host:port``, a port that is not a
        number, more than ``MAX_SEEDS`` seeds, a database other than 0) or an empty ``tag``.
    :raises Unavailable: no seed answered, or no master serves the slot.
    """
    if not is_cluster(url):
        return url
    scheme, userinfo, seeds = _parse_cluster(url)
    if not tag:
        raise InvalidArgument("a Redis Cluster needs a non-empty hash tag: Redis hashes a whole key with an empty one")
    slot = key_slot(("{" + tag + "}").encode())
    reasons: list[str] = []
    for host, port in seeds:
        try:
            owner_host, owner_port = _slot_owner(_node_url(scheme, userinfo, host, port), password, slot)
        except (redis.RedisError, LookupError) as exc:
            reasons.append(f"{_address(host, port)}: {exc}")
            continue
        return _node_url(scheme, userinfo, owner_host or host, owner_port)  # no host: the seed asked
    raise Unavailable(f"metadata store (Redis Cluster {redact(url)}): no seed says which master serves slot "
                      f"{slot} (hash tag {{{tag}}}): " + "; ".join(reasons), Code.SERVICE_NOT_READY)


def _parse_cluster(url: str) -> tuple[str, str, list[tuple[str, int]]]:
    """``(scheme of the node URLs, "user:password@" or "", seeds)`` of a cluster URL.
    :raises InvalidArgument: it is malformed."""
    scheme, _, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    hosts, _, path = hosts.partition("/")
    if path not in ("", "0"):  # a cluster has database 0 only
        _malformed(url, f"database {path!r}: a Redis Cluster has database 0 only")
    seeds = [_seed(url, s.strip()) for s in hosts.split(",") if s.strip()]
    if not seeds:
        _malformed(url, "no host:port")
    if len(seeds) > MAX_SEEDS:
        _malformed(url, f"{len(seeds)} seeds, at most {MAX_SEEDS}")
    return CLUSTER_SCHEMES[scheme], userinfo + at, seeds


def _seed(url: str, seed: str) -> tuple[str, int]:
    if seed.startswith("["):  # an IPv6 address: its colons are not the port's
        host, close, port = seed[1:].partition("]")
        if not close or not port.startswith(":"):
            _malformed(url, f"seed {seed!r} is not [address]:port")
        port = port[1:]
    else:
        host, _, port = seed.rpartition(":")
        if ":" in host:
            _malformed(url, f"seed {seed!r}: an IPv6 address goes in brackets, [address]:port")
    if not host:
        _malformed(url, f"seed {seed!r} is not host:port")
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        _malformed(url, f"seed {seed!r}: the port must be a number in 1..65535")
    return host, int(port)


def _malformed(url: str, why: str) -> NoReturn:
    raise InvalidArgument(f"Redis Cluster URL {redact(url)}: {why}; expected "
                          "redis+cluster://[user:password@]host:port[,host:port...][/0] (1 to 16 seeds)")


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _node_url(scheme: str, userinfo: str, host: str, port: int) -> str:
    return f"{scheme}://{userinfo}{_address(host, port)}/0"


def _slot_owner(seed_url: str, password: str | None, slot: int) -> tuple[str, int]:
    """``(host, port)`` of the master that ``CLUSTER SLOTS`` of this seed names for ``slot``; host
    ``""`` when the seed does not know the master's address (then it is the seed's own). A seed
    that does not answer at once is left for the next: short timeouts, no retry.
    :raises redis.RedisError: the seed did not answer, or refused the command (no cluster mode).
    :raises LookupError: no master serves the slot, or none with an address."""
    seed = redis.Redis.from_url(seed_url, password=password, socket_timeout=CONNECT_TIMEOUT_S,
                                socket_connect_timeout=CONNECT_TIMEOUT_S, retry=Retry(NoBackoff(), 0))
    with seed:
        # Two words: redis-py hands back the raw reply, [[first, last, [host, port, id...], replicas...]...]
        ranges: list[list[Any]] = seed.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
    for first, last, master, *_replicas in ranges:
        if int(first) <= slot <= int(last):
            host = text(master[0])
            if host == "?":  # announces a hostname it has not got (cluster-preferred-endpoint-type)
                raise LookupError(f"the master of slot {slot} has no known address")
            return host, int(master[1])
    raise LookupError(f"no master serves slot {slot}")


class Readiness:
    """Whether Redis answers a PING within ``PROBE_TIMEOUT_S``; the answer is reused for
    ``PROBE_EVERY_S``, however hot the readiness probe asking."""

    def __init__(self, probe: redis.Redis) -> None:
        self._probe = probe
        self._lock = threading.Lock()
        self._probed = (-PROBE_EVERY_S, True)  # (monotonic time, answered)

    def answered(self) -> bool:
        with self._lock:
            at, answered = self._probed
            if time.monotonic() - at < PROBE_EVERY_S:
                return answered
            try:
                answered = bool(self._probe.ping())
            except redis.RedisError:
                answered = False
            self._probed = (time.monotonic(), answered)
            return answered


def aof_state(client: redis.Redis) -> tuple[bool | None, str]:
    """Whether Redis keeps an append-only file, and how that was learnt: ``CONFIG GET
    appendonly``, else (a managed Redis may forbid CONFIG) ``INFO persistence``'s ``aof_enabled``;
    ``(None, why neither answered)`` when both are refused. Connection errors propagate."""
    reasons: list[str] = []
    try:
        got = client.config_get("appendonly")
        # The store's connections do not decode: the name comes back as bytes.
        value = next((text(v) for k, v in got.items() if text(k) == "appendonly"), "")
        if value:
            return value == "yes", "CONFIG GET appendonly"
        reasons.append("CONFIG GET appendonly: no such setting")
    except redis.ResponseError as exc:
        reasons.append(f"CONFIG GET appendonly: {exc}")
    try:
        info = client.info("persistence")
        if "aof_enabled" in info:
            return bool(int(info["aof_enabled"])), "INFO persistence"
        reasons.append("INFO persistence: no aof_enabled field")
    except redis.ResponseError as exc:
        reasons.append(f"INFO persistence: {exc}")
    return None, "; ".join(reasons)


def persistence_problem(client: redis.Redis) -> str | None:
    """Why a restart of this Redis may lose kvcm's metadata (its AOF is off, or cannot be read);
    None when the AOF is on."""
    enabled, how = aof_state(client)
    if enabled:
        return None
    if enabled is None:
        return (f"cannot tell whether Redis keeps an append-only file (neither answered: {how}); "
                "without one a Redis restart loses the metadata and the lease's epoch")
    return (f"Redis runs without an append-only file (appendonly no, by {how}): a restart of Redis "
            "loses the metadata and the lease's epoch; run it with appendonly yes and appendfsync always")


def check_persistence(client: redis.Redis, where: str, refuse: bool) -> None:
    """At a start: a Redis without an AOF (or one that will not say) refuses it when ``refuse``
    (the lease, ``ha.require_aof``), else is logged as a warning.
    :raises StartRefused: ``refuse`` and the AOF is off or unknown.
    :raises Unavailable: Redis cannot be reached."""
    try:
        problem = persistence_problem(client)
    except redis.RedisError as exc:
        raise translate(exc) from None
    if problem is None:
        return
    if refuse:
        raise StartRefused(f"{where}: {problem}. The leader lease (ha.enabled) needs the epoch to survive a Redis "
                           "restart; turn the AOF on, or set ha.require_aof = false to start anyway")
    log.warning("%s: %s (a store that lost its data is noticed and refused, not served; docs/redis.md"
                "#persistence-check)", where, problem)
