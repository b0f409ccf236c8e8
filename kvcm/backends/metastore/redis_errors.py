"""The Redis store's errors, and how redis-py's exceptions become kvcm's typed ones.

Callers of the store never see a raw redis-py exception: a connection failure is
:class:`~kvcm.errors.Unavailable`, a fenced commit :class:`Fenced`, anything else a
:class:`~kvcm.errors.ServerError`."""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar

import redis

from kvcm.errors import Code, ServerError, Unavailable

P = ParamSpec("P")
R = TypeVar("R")


class Fenced(Unavailable):
    """A commit refused: a newer leader's epoch is stored (this process is no longer the writer)."""

    default_code = Code.SERVER_NOT_LEADER


class InDoubt(Unavailable):
    """Redis went away during a commit and could not say afterwards whether it applied it. The
    commit's memory side (its callbacks, or its aborts, which give back storage slots) waits
    until Redis can tell: the store refuses everything meanwhile
    (:meth:`~kvcm.backends.metastore.redis.RedisStore.settle`)."""


class NotReplicated(Unavailable):
    """A commit applied on the primary that fewer than ``store.redis_wait_replicas`` replicas
    acknowledged in time: it is not lost now, but may be if the primary fails before they copy it."""

    default_code = Code.TIMEOUT


class StoreLost(Unavailable):
    """The Redis store is not this deployment's any more: Redis lost its data (a restart without
    persistence, a flush) or another kvcm took it over. Everything is refused until a restart,
    which then refuses to start and names the remedy."""


def translate(exc: redis.RedisError) -> Exception:
    """kvcm's typed error for a redis-py exception."""
    if isinstance(exc, redis.AuthenticationError):
        return Unavailable(f"metadata store (Redis) refused the password: {exc}", Code.SERVICE_NOT_READY)
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return Unavailable(f"metadata store (Redis) unavailable: {exc}", Code.SERVICE_NOT_READY)
    if isinstance(exc, (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError)):
        # A Redis Cluster that is forming, or failing a master over: the slot comes back.
        return Unavailable(f"metadata store (Redis Cluster) not serving now: {exc}", Code.SERVICE_NOT_READY)
    if isinstance(exc, (redis.exceptions.MovedError, redis.exceptions.AskError)):
        return Unavailable(f"metadata store (Redis Cluster): the deployment's slot moved to another master ({exc}); "
                           "a node finds the slot's master at its start: restart it (docs/shards.md)",
                           Code.SERVICE_NOT_READY)
    if isinstance(exc, redis.ReadOnlyError):
        return Unavailable(f"metadata store (Redis) is a read-only replica: {exc}", Code.SERVER_NOT_LEADER)
    if str(exc).startswith("KVCMFENCED"):
        return Fenced(f"commit refused: a newer writer holds the metadata store (stored epoch "
                      f"{str(exc).split(' ', 1)[1]})")
    return ServerError(f"metadata store (Redis) error: {exc}", Code.IO_ERROR)


def call(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Run one redis-py call; its errors come out as kvcm's."""
    try:
        return fn(*args, **kwargs)
    except redis.RedisError as exc:
        raise translate(exc) from None


def text(value: object) -> str:
    """A reply (bytes, as the store's connections do not decode) as text; ``""`` for none."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value or "")
