"""Connections to the Redis store: their timeouts, the URL as logs show it, the readiness probe,
and the persistence check a start makes."""

from __future__ import annotations

import logging
import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvcm.backends.metastore.redis_errors import call, text, translate
from kvcm.errors import StartRefused

log = logging.getLogger("kvcm.backends.metastore")

CONNECT_TIMEOUT_S = 2.0  # a Redis that does not accept within this is unavailable
SOCKET_TIMEOUT_S = 5.0  # one command's reply; a commit's WAIT has its own timeout on top
PROBE_TIMEOUT_S = 0.5  # a readiness PING: a hung Redis makes the node unready, not the probe slow
PROBE_EVERY_S = 1.0  # at most one readiness PING per this, however hot the probe


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
