"""A node of one shard (``shard.directory``): it keeps its entry in the directory fresh, answers
``WRONG_SHARD`` for another shard's instances and groups, places new groups, and records its
own (:mod:`kvcm.proto.shards` says which request is routed by what; :mod:`kvcm.ha.directory`
holds the shared state).

The guard wraps the routed methods' handlers, so it runs where the request is already
validated and authorized. A name this shard holds costs one dict lookup; only a name it does not
hold is looked up in the directory (cached for :data:`OWNER_TTL_S`, at most
:data:`MAX_CACHED` names), so another shard's traffic cannot make a node hammer Redis.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from kvcm.config import Config
from kvcm.control.registry_core import instance_not_found
from kvcm.errors import Code, InvalidArgument, KvcmError, NotFound, Unavailable
from kvcm.node.stores import redis_password
from kvcm.proto.requests.control import Empty
from kvcm.proto.shards import (
    DETAIL_ENDPOINTS,
    DETAIL_KIND,
    DETAIL_LEADER,
    DETAIL_NAME,
    DETAIL_SHARD,
    ROUTES,
    Kind,
    Route,
    ShardInfo,
    name_at,
)
from kvcm.rpc.methods import Method
from kvcm.threads import LoopThread

if TYPE_CHECKING:  # redis-py is an optional extra: imported where a shard is built
    from kvcm.control.registry import Registry
    from kvcm.ha.campaign import Campaign
    from kvcm.ha.directory import Directory
    from kvcm.rpc.auth import Authenticator

log = logging.getLogger("kvcm.node.shard")

#: How long a directory answer about another shard's name is reused (seconds).
OWNER_TTL_S = 1.0
#: Names whose owner is cached at most (the cache starts over when full).
MAX_CACHED = 4096
#: How long the list of shards is reused (seconds).
SHARDS_TTL_S = 0.5


class Committing(Protocol):
    """A store whose write transaction can run a callback after its group commits."""

    def write(self, join: bool = False) -> AbstractContextManager[Any]: ...


class Sharding:
    """This node's part in the shard directory."""

    def __init__(self, config: Config) -> None:
        import redis

        from kvcm.backends.metastore.redis_conn import connect, resolve
        from kvcm.ha.directory import Directory, tag

        #: what a failed directory read or write raises
        self.errors: tuple[type[Exception], ...] = (redis.RedisError,)
        self.shard = config.shard.name
        self.node_id = config.ha.node_id
        password = redis_password(config)
        url = resolve(config.store.redis_url, tag(config.shard.directory), password)
        self.directory: Directory = Directory(connect(url, password), config.shard.directory, config.ha.lease_ms)
        self._renew_s = config.ha.renew_ms / 1000.0
        # Another shard's names cost directory round trips on the RPC loop: a bounded rate, so
        # requests naming made-up instances cannot keep the loop waiting on Redis.
        self._lookups = _Bucket(config.shard.max_lookups_per_s)
        self._owners: dict[tuple[Kind, str], tuple[float, tuple[str, str] | None]] = {}
        self._shards: tuple[float, dict[str, ShardInfo]] = (float("-inf"), {})
        self._counts: tuple[float, dict[str, int]] = (float("-inf"), {})  # groups per shard, for get_shard_map
        self._recorded: set[str] = set()  # instances this node wrote to the directory
        self._thread: LoopThread | None = None
        self._rounds = 0

    # -- the node's entry -------------------------------------------------------------------------

    def start(self, lease: Campaign) -> None:
        def beat() -> None:
            leader = lease.is_leader()
            self.directory.announce(self.shard, self.node_id, lease.endpoint, leader, lease.epoch if leader else 0)
            self._rounds += 1
            if leader and self._rounds % 10 == 0:
                self.directory.forget_silent()
        self._thread = LoopThread("directory", beat, self._renew_s)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self._thread = None

    # -- reading the directory ---------------------------------------------------------------------

    def shards(self) -> dict[str, ShardInfo]:
        at, found = self._shards
        if time.monotonic() - at > SHARDS_TTL_S:
            found = self._ask(self.directory.shards)
            self._shards = (time.monotonic(), found)
        return found

    def owner(self, kind: Kind, name: str) -> tuple[str, str] | None:
        """(shard, group) the directory names for ``name`` (None: it names none)."""
        now = time.monotonic()
        cached = self._owners.get((kind, name))
        if cached is not None and now - cached[0] < OWNER_TTL_S:
            return cached[1]
        if not self._lookups.take():
            exc = Unavailable(f"too many lookups of names shard {self.shard!r} does not hold; retry", Code.RATE_LIMITED)
            exc.detail = {"retry_after_ms": "100"}
            raise exc
        found: tuple[str, str] | None = self._ask(lambda: self._lookup(kind, name))
        if len(self._owners) >= MAX_CACHED:
            self._owners.clear()
        self._owners[(kind, name)] = (now, found)
        return found

    def _lookup(self, kind: Kind, name: str) -> tuple[str, str] | None:
        group = name if kind is Kind.GROUP else self.directory.instance_group(name)
        shard = None if group is None else self.directory.group_shard(group)
        return None if shard is None or group is None else (shard, group)

    def _ask(self, read: Callable[[], Any]) -> Any:
        try:
            return read()
        except self.errors as exc:
            # Not knowing the owner, "no such instance" could be a wrong answer: an error instead.
            raise Unavailable(f"the shard directory (Redis) is unavailable: {exc}", Code.SERVICE_NOT_READY) from None

    def wrong_shard(self, owner: str, kind: Kind, name: str) -> KvcmError:
        info = self.shards().get(owner)
        exc = Unavailable(f"{kind.value} {name[:200]!r} belongs to shard {owner!r}; ask "
                          f"{info.leader if info and info.leader else 'its nodes'}", Code.WRONG_SHARD)
        exc.detail = {DETAIL_SHARD: owner, DETAIL_LEADER: info.leader if info else "",
                      DETAIL_ENDPOINTS: ",".join(info.endpoints) if info else "", DETAIL_KIND: kind.value,
                      DETAIL_NAME: name[:200]}
        return exc

    def shard_map(self) -> dict[str, object]:
        """``get_shard_map``: every live shard, its leader, nodes and groups (counting the groups
        reads every placement: the count is reused for :data:`SHARDS_TTL_S`, however often asked)."""
        at, counts = self._counts
        if time.monotonic() - at > SHARDS_TTL_S:
            counts = self._ask(self.directory.groups_per_shard)
            self._counts = (time.monotonic(), counts)
        return {"directory": self.directory.name, "shard": self.shard, "shards": [
            {"name": s.name, "leader_endpoint": s.leader, "endpoints": list(s.endpoints), "groups": counts.get(s.name, 0)}
            for s in sorted(self.shards().values())]}

    # -- writing the directory ---------------------------------------------------------------------

    def claim_group(self, group: str, wanted: str) -> tuple[str, bool]:
        """Place ``group`` on ``wanted`` ("" = the least loaded live shard) unless it is placed:
        (its owner, whether this call placed it)."""
        placed = self._ask(lambda: self.directory.claim_group(group, wanted or self._least_loaded()))
        self._owners.pop((Kind.GROUP, group), None)
        self._counts = (float("-inf"), {})
        return placed  # type: ignore[no-any-return]

    def _least_loaded(self) -> str:
        counts = self.directory.groups_per_shard()  # read now, not the cached count: it decides
        live = set(self.shards()) | {self.shard}
        return min(live, key=lambda s: (counts.get(s, 0), s != self.shard, s))

    def release_group(self, group: str) -> None:
        """Forget this shard's placement of ``group`` (a failure is logged: a stale hint)."""
        _quietly(lambda: self.directory.release_group(group, self.shard), self.errors)
        self._counts = (float("-inf"), {})

    def record_instance(self, instance: str, group: str) -> None:
        """Record that ``instance`` is in ``group`` (of this shard), once per node and instance."""
        if instance in self._recorded:
            return
        self._ask(lambda: self.directory.record_instance(instance, group))
        if len(self._recorded) >= 100_000:
            self._recorded.clear()
        self._recorded.add(instance)

    def forget_instance(self, instance: str, group: str) -> None:
        self._recorded.discard(instance)
        _quietly(lambda: self.directory.forget_instance(instance, group), self.errors)

    # -- the guard ---------------------------------------------------------------------------------

    def shape(self, methods: list[Method], registry: Registry, store: Committing | None,
              auth: Authenticator | None = None) -> list[Method]:
        """``methods`` with the routed ones guarded, and ``get_shard_map`` (``store``: the
        leader's, None on a follower)."""
        guard = _Guard(self, registry, store, auth)
        out = []
        for method in methods:
            route = ROUTES.get(method.name)
            if route is not None:
                # The prepare hook runs before the handler (and before the estimate, which reads
                # the instance too): it checks first, so another shard's name is redirected, not
                # "unknown". A method without one reads no instance in its estimate.
                method = dataclasses.replace(
                    method, handler=guard.wrap(method, route),
                    prepare=None if method.prepare is None else guard.checked(method.prepare, route))
            out.append(method)
        return [*out, shard_map_method(self)]

    def follower_shape(self, methods: list[Method], registry: Registry | None,
                       auth: Authenticator | None) -> list[Method]:
        """A follower's table: guarded as the leader's when it serves reads; ``get_shard_map`` always."""
        if registry is None:
            return [*methods, shard_map_method(self)]
        return self.shape(methods, registry, None, auth)


class _Bucket:
    """``rate`` takes per second, as many at once (a token bucket; the RPC loop's thread only)."""

    def __init__(self, rate: int) -> None:
        self.rate = float(rate)
        self._tokens = self.rate
        self._at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


class _Guard:
    def __init__(self, sharding: Sharding, registry: Registry, store: Committing | None,
                 auth: Authenticator | None) -> None:
        self.sharding = sharding
        self.registry = registry
        self.store = store
        self.auth = auth if auth is not None and auth.enabled else None

    def wrap(self, method: Method, route: Route) -> Callable[[Any], object]:
        special = {"create_instance_group": self._create_group, "remove_instance_group": self._remove_group,
                   "register_instance": self._register, "remove_instance": self._remove_instance}.get(method.name)
        handler = method.handler

        def guarded(req: Any) -> object:
            name = name_at(req, route.field)
            if special is not None and name:
                return special(handler, req, name)
            if name:
                self.check(route.kind, name, req)
            return handler(req)
        return guarded

    def checked(self, hook: Callable[..., Any], route: Route) -> Any:
        """``hook(req, ...)`` after the request's name passed :meth:`check`."""
        def guarded(req: Any, *rest: Any) -> Any:
            name = name_at(req, route.field)
            if name:
                self.check(route.kind, name, req)
            return hook(req, *rest)
        return guarded

    def local(self, kind: Kind, name: str) -> bool:
        if kind is Kind.INSTANCE:
            return self.registry.group_of(name) is not None
        try:
            self.registry.get_group(name)
        except NotFound:
            return False
        return True

    def check(self, kind: Kind, name: str, req: Any) -> None:
        """Pass a name this shard holds, or one no other shard is named for; else WRONG_SHARD
        (to a caller that may use the owning group: to anyone else the name does not exist here,
        as another tenant's instance does not on its own shard)."""
        if self.local(kind, name):
            return
        owner = self.sharding.owner(kind, name)
        if owner is None or owner[0] == self.sharding.shard:
            return
        principal = self.auth.principal(req) if self.auth is not None else None
        if principal is not None and not principal.all_groups and not principal.may_use(owner[1]):
            if kind is Kind.INSTANCE:
                raise instance_not_found(name)
            raise NotFound(f"instance group {name[:200]!r} does not exist")
        raise self.sharding.wrong_shard(owner[0], kind, name)

    def _after_commit(self, fn: Callable[[], object]) -> None:
        if self.store is None:
            return
        with self.store.write(join=True) as txn:
            txn.on_commit(fn)

    def _create_group(self, handler: Callable[[Any], object], req: Any, name: str) -> object:
        sharding = self.sharding
        if self.local(Kind.GROUP, name):
            return handler(req)  # DUPLICATE_ENTITY, answered by the registry
        wanted = getattr(req, "shard", "") or ""
        if wanted and wanted not in sharding.shards():
            raise InvalidArgument(f"shard: no shard named {wanted[:100]!r} is live in directory "
                                  f"{sharding.directory.name!r}")
        owner, placed = sharding.claim_group(name, wanted)
        if owner != sharding.shard:
            raise sharding.wrong_shard(owner, Kind.GROUP, name)
        try:
            return handler(req)
        except BaseException:
            if placed:
                sharding.release_group(name)
            raise

    def _remove_group(self, handler: Callable[[Any], object], req: Any, name: str) -> object:
        self.check(Kind.GROUP, name, req)
        done = handler(req)
        self._after_commit(lambda: self.sharding.release_group(name))
        return done

    def _register(self, handler: Callable[[Any], object], req: Any, group: str) -> object:
        self.check(Kind.GROUP, group, req)
        done = handler(req)  # the registry's checks (capacity, identity) first: a refusal records nothing
        instance = getattr(req, "instance_id", "")
        if isinstance(instance, str) and instance:
            # Ahead of the commit: a hint naming this shard for an instance its commit then
            # fails to keep only sends askers here, where the answer is the one any shard gives.
            self.sharding.record_instance(instance, group)
        return done

    def _remove_instance(self, handler: Callable[[Any], object], req: Any, instance: str) -> object:
        self.check(Kind.INSTANCE, instance, req)
        group = self.registry.group_of(instance)
        done = handler(req)
        if group is not None:
            self._after_commit(lambda: self.sharding.forget_instance(instance, group))
        return done


def _quietly(fn: Callable[[], object], errors: tuple[type[Exception], ...]) -> None:
    """A directory write after the shard's own commit: a failure leaves a stale hint (logged)."""
    try:
        fn()
    except errors as exc:
        log.warning("shard directory not updated (%s); it keeps a stale routing hint", exc)


def shard_map_method(sharding: Sharding | None) -> Method:
    """``get_shard_map`` (every node serves it; an unsharded one answers no shards)."""
    def handler(req: Empty) -> dict[str, object]:
        if sharding is None:
            return {"directory": "", "shard": "", "shards": []}
        return sharding.shard_map()
    return Method("get_shard_map", handler, request=Empty, writes=False, idempotent=True, admin=False)


__all__ = ["MAX_CACHED", "OWNER_TTL_S", "Committing", "Sharding", "shard_map_method"]
