"""kvcm's results as Tair's replies: one translator per Tair RPC (kvcm result -> Tair reply fields).

Each takes the result of the kvcm RPC its call became, and the call's :class:`Context`; the
header is :mod:`kvcm.tair.translate`'s. A result has kvcm's shapes (its schema made them), read
with :func:`kvcm.proto.tair.as_map` and friends: anything else is kvcm's own fault, a TypeError,
which the call answers as an internal error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvcm.errors import ServerError
from kvcm.proto import tair as s
from kvcm.proto.wire import Decoded, DecodedMap, Encodable
from kvcm.tair.uris import CallerRoots, Translator

Reply = dict[str, Encodable]


@dataclass
class Context:
    """What a reply may need about the listener a call came in on. One per call (so
    :func:`kvcm.tair.translate.serve` sets ``uris`` on it rather than copying it)."""

    http_port: int  # the side port (Tair's meta HTTP port)
    admin_port: int | None  # http.admin_port when serving, else None
    local_host: str  # the address the connection arrived at
    #: ``get_manager_cluster_info`` of the node at an RPC endpoint (None when it does not answer):
    #: a follower asks the leader for its HTTP port, which the lease does not record.
    ask: Callable[[str], DecodedMap | None] = lambda endpoint: None
    #: the storages' directories, kept by the listener across calls per caller (Tair's URIs carry them)
    roots: CallerRoots = field(default_factory=CallerRoots)
    #: this call's URI translation (set by serve)
    uris: Translator | None = None

    def tair_uris(self, locations: Decoded) -> list[DecodedMap]:
        """kvcm's locations with Tair's URIs (changed in place)."""
        if self.uris is None:
            raise ServerError("tair: a location reply without a URI translator")
        return self.uris.locations_out(s.as_maps(locations))


def _compact(value: Decoded) -> str:
    return json.dumps(value, separators=(",", ":"))


def empty(result: Decoded, ctx: Context) -> Reply:
    return {}


def elector(result: Decoded, ctx: Context) -> Reply:
    return {"campaign_delay_time_ms": s.out64(s.as_map(result)["campaign_delay_time_ms"])}


def locations(result: Decoded, ctx: Context) -> Reply:
    return {"locations": s.locations_out(ctx.tair_uris(s.as_map(result)["locations"]))}


def location_len(result: Decoded, ctx: Context) -> Reply:
    return {"cache_location_len": str(s.as_map(result)["cache_location_len"])}


def meta(result: Decoded, ctx: Context) -> Reply:
    found = s.as_map(result)
    metas = s.as_maps(found["metas"])
    # detail_level 2 lists every copy's location
    ctx.tair_uris([s.as_map(copy)["location"] for item in metas for copy in s.as_list(item.get("all") or [])])
    return {"locations": s.locations_out(ctx.tair_uris(found["locations"])),
            "metas": [_compact(item) for item in metas]}


def write_started(result: Decoded, ctx: Context) -> Reply:
    started = s.as_map(result)
    return {"write_session_id": started["write_session_id"], "block_mask": s.mask_out(s.as_map(started["block_mask"])),
            "locations": s.locations_out(ctx.tair_uris(started["locations"]))}


def registered(result: Decoded, ctx: Context) -> Reply:
    configs = [s.storage_out(storage) for storage in s.as_maps(s.as_map(result).get("storage_configs") or [])]
    return {"storage_configs": json.dumps(configs, separators=(",", ":")), "extra_info": ""}


def instance_meta(result: Decoded, ctx: Context) -> Reply:
    found = s.as_map(result)
    return {"instance_group": found["instance_group"], "instance_info": s.instance_out(s.as_map(found["instance_info"]))}


def instance_admin(result: Decoded, ctx: Context) -> Reply:
    return {"instance_info": s.instance_out(s.as_map(s.as_map(result)["instance_info"]))}


def instances(result: Decoded, ctx: Context) -> Reply:
    return {"instance_info": [s.instance_out(info) for info in s.as_maps(s.as_map(result)["instance_info"])]}


def storages(result: Decoded, ctx: Context) -> Reply:
    return {"storage": [s.storage_out(storage) for storage in s.as_maps(s.as_map(result)["storage"])]}


def group(result: Decoded, ctx: Context) -> Reply:
    return {"instance_group": s.group_out(s.as_map(s.as_map(result)["instance_group"]))}


def groups(result: Decoded, ctx: Context) -> Reply:
    return {"instance_group": [s.group_out(item) for item in s.as_maps(s.as_map(result)["instance_group"])]}


def accounts(result: Decoded, ctx: Context) -> Reply:
    return {"accounts": [{"user_name": a["user_name"], "role": s.ACCOUNT_ROLE.out(a["role"])}
                         for a in s.as_maps(s.as_map(result)["accounts"])]}


def reported(result: Decoded, ctx: Context) -> Reply:
    # kvcm applies a report whole or refuses it: no per-item results. resync is Tair's hint to
    # send a full snapshot (kvcm restarted, or the source expired and may miss blocks).
    return {"item_results": [], "committed_snapshot_version": "", "retry_after_ms": "0",
            "snapshot_required": bool(s.as_map(result).get("resync")), "extra_info": ""}


def host_state(result: Decoded, ctx: Context) -> Reply:
    return {"hosts": [{"host_ip_port": host["host_ip_port"], "local": s.out64(host["local"]),
                       "p2p_1_fetch": s.out64(host["p2p_1_fetch"]),
                       "p2p_1_total_match": s.out64(host["p2p_1_total_match"])}
                      for host in s.as_maps(s.as_map(result)["hosts"])]}


def snapshot(result: Decoded, ctx: Context) -> Reply:
    return {"config_snapshot": _compact(s.as_map(result)["config_snapshot"])}


def health(result: Decoded, ctx: Context) -> Reply:
    found = s.as_map(result)
    return {"is_leader": bool(found.get("is_leader")), "is_health": bool(found.get("is_health")),
            "elector_last_loop_time_ms": "0"}


def metrics(result: Decoded, ctx: Context) -> Reply:
    found = s.as_map(result)
    out: list[Encodable] = []
    for name, samples in s.as_map(found["metrics"]).items():
        for sample in s.as_maps(samples):
            value = _number(sample["value"])
            number: dict[str, Encodable] = \
                {"int_value": str(int(value))} if float(value).is_integer() else {"float_value": value}
            out.append({"metric_name": name, "metric_value": number,
                        "metric_tags": [{"tag_key": k, "tag_value": v} for k, v in s.as_map(sample["labels"]).items()]})
    return {"timestamp": s.out64(found["timestamp"]), "metrics": out, "extra_data": ""}


def _number(value: Decoded) -> int | float:
    if not isinstance(value, (int, float)):
        raise TypeError(f"a metric's value is a number, not {type(value).__name__}")
    return value


# -- the leader's endpoint -------------------------------------------------------------------------


class Leader(NamedTuple):
    node_id: str
    host: str
    rpc_port: int
    http_port: int


def leader_of(info: DecodedMap, ctx: Context) -> Leader | None:
    """The leader's Tair endpoint from ``get_manager_cluster_info``. When this node leads: its own
    listener. On a follower: the leader's RPC endpoint from the lease, and the HTTP port the
    leader itself reports (asked over RPC: the lease does not record it); if the leader does not
    answer, this node's own http.port. None while no leader is known (a failover in progress)."""
    node = s.as_map(info.get("leader_endpoint") or {})
    node_id = str(info.get("leader_node_id") or node.get("node_id") or "")
    if not node_id:
        return None
    endpoint = str(node.get("endpoint") or "")
    host, rpc_port = s.endpoint_parts(endpoint)
    http_port: Decoded
    if info.get("leader"):
        http_port = node.get("http_port")
        if host in ("", "*", "0.0.0.0", "::"):
            host = ctx.local_host  # a wildcard bind: the address this client reached us at
    else:
        leader = ctx.ask(endpoint) if endpoint else None
        http_port = s.as_map(leader.get("self") or {}).get("http_port") if leader else None
    if isinstance(http_port, (list, dict)):
        raise TypeError(f"an HTTP port cannot be a {type(http_port).__name__}")
    return Leader(node_id, host, rpc_port, int(http_port or ctx.http_port))


def leader_endpoint(info: DecodedMap, ctx: Context) -> Reply | None:
    """Tair's ``leader_endpoint`` of MetaService (see :func:`leader_of`)."""
    leader = leader_of(info, ctx)
    if leader is None:
        return None
    return {"node_id": leader.node_id, "host": leader.host, "meta_rpc_port": leader.rpc_port,
            "meta_http_port": leader.http_port, "custom_info": ""}


def cluster(result: Decoded, ctx: Context) -> Reply:
    info = s.as_map(result)
    out: Reply = {"self_node_id": str(info.get("self_node_id") or ""),
                  "leader_node_id": str(info.get("leader_node_id") or "")}
    endpoint = leader_endpoint(info, ctx)
    if endpoint is not None:
        out["leader_endpoint"] = endpoint
    return out


def manager_cluster(result: Decoded, ctx: Context) -> Reply:
    """AdminService's cluster info: MetaService's, with the admin ports and the lease's times."""
    info = s.as_map(result)
    out: Reply = {"info_updated_time": s.out64(info.get("info_updated_time")),
                  "self_leader_expiration_time": s.out64(info.get("self_leader_expiration_time")),
                  "self_node_id": str(info.get("self_node_id") or ""),
                  "leader_node_id": str(info.get("leader_node_id") or "")}
    leader = leader_of(info, ctx)
    if leader is not None:
        admin = ctx.admin_port if ctx.admin_port is not None else leader.http_port
        out["leader_endpoint"] = {"node_id": leader.node_id, "host": leader.host, "meta_rpc_port": leader.rpc_port,
                                  "meta_http_port": leader.http_port, "admin_rpc_port": leader.rpc_port,
                                  "admin_http_port": admin, "custom_info": ""}
    return out
