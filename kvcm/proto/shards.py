"""Shards: which request belongs to which shard, and how a node says "not here" (``WRONG_SHARD``).

A shard is one kvcm deployment (a leader and its followers on one ``store.redis_prefix``).
Several shards share a directory in Redis (:mod:`kvcm.ha.directory`): instance group -> shard,
instance -> group, and each shard's nodes. A request is routed by the one name in it that a
shard owns: an instance id, or an instance group's name (:data:`ROUTES`). A node asked about
another shard's instance or group does not proxy; it answers ``WRONG_SHARD`` with the owner's
name and endpoints in the error's ``detail`` (:data:`DETAIL_*`), as Redis Cluster answers
``MOVED``. Clients (:mod:`kvcm.client`, :mod:`kvcm.aio`) follow it and remember the answer.

This table is shared by the server's guard and the clients' routing: a method routed on one
side is routed the same way on the other.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import NamedTuple


class Kind(str, enum.Enum):
    """What a routed request names."""

    INSTANCE = "instance"
    GROUP = "group"


class Route(NamedTuple):
    kind: Kind
    field: str  # the request field holding the name; "instance_group.name" for a nested one


_I, _G = Kind.INSTANCE, Kind.GROUP

#: Every method a shard owns the answer to, and the name it is routed by. Methods not listed
#: (storages, accounts, tokens, health, metrics, the lease) are answered by any node alike.
ROUTES: dict[str, Route] = {
    **{m: Route(_I, "instance_id") for m in (
        "get_instance_info", "get_storage_specs", "remove_instance",
        "get_cache_location", "get_cache_location_len", "get_cache_meta", "start_write_cache",
        "finish_write_cache", "remove_cache", "report_lost", "trim_cache", "pin_cache", "unpin_cache",
        "add_event_source", "list_event_sources", "match_engines", "note_routed", "get_host_cache_state")},
    "register_instance": Route(_G, "instance_group"),
    "create_instance_group": Route(_G, "instance_group.name"),
    "update_instance_group": Route(_G, "instance_group.name"),
    "remove_instance_group": Route(_G, "name"),
    "get_instance_group": Route(_G, "name"),
    "list_instance_info": Route(_G, "instance_group_name"),
}

#: Admin reads every shard answers for its own part; a sharded client asks each shard and
#: merges the lists under these reply keys.
FAN_OUT: dict[str, str] = {
    "list_instance_groups": "instance_group",
    "list_instance_info": "instance_info",  # without a group name
    "list_event_sources": "sources",
}

#: Definitions every shard keeps a copy of in its own store (its authorizer reads them in the
#: same turn as the request): a sharded client sends each change to every shard, so one call
#: defines an account everywhere. Not storages: a storage's root is owned by one deployment
#: (which alone creates and sweeps its files), so each shard has storages of its own. Nor API
#: tokens: each shard makes its own secret.
EVERYWHERE: frozenset[str] = frozenset({"add_account", "update_account", "delete_account"})

#: ``WRONG_SHARD``'s detail: the owner's name, its leader's endpoint (may be "" in a failover),
#: every endpoint of its nodes (comma-separated), and what was routed (kind, name).
DETAIL_SHARD, DETAIL_LEADER, DETAIL_ENDPOINTS = "shard", "leader_endpoint", "endpoints"
DETAIL_KIND, DETAIL_NAME = "kind", "name"

#: Names longer than this are never looked up in the directory (they are refused by the
#: requests' own checks anyway).
MAX_NAME = 256
#: Shards a directory lists, and a client keeps clients of, at most (so an answer naming more
#: cannot make a client open a socket per name).
MAX_SHARDS = 64


def route_of(method: str, params: object) -> tuple[Kind, str] | None:
    """What a call of ``method`` is routed by: (kind, name), or None (any node answers, or the
    name is missing, empty or not a string). ``params``: its params map, or its validated request."""
    route = ROUTES.get(method)
    if route is None:
        return None
    name = name_at(params, route.field)
    return None if name is None else (route.kind, name)


def name_at(value: object, field: str) -> str | None:
    """The name at ``field`` (dotted) of a params map or a request Struct; None when there is
    none, or it is not a string of 1 to :data:`MAX_NAME` characters."""
    for part in field.split("."):
        value = value.get(part) if isinstance(value, Mapping) else getattr(value, part, None)
    return value if isinstance(value, str) and 0 < len(value) <= MAX_NAME else None


class ShardInfo(NamedTuple):
    """One shard as the directory lists it."""

    name: str
    leader: str  # the leader's endpoint; "" while none is known
    endpoints: tuple[str, ...]  # every live node's endpoint, the leader first


def _endpoint(text: str) -> bool:
    """An endpoint a client may be sent to (never another scheme an answer could smuggle in)."""
    return text.startswith(("tcp://", "ipc://")) and len(text) <= 512 and text.isprintable()


def shard_from_detail(detail: Mapping[str, str]) -> ShardInfo | None:
    """The shard a ``WRONG_SHARD`` names, or None when its detail does not name one."""
    name = detail.get(DETAIL_SHARD, "")
    if not name:
        return None
    leader = detail.get(DETAIL_LEADER, "")
    leader = leader if _endpoint(leader) else ""
    endpoints = tuple(e for e in detail.get(DETAIL_ENDPOINTS, "").split(",") if _endpoint(e))
    if leader and leader not in endpoints:
        endpoints = (leader, *endpoints)
    return ShardInfo(name, leader, endpoints)


def shards_from_map(reply: object) -> dict[str, ShardInfo]:
    """The shards of a ``get_shard_map`` reply (``{"shards": [{"name", "leader_endpoint",
    "endpoints"}]}``); malformed entries are skipped."""
    shards = reply.get("shards") if isinstance(reply, Mapping) else None
    out: dict[str, ShardInfo] = {}
    for item in shards[:MAX_SHARDS] if isinstance(shards, list) else []:
        if not isinstance(item, Mapping):
            continue
        name, leader, endpoints = item.get("name"), item.get("leader_endpoint"), item.get("endpoints")
        if not isinstance(name, str) or not name or not isinstance(leader, str) or not isinstance(endpoints, list):
            continue
        found = tuple(e for e in endpoints if isinstance(e, str) and _endpoint(e))
        leader = leader if _endpoint(leader) else ""
        out[name] = ShardInfo(name, leader, ((leader,) if leader and leader not in found else ()) + found)
    return out


__all__ = [
    "DETAIL_ENDPOINTS",
    "DETAIL_KIND",
    "DETAIL_LEADER",
    "DETAIL_NAME",
    "DETAIL_SHARD",
    "EVERYWHERE",
    "FAN_OUT",
    "MAX_SHARDS",
    "ROUTES",
    "Kind",
    "Route",
    "ShardInfo",
    "name_at",
    "route_of",
    "shard_from_detail",
    "shards_from_map",
]
