"""What a client knows of a sharded deployment, and the rules it routes by (no I/O here: the
synchronous and the asyncio client run the same rules over their own sockets).

A client starts knowing nothing: a call naming a name it has not seen goes to its endpoints (the
seeds), and an unsharded deployment costs it nothing more. A node that does not own the call's instance or group answers
``WRONG_SHARD`` naming the owner (:mod:`kvcm.proto.shards`); the client remembers which shard owns that name, opens a client of that shard's nodes (leader
first, so ``SERVER_NOT_LEADER`` inside a shard is followed as usual) and sends the call there.
Later calls naming it go straight to its shard: one redirect per name, the first time. At the
first redirect the client also asks for the shard map once: the seeds' own shard's other nodes
join its endpoints, so it follows that shard's failover too. The
lists that span shards (:data:`~kvcm.proto.shards.FAN_OUT`) ask every shard of the map
(``get_shard_map``, asked once and again every :data:`MAP_EVERY_S`) and are merged; the
changes of what every shard keeps a copy of (:data:`~kvcm.proto.shards.EVERYWHERE`: accounts)
are sent to every shard.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from kvcm.errors import Code, KvcmError, error
from kvcm.proto.shards import (
    DETAIL_KIND,
    DETAIL_NAME,
    EVERYWHERE,
    FAN_OUT,
    MAX_SHARDS,
    Kind,
    ShardInfo,
    route_of,
    shard_from_detail,
    shards_from_map,
)

#: ``WRONG_SHARD`` answers one call follows at most (a group moving twice under a call).
MAX_REDIRECTS = 3
#: Names a client remembers the shard of at most (it starts over when full).
MAX_ROUTES = 100_000
#: How often a client that fans out asks for the shard map again (seconds).
MAP_EVERY_S = 10.0
#: The longest wait for the shard map (an answer that does not come is no map).
MAP_WAIT_S = 2.0


def redirected(exc: KvcmError) -> bool:
    return exc.code is Code.WRONG_SHARD


class Routes:
    """Shards by name, and which shard owns each name seen in a redirect."""

    def __init__(self) -> None:
        self.shards: dict[str, ShardInfo] = {}
        self.mapped = False  # the shard map was asked for once (whatever it answered)
        self._owners: dict[tuple[Kind, str], str] = {}
        self._map_at = float("-inf")  # monotonic: when the shard map was last read (-inf: never)

    def shard_for(self, method: str, params: Mapping[str, object]) -> ShardInfo | None:
        """The shard a call goes to, None when the client does not know (its endpoints answer)."""
        if not self._owners:
            return None
        route = route_of(method, params)
        name = self._owners.get(route) if route is not None else None
        return self.shards.get(name) if name is not None else None

    def learn(self, exc: KvcmError) -> ShardInfo | None:
        """Remember what a ``WRONG_SHARD`` says: the owner and the name it owns; the owner, or
        None when the answer names no endpoint to go to."""
        info = shard_from_detail(exc.detail)
        if info is None:
            return None
        known = self.shards.get(info.name)
        if known is None and len(self.shards) >= MAX_SHARDS:
            return None  # more shards than a deployment has: not followed
        if known is not None and not info.endpoints:
            info = known
        self.shards[info.name] = info
        kind, name = exc.detail.get(DETAIL_KIND, ""), exc.detail.get(DETAIL_NAME, "")
        if kind in (Kind.INSTANCE.value, Kind.GROUP.value) and name:
            if len(self._owners) >= MAX_ROUTES:
                self._owners.clear()
            self._owners[(Kind(kind), name)] = info.name
        return info if info.endpoints else None

    def fans_out(self, method: str, params: Mapping[str, object]) -> str | None:
        """The reply key to merge under when ``method`` lists across shards (None: it does not)."""
        key = FAN_OUT.get(method)
        return None if key is None or route_of(method, params) is not None else key

    def everywhere(self, method: str) -> bool:
        """``method`` changes a definition every shard keeps: sent to each."""
        return method in EVERYWHERE

    def map_due(self) -> bool:
        return time.monotonic() - self._map_at >= MAP_EVERY_S

    def take_map(self, reply: object, seeds: list[str]) -> None:
        """Take a ``get_shard_map`` reply (None: it could not be had); the nodes of the
        answering node's own shard (the seeds' shard) join ``seeds``, the client's endpoints."""
        self._map_at = time.monotonic()
        self.mapped = True
        for name, listed in shards_from_map(reply).items():
            if name in self.shards or len(self.shards) < MAX_SHARDS:
                self.shards[name] = listed
        own = reply.get("shard") if isinstance(reply, Mapping) else None
        info = self.shards.get(own) if isinstance(own, str) else None
        for endpoint in info.endpoints if info is not None else ():
            if endpoint not in seeds:
                seeds.append(endpoint)


def serves(shard: ShardInfo, endpoints: list[str]) -> bool:
    """A client of ``endpoints`` still reaches every node of ``shard`` (else one is made anew)."""
    return set(shard.endpoints) <= set(endpoints)


def applied_everywhere(outcomes: list[tuple[str, object | KvcmError]]) -> object:
    """The reply of a change sent to every shard (``outcomes``: per shard, its reply or its
    error): the first reply when every shard took it, else the first error, saying which
    shards took the change and which did not (the change is not undone where it was taken)."""
    failed = [(shard, out) for shard, out in outcomes if isinstance(out, KvcmError)]
    if not failed:
        return outcomes[0][1]
    shard, first = failed[0]
    assert isinstance(first, KvcmError)  # internal: failed holds errors only
    taken = [s for s, out in outcomes if not isinstance(out, KvcmError)]
    exc = error(first.code, f"shard {shard}: {first.message} (taken by shards: {', '.join(taken) or 'none'}; "
                            f"not by: {', '.join(s for s, _ in failed)})")
    exc.detail = {**first.detail, "taken_by": ",".join(taken)}
    return exc


def merge(replies: list[object], key: str) -> object:
    """One list reply from every shard's: the first reply's other fields, ``key`` concatenated."""
    merged: dict[str, object] = dict(replies[0]) if isinstance(replies[0], Mapping) else {}
    items: list[object] = []
    for reply in replies:
        part = reply.get(key) if isinstance(reply, Mapping) else None
        if isinstance(part, list):
            items.extend(part)
    merged[key] = items
    return merged


__all__ = ["MAP_EVERY_S", "MAP_WAIT_S", "MAX_REDIRECTS", "MAX_ROUTES", "Routes", "applied_everywhere", "merge", "redirected",
           "serves"]
