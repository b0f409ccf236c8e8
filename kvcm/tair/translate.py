"""Tair KVCM's RPCs on kvcm: one request and one reply translator per RPC, in two tables.

A Tair call is translated to exactly one kvcm RPC (Tair JSON -> kvcm params), forwarded as any
``/api`` call is (so kvcm's validation, auth and group commit apply to the translated request),
and its reply translated back (kvcm result -> Tair JSON). Nothing here implements an RPC.

Every reply has Tair's header, ``{"status": {"code", "message"}, "request_id"}``; a kvcm error
becomes the Tair code of :data:`TAIR_CODES` with kvcm's precise name in front of the message.
``META`` holds MetaService, ``ADMIN`` AdminService (which shares four names with different reply
shapes); :data:`UNSUPPORTED` are Tair RPCs kvcm has no equivalent for.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvcm.errors import Code, InvalidArgument, KvcmError, ServerError
from kvcm.proto import tair as s
from kvcm.tair.uris import CallerRoots as CallerRoots  # re-exported: the listener keeps one
from kvcm.tair.uris import Fetch, Translator

log = logging.getLogger("kvcm.tair")

#: A Tair method name: lowerCamel with at least one capital, which no kvcm (snake_case) name has;
#: at most 64 characters, as kvcm's own.
TAIR_NAME = re.compile(r"(?=[A-Za-z0-9]{2,64}$)[a-z][a-z0-9]*(?:[A-Z][a-z0-9]*)+")

#: kvcm's error codes as Tair's ErrorCode names. Tair's own codes keep their names; kvcm's
#: precise ones fall back to the Tair code a Tair server answers in that case.
TAIR_CODES: dict[Code, str] = {
    Code.OK: "OK", Code.UNSUPPORTED: "UNSUPPORTED", Code.INTERNAL_ERROR: "INTERNAL_ERROR",
    Code.SERVICE_NOT_READY: "SERVICE_NOT_READY", Code.INVALID_ARGUMENT: "INVALID_ARGUMENT",
    Code.DUPLICATE_ENTITY: "DUPLICATE_ENTITY", Code.REACH_MAX_ENTITY_CAPACITY: "REACH_MAX_ENTITY_CAPACITY",
    Code.INSTANCE_NOT_EXIST: "INSTANCE_NOT_EXIST", Code.SERVER_NOT_LEADER: "SERVER_NOT_LEADER",
    Code.IO_ERROR: "IO_ERROR",
    # the request names what is not there, or asks for more than is allowed
    Code.NOT_FOUND: "INVALID_ARGUMENT", Code.WRITE_SESSION_UNKNOWN: "INVALID_ARGUMENT",
    Code.WRITE_SESSION_EXPIRED: "INVALID_ARGUMENT", Code.MESSAGE_TOO_LARGE: "INVALID_ARGUMENT",
    Code.TOO_MANY_KEYS: "INVALID_ARGUMENT", Code.TOO_LARGE: "INVALID_ARGUMENT",
    Code.METHOD_NOT_FOUND: "UNSUPPORTED", Code.VERSION_CONFLICT: "INVALID_ARGUMENT",
    Code.STILL_REFERENCED: "INVALID_ARGUMENT", Code.UNAUTHENTICATED: "INVALID_ARGUMENT",
    Code.PERMISSION_DENIED: "INVALID_ARGUMENT",
    # Tair collapses running out of room into INTERNAL_ERROR
    Code.QUOTA_EXCEEDED: "INTERNAL_ERROR", Code.NO_STORAGE_AVAILABLE: "INTERNAL_ERROR",
    Code.CAPACITY_EXHAUSTED: "INTERNAL_ERROR",
    # try again later
    Code.SHUTTING_DOWN: "SERVICE_NOT_READY", Code.TIMEOUT: "SERVICE_NOT_READY", Code.RATE_LIMITED: "SERVICE_NOT_READY",
}


@dataclass
class Context:
    """What a reply may need about the listener a call came in on. One per call (so :func:`serve`
    sets ``uris`` on it rather than copying it)."""

    http_port: int  # the side port (Tair's meta HTTP port)
    admin_port: int | None  # http.admin_port when serving, else None
    local_host: str  # the address the connection arrived at
    #: ``get_manager_cluster_info`` of the node at an RPC endpoint (None when it does not answer):
    #: a follower asks the leader for its HTTP port, which the lease does not record.
    ask: Callable[[str], Mapping[str, Any] | None] = lambda endpoint: None
    #: the storages' directories, kept by the listener across calls per caller (Tair's URIs carry them)
    roots: CallerRoots = field(default_factory=CallerRoots)
    #: this call's URI translation (set by :func:`serve`)
    uris: Translator | None = None

    def tair_uris(self, locations: list[Any]) -> list[Any]:
        """kvcm's locations with Tair's URIs (changed in place)."""
        if self.uris is None:
            raise ServerError("tair: a location reply without a URI translator")
        return self.uris.locations_out(locations)


@dataclass(frozen=True)
class Rpc:
    kvcm: str  # the kvcm method
    request: Callable[[dict[str, Any]], dict[str, Any]]  # Tair body (header-less) -> kvcm params
    reply: Callable[[Any, Context], dict[str, Any]]  # kvcm result -> Tair reply fields
    codes: Mapping[Code, str] = field(default_factory=dict)  # this RPC's own Tair codes, over TAIR_CODES


# -- requests -------------------------------------------------------------------------------------


def _body(fields: str) -> frozenset[str]:
    return frozenset({"trace_id", *fields.split()})


def _keys(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"instance_id": s.text(body.get("instance_id"), "instance_id")}
    if body.get("block_keys") is not None:
        out["block_keys"] = s.int64_list(body["block_keys"], "block_keys")
    if body.get("token_ids") is not None:
        out["token_ids"] = s.int64_list(body["token_ids"], "token_ids")
    for name in _EXTRAS:  # kvcm's own fields (Tair has none for them), checked by kvcm's schema
        if body.get(name) is not None:
            out[name] = body[name]
    return out


#: A prompt's extra keys (docs/engines.md "Keys"): kvcm's fields, taken by Tair's routes with token_ids.
_EXTRAS = ("extra_keys", "mm_features", "lora_name", "cache_salt")


def _mask(out: dict[str, Any], body: dict[str, Any], field: str, kvcm_field: str | None = None) -> dict[str, Any]:
    mask = s.mask_in(body.get(field), field)
    if mask is not None:
        out[kvcm_field or field] = mask
    return out


def _query_type(out: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    kind = s.QUERY_TYPE.to_kvcm(body.get("query_type"), "query_type")
    if kind is None:
        raise InvalidArgument("query_type: required (kvcm keeps no per-instance default_query_type)")
    out["query_type"] = kind
    if body.get("sw_size") is not None:
        out["sw_size"] = s.int32(body["sw_size"], "sw_size")
    return out


def get_cache_location_in(body: dict[str, Any]) -> dict[str, Any]:
    out = _query_type(_mask(_keys(body), body, "block_mask"), body)
    if body.get("location_spec_names") is not None:
        out["location_spec_names"] = s.texts(body["location_spec_names"], "location_spec_names")
    return out


def get_cache_location_len_in(body: dict[str, Any]) -> dict[str, Any]:
    return _query_type(_keys(body), body)


def get_cache_meta_in(body: dict[str, Any]) -> dict[str, Any]:
    out = _mask(_keys(body), body, "block_mask")
    if body.get("detail_level") is not None:
        out["detail_level"] = s.int32(body["detail_level"], "detail_level")
    return out


def start_write_cache_in(body: dict[str, Any]) -> dict[str, Any]:
    out = _keys(body)
    if body.get("location_spec_group_names") is not None:
        out["location_spec_group_names"] = s.texts(body["location_spec_group_names"], "location_spec_group_names")
    if body.get("write_timeout_seconds") is not None:
        out["write_timeout_seconds"] = s.int32(body["write_timeout_seconds"], "write_timeout_seconds")
    if s.int32(body.get("min_replica_count"), "min_replica_count") > 1:
        raise InvalidArgument("min_replica_count: kvcm keeps one copy of a key; 0 or 1 only")
    return out


def finish_write_cache_in(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"instance_id": s.text(body.get("instance_id"), "instance_id"),
                           "write_session_id": s.text(body.get("write_session_id"), "write_session_id")}
    locations = s.messages(body.get("locations"), "locations")  # ignored by kvcm, as by Tair
    if locations:
        out["locations"] = locations  # checked and made kvcm's URIs by serve (they need the roots)
    return _mask(out, body, "success_blocks")


def remove_cache_in(body: dict[str, Any]) -> dict[str, Any]:
    return _mask(_keys(body), body, "block_mask")


def trim_cache_in(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"instance_id": s.text(body.get("instance_id"), "instance_id")}
    strategy = s.TRIM_STRATEGY.to_kvcm(body.get("strategy"), "strategy")
    if strategy is None:
        raise InvalidArgument("strategy: required (TS_REMOVE_ALL_CACHE, TS_REMOVE_ALL_META or TS_TIMESTAMP)")
    out["strategy"] = strategy
    for key in ("begin_timestamp", "end_timestamp"):
        if body.get(key) is not None:
            out[key] = s.int64(body[key], key)
    return out


def register_instance_in(body: dict[str, Any]) -> dict[str, Any]:
    s.QUERY_TYPE.parse(body.get("default_query_type"), "default_query_type")  # accepted, not kept
    out: dict[str, Any] = {
        "instance_group": s.text(body.get("instance_group"), "instance_group"),
        "instance_id": s.text(body.get("instance_id"), "instance_id"),
        "block_size": s.int32(body.get("block_size"), "block_size"),
        "location_spec_infos": s.spec_infos_in(body.get("location_spec_infos"), "location_spec_infos"),
        "location_spec_groups": s.spec_groups_in(body.get("location_spec_groups"), "location_spec_groups"),
    }
    if body.get("model_deployment") is not None:
        out["model_deployment"] = s.deployment_in(body["model_deployment"], "model_deployment")
    return out


def _instance_id(body: dict[str, Any]) -> dict[str, Any]:
    return {"instance_id": s.text(body.get("instance_id"), "instance_id")}


def _remove_instance_in(body: dict[str, Any]) -> dict[str, Any]:
    return {**_instance_id(body), "instance_group": s.text(body.get("instance_group"), "instance_group")}


def _nothing(body: dict[str, Any]) -> dict[str, Any]:
    return {}


def _storage_name(body: dict[str, Any]) -> dict[str, Any]:
    return {"storage_unique_name": s.text(body.get("storage_unique_name"), "storage_unique_name")}


def _group_name(body: dict[str, Any]) -> dict[str, Any]:
    return {"name": s.text(body.get("name"), "name")}


def _add_storage_in(body: dict[str, Any]) -> dict[str, Any]:
    return {"storage": s.storage_in(body.get("storage"), "storage")}


def _update_storage_in(body: dict[str, Any]) -> dict[str, Any]:
    return {"storage": s.storage_in(body.get("storage"), "storage"),
            "force_update": s.boolean(body.get("force_update"), "force_update")}


def _create_group_in(body: dict[str, Any]) -> dict[str, Any]:
    return {"instance_group": s.group_in(body.get("instance_group"), "instance_group")}


def _update_group_in(body: dict[str, Any]) -> dict[str, Any]:
    group = s.group_in(body.get("instance_group"), "instance_group")
    version = s.int64(body.get("current_version"), "current_version") or \
        s.group_version(body.get("instance_group"), "instance_group")
    return {"instance_group": group, "current_version": version or None}  # none given: kvcm says required


def _list_instances_in(body: dict[str, Any]) -> dict[str, Any]:
    return {"instance_group_name": s.text(body.get("instance_group_name"), "instance_group_name")}


def _add_account_in(body: dict[str, Any]) -> dict[str, Any]:
    # Tair has no per-group tenancy: its accounts may use every group unless kvcm's ``groups`` says.
    groups = s.texts(body["groups"], "groups") if body.get("groups") is not None else ["*"]
    return {"user_name": s.text(body.get("user_name"), "user_name"),
            "password": s.text(body.get("password"), "password"),
            "role": s.ACCOUNT_ROLE.to_kvcm(body.get("role"), "role"), "groups": groups}


def _user_name(body: dict[str, Any]) -> dict[str, Any]:
    return {"user_name": s.text(body.get("user_name"), "user_name")}


def _load_snapshot_in(body: dict[str, Any]) -> dict[str, Any]:
    return {"config_snapshot": s.text(body.get("config_snapshot"), "config_snapshot")}


#: kvcm's bound on a source id, which a reporter's identity becomes.
_MAX_SOURCE_ID = 200


def reporter_source_id(instance_id: str, storage_type: str, host_ip_port: str) -> str:
    """The kvcm push source of a Tair reporter: Tair names one by instance, declared storage type
    and host, so two storage types of one host are two sources (of one pod, the host)."""
    return f"tair/{instance_id}/{s.REPORTER_STORAGE[storage_type]}/{host_ip_port}"


def report_event_in(body: dict[str, Any]) -> dict[str, Any]:
    """Tair's ReportEvent as one ``report_events`` report of the reporter's push source. Its
    items must make one kvcm op: registers (merged), heartbeats (merged), adds and deletes (one
    unsequenced batch, in order), one snapshot, or host downs (merged)."""
    instance_id = s.text(body.get("instance_id"), "instance_id")
    host = s.text(body.get("host_ip_port"), "host_ip_port")
    if not host:
        raise InvalidArgument("host_ip_port: required (the reporter's host, its pod in kvcm)")
    storage = s.STORAGE_TYPE.parse(body.get("storage_type"), "storage_type")
    if storage not in s.REPORTER_STORAGE:
        raise InvalidArgument(f"storage_type: {storage} is not an event-report storage type "
                              f"({' or '.join(s.REPORTER_STORAGE)})")
    source_id = reporter_source_id(instance_id, storage, host)
    if len(source_id) > _MAX_SOURCE_ID:
        raise InvalidArgument(f"host_ip_port: instance_id and host_ip_port together are too long "
                              f"(kvcm's source id {source_id[:40]!r}... exceeds {_MAX_SOURCE_ID} characters)")
    items = [s.event_in(raw, f"events[{i}]") for i, raw in enumerate(s.messages(body.get("events"), "events"))]
    if not items:
        raise InvalidArgument("events: required (at least one event)")
    for i, item in enumerate(items):
        if item.op != items[0].op:
            raise InvalidArgument(f"events[{i}].event_type: {item.name} cannot share a call with {items[0].name} "
                                  f"(kvcm applies one kind of report per call: send them apart)")
        if item.op == "snapshot" and i:
            raise InvalidArgument(f"events[{i}]: one EVENT_BLOCK_SNAPSHOT per call")
    out: dict[str, Any] = {"source_id": source_id, "op": items[0].op}
    if items[0].op == "register":
        out.update(instance_id=instance_id, pod=host)
    elif items[0].op in ("events", "snapshot"):
        out["events"] = _batched(block for item in items for block in item.blocks)
    return out


def _batched(blocks: Iterable[tuple[str, str, int]]) -> list[dict[str, Any]]:
    """kvcm events of Tair's blocks, in order: a run of one kind on one medium is one event
    (keyed adds have no chain to keep, so a run holds any keys)."""
    out: list[dict[str, Any]] = []
    for kind, medium, key in blocks:
        last = out[-1] if out else None
        if last is not None and last["type"] == kind and last["medium"] == medium:
            last["block_hashes"].append(key)
        elif kind == "add":
            out.append({"type": "add", "keyed": True, "medium": medium, "block_hashes": [key]})
        else:
            out.append({"type": "remove", "keyed": True, "medium": medium, "block_hashes": [key]})
    return out


def host_cache_state_in(body: dict[str, Any]) -> dict[str, Any]:
    """Tair's GetHostCacheState as kvcm's ``get_host_cache_state``: prefix matching only (an
    unset query_type means it too: there is no other answer)."""
    kind = s.QUERY_TYPE.parse(body.get("query_type"), "query_type")
    if kind not in ("QT_UNSPECIFIED", "QT_PREFIX_MATCH"):
        raise InvalidArgument(f"query_type: {kind} is not answered; kvcm matches hosts by prefix (QT_PREFIX_MATCH)")
    out: dict[str, Any] = {"instance_id": s.text(body.get("instance_id"), "instance_id"), "query_type": "prefix_match",
                           "block_cache_keys": s.int64_list(body.get("block_cache_keys"), "block_cache_keys")}
    medium = s.texts(body.get("medium"), "medium")
    if medium:
        out["medium"] = medium
    if body.get("p2p_host_count") is not None:
        out["p2p_host_count"] = s.int32(body["p2p_host_count"], "p2p_host_count")
    return out


# -- replies --------------------------------------------------------------------------------------


def _empty(result: Any, ctx: Context) -> dict[str, Any]:
    return {}


def _elector_in(body: dict[str, Any]) -> dict[str, Any]:
    return {"campaign_delay_time_ms": s.int64(body.get("campaign_delay_time_ms", 0), "campaign_delay_time_ms")}


def _elector(result: Any, ctx: Context) -> dict[str, Any]:
    return {"campaign_delay_time_ms": s.out64(result["campaign_delay_time_ms"])}


def _locations(result: Any, ctx: Context) -> dict[str, Any]:
    return {"locations": s.locations_out(ctx.tair_uris(result["locations"]))}


def _location_len(result: Any, ctx: Context) -> dict[str, Any]:
    return {"cache_location_len": str(result["cache_location_len"])}


def _meta(result: Any, ctx: Context) -> dict[str, Any]:
    # detail_level 2 lists every copy's location
    ctx.tair_uris([copy["location"] for meta in result["metas"] for copy in meta.get("all") or ()])
    return {"locations": s.locations_out(ctx.tair_uris(result["locations"])),
            "metas": [json.dumps(meta, separators=(",", ":")) for meta in result["metas"]]}


def _write_started(result: Any, ctx: Context) -> dict[str, Any]:
    return {"write_session_id": result["write_session_id"], "block_mask": s.mask_out(result["block_mask"]),
            "locations": s.locations_out(ctx.tair_uris(result["locations"]))}


def _registered(result: Any, ctx: Context) -> dict[str, Any]:
    configs = [s.storage_out(storage) for storage in result.get("storage_configs") or []]
    return {"storage_configs": json.dumps(configs, separators=(",", ":")), "extra_info": ""}


def _instance_meta(result: Any, ctx: Context) -> dict[str, Any]:
    return {"instance_group": result["instance_group"], "instance_info": s.instance_out(result["instance_info"])}


def _instance_admin(result: Any, ctx: Context) -> dict[str, Any]:
    return {"instance_info": s.instance_out(result["instance_info"])}


def _instances(result: Any, ctx: Context) -> dict[str, Any]:
    return {"instance_info": [s.instance_out(info) for info in result["instance_info"]]}


def _storages(result: Any, ctx: Context) -> dict[str, Any]:
    return {"storage": [s.storage_out(storage) for storage in result["storage"]]}


def _group(result: Any, ctx: Context) -> dict[str, Any]:
    return {"instance_group": s.group_out(result["instance_group"])}


def _groups(result: Any, ctx: Context) -> dict[str, Any]:
    return {"instance_group": [s.group_out(group) for group in result["instance_group"]]}


def _accounts(result: Any, ctx: Context) -> dict[str, Any]:
    return {"accounts": [{"user_name": a["user_name"], "role": s.ACCOUNT_ROLE.out(a["role"])}
                         for a in result["accounts"]]}


def _reported(result: Any, ctx: Context) -> dict[str, Any]:
    # kvcm applies a report whole or refuses it: no per-item results. resync is Tair's hint to
    # send a full snapshot (kvcm restarted, or the source expired and may miss blocks).
    return {"item_results": [], "committed_snapshot_version": "", "retry_after_ms": "0",
            "snapshot_required": bool(result.get("resync")), "extra_info": ""}


def _host_state(result: Any, ctx: Context) -> dict[str, Any]:
    return {"hosts": [{"host_ip_port": host["host_ip_port"], "local": s.out64(host["local"]),
                       "p2p_1_fetch": s.out64(host["p2p_1_fetch"]),
                       "p2p_1_total_match": s.out64(host["p2p_1_total_match"])} for host in result["hosts"]]}


def _snapshot(result: Any, ctx: Context) -> dict[str, Any]:
    return {"config_snapshot": json.dumps(result["config_snapshot"], separators=(",", ":"))}


def _health(result: Any, ctx: Context) -> dict[str, Any]:
    return {"is_leader": bool(result.get("is_leader")), "is_health": bool(result.get("is_health")),
            "elector_last_loop_time_ms": "0"}


def _metrics(result: Any, ctx: Context) -> dict[str, Any]:
    metrics = []
    for name, samples in result["metrics"].items():
        for sample in samples:
            value = sample["value"]
            number = {"int_value": str(int(value))} if float(value).is_integer() else {"float_value": value}
            metrics.append({"metric_name": name, "metric_value": number,
                            "metric_tags": [{"tag_key": k, "tag_value": v} for k, v in sample["labels"].items()]})
    return {"timestamp": s.out64(result["timestamp"]), "metrics": metrics, "extra_data": ""}


def leader_endpoint(info: Mapping[str, Any], ctx: Context) -> dict[str, Any] | None:
    """The leader's Tair endpoint from ``get_manager_cluster_info``. When this node leads: its own
    listener. On a follower: the leader's RPC endpoint from the lease, and the HTTP port the
    leader itself reports (asked over RPC: the lease does not record it); if the leader does not
    answer, this node's own http.port. None while no leader is known (a failover in progress)."""
    node = info.get("leader_endpoint") or {}
    node_id = str(info.get("leader_node_id") or node.get("node_id") or "")
    if not node_id:
        return None
    endpoint = str(node.get("endpoint") or "")
    host, rpc_port = s.endpoint_parts(endpoint)
    if info.get("leader"):
        http_port = node.get("http_port")
        if host in ("", "*", "0.0.0.0", "::"):
            host = ctx.local_host  # a wildcard bind: the address this client reached us at
    else:
        leader = ctx.ask(endpoint) if endpoint else None
        http_port = (leader.get("self") or {}).get("http_port") if leader else None
    return {"node_id": node_id, "host": host, "meta_rpc_port": rpc_port,
            "meta_http_port": int(http_port or ctx.http_port), "custom_info": ""}


def _cluster(result: Any, ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {"self_node_id": str(result.get("self_node_id") or ""),
                           "leader_node_id": str(result.get("leader_node_id") or "")}
    endpoint = leader_endpoint(result, ctx)
    if endpoint is not None:
        out["leader_endpoint"] = endpoint
    return out


def _manager_cluster(result: Any, ctx: Context) -> dict[str, Any]:
    out = _cluster(result, ctx)
    endpoint = out.get("leader_endpoint")
    if endpoint is not None:
        endpoint.pop("custom_info")
        admin = ctx.admin_port if ctx.admin_port is not None else endpoint["meta_http_port"]
        endpoint.update(admin_rpc_port=endpoint["meta_rpc_port"], admin_http_port=admin, custom_info="")
    return {"info_updated_time": s.out64(result.get("info_updated_time")),
            "self_leader_expiration_time": s.out64(result.get("self_leader_expiration_time")), **out}


# -- the tables -----------------------------------------------------------------------------------

_KEYS = "instance_id block_keys token_ids " + " ".join(_EXTRAS)

#: Tair name -> (fields of its request message, the translator).
META: dict[str, tuple[frozenset[str], Rpc]] = {
    "registerInstance": (_body("instance_group instance_id block_size location_spec_infos model_deployment "
                               "location_spec_groups default_query_type"),
                         Rpc("register_instance", register_instance_in, _registered)),
    "getInstanceInfo": (_body("instance_id"), Rpc("get_instance_info", _instance_id, _instance_meta)),
    "getCacheLocation": (_body(f"{_KEYS} query_type block_mask sw_size location_spec_names"),
                         Rpc("get_cache_location", get_cache_location_in, _locations)),
    "getCacheLocationLen": (_body(f"{_KEYS} query_type sw_size"),
                            Rpc("get_cache_location_len", get_cache_location_len_in, _location_len)),
    "getCacheMeta": (_body(f"{_KEYS} block_mask detail_level"), Rpc("get_cache_meta", get_cache_meta_in, _meta)),
    "startWriteCache": (_body(f"{_KEYS} location_spec_group_names write_timeout_seconds min_replica_count"),
                        Rpc("start_write_cache", start_write_cache_in, _write_started)),
    "finishWriteCache": (_body("instance_id write_session_id success_blocks locations"),
                         Rpc("finish_write_cache", finish_write_cache_in, _empty)),
    "removeCache": (_body(f"{_KEYS} block_mask"), Rpc("remove_cache", remove_cache_in, _empty)),
    "trimCache": (_body("instance_id strategy begin_timestamp end_timestamp"),
                  Rpc("trim_cache", trim_cache_in, _empty)),
    "getClusterInfo": (_body("instance_id"), Rpc("get_manager_cluster_info", _nothing, _cluster)),
    # a source that is not registered (or another tenant's) is Tair's NODE_NOT_REGISTERED
    "reportEvent": (_body("instance_id host_ip_port events storage_type"),
                    Rpc("report_events", report_event_in, _reported, {Code.NOT_FOUND: "NODE_NOT_REGISTERED"})),
    "getHostCacheState": (_body("instance_id query_type block_cache_keys medium p2p_host_count"),
                          Rpc("get_host_cache_state", host_cache_state_in, _host_state)),
}

ADMIN: dict[str, tuple[frozenset[str], Rpc]] = {
    "addStorage": (_body("storage"), Rpc("add_storage", _add_storage_in, _empty)),
    "enableStorage": (_body("storage_unique_name"), Rpc("enable_storage", _storage_name, _empty)),
    "disableStorage": (_body("storage_unique_name"), Rpc("disable_storage", _storage_name, _empty)),
    "removeStorage": (_body("storage_unique_name"), Rpc("remove_storage", _storage_name, _empty)),
    "updateStorage": (_body("storage force_update"), Rpc("update_storage", _update_storage_in, _empty)),
    "listStorage": (_body(""), Rpc("list_storage", _nothing, _storages)),
    "createInstanceGroup": (_body("instance_group"), Rpc("create_instance_group", _create_group_in, _empty)),
    "updateInstanceGroup": (_body("instance_group current_version"),
                            Rpc("update_instance_group", _update_group_in, _empty)),
    "removeInstanceGroup": (_body("name"), Rpc("remove_instance_group", _group_name, _empty)),
    "getInstanceGroup": (_body("name"), Rpc("get_instance_group", _group_name, _group)),
    "listInstanceGroup": (_body(""), Rpc("list_instance_groups", _nothing, _groups)),
    "getCacheMeta": META["getCacheMeta"],
    "removeCache": META["removeCache"],
    "registerInstance": (META["registerInstance"][0], Rpc("register_instance", register_instance_in, _empty)),
    "removeInstance": (_body("instance_group instance_id"), Rpc("remove_instance", _remove_instance_in, _empty)),
    "getInstanceInfo": (_body("instance_id"), Rpc("get_instance_info", _instance_id, _instance_admin)),
    "listInstanceInfo": (_body("instance_group_name"), Rpc("list_instance_info", _list_instances_in, _instances)),
    "addAccount": (_body("user_name password role groups"), Rpc("add_account", _add_account_in, _empty)),
    "deleteAccount": (_body("user_name"), Rpc("delete_account", _user_name, _empty)),
    "listAccount": (_body(""), Rpc("list_account", _nothing, _accounts)),
    "genConfigSnapshot": (_body(""), Rpc("gen_config_snapshot", _nothing, _snapshot)),
    "loadConfigSnapshot": (_body("config_snapshot"), Rpc("load_config_snapshot", _load_snapshot_in, _empty)),
    "getMetrics": (_body(""), Rpc("get_metrics", _nothing, _metrics)),
    "checkHealth": (_body(""), Rpc("check_health", _nothing, _health)),
    "getManagerClusterInfo": (_body(""), Rpc("get_manager_cluster_info", _nothing, _manager_cluster)),
    "leaderDemote": (_body(""), Rpc("leader_demote", _nothing, _empty)),
    "getLeaderElectorConfig": (_body(""), Rpc("get_leader_elector_config", _nothing, _elector)),
    "updateLeaderElectorConfig": (_body("campaign_delay_time_ms"),
                                  Rpc("update_leader_elector_config", _elector_in, _empty)),
}

#: Tair RPCs with no kvcm equivalent: answered UNSUPPORTED (docs/tair.md says why for each).
UNSUPPORTED: dict[str, str] = {
    "updateLogger": "kvcm's log level is a server setting",
    "migrateCache": "kvcm does not migrate blocks between storages",
    "listAsyncCopyQuarantine": "kvcm does not copy blocks between storages",
    "breakGlassReleaseAsyncCopy": "kvcm does not copy blocks between storages",
    "getCacheLocationsByBackend": "kvcm keeps one copy of a key; use getCacheLocation",
}

#: Which routes a listener serves: the side port without an admin port serves both services
#: (MetaService's shapes for the shared names), with one only MetaService; the admin port only
#: AdminService.
SURFACES: dict[str, tuple[dict[str, tuple[frozenset[str], Rpc]], ...]] = {
    "both": (META, ADMIN), "meta": (META,), "admin": (ADMIN,),
}


# -- serving one call -----------------------------------------------------------------------------


def header(code: str, message: str, trace_id: str) -> dict[str, Any]:
    return {"status": {"code": code, "message": message}, "request_id": f"{trace_id}_{int(time.time() * 1e6)}"}


def failure(exc: KvcmError, trace_id: str, codes: Mapping[Code, str] | None = None) -> dict[str, Any]:
    code = (codes or {}).get(exc.code) or TAIR_CODES.get(exc.code, "INTERNAL_ERROR")
    message = exc.message if code == exc.code.name else f"{exc.code.name}: {exc.message}"
    return {"header": header(code, message, trace_id)}


def refused(exc: KvcmError, body: Mapping[str, Any]) -> dict[str, Any]:
    """The Tair reply to a call the HTTP side refused before translating it (no credentials)."""
    trace_id = body.get("trace_id")
    return failure(exc, trace_id if isinstance(trace_id, str) else "")


def serve(name: str, body: dict[str, Any], surface: str, ctx: Context,
          forward: Callable[[str, dict[str, Any]], Any]) -> tuple[int, dict[str, Any]]:
    """(HTTP status, Tair reply) of one call; logical errors are 200 with their Tair code."""
    trace_id = body.get("trace_id")
    trace_id = trace_id if isinstance(trace_id, str) else ""
    entry = next((table[name] for table in SURFACES[surface] if name in table), None)
    if entry is None:  # an RPC kvcm lacks is a logical answer; a name not served here is a 404
        return (200 if name in UNSUPPORTED else 404), failure(_not_here(name, surface), trace_id)
    fields, rpc = entry
    try:
        s.text(body.get("trace_id"), "trace_id")
        auth = body.get("auth")
        params = rpc.request(s.message({k: v for k, v in body.items() if k != "auth"}, "", fields))
        if trace_id:
            params["trace_id"] = trace_id
        if auth is not None:
            params["auth"] = auth
        uris = ctx.roots.of(auth).translator(_fetcher(forward, params))
        if "locations" in params:
            params["locations"] = _locations_in(params["locations"], uris)
        result = forward(rpc.kvcm, params)
        if rpc.kvcm in _STORAGE_CHANGES:
            ctx.roots.clear()
        ctx.uris = uris
        reply = rpc.reply(result, ctx)
    except InvalidArgument as exc:
        if exc.code is Code.INVALID_ARGUMENT and not exc.message.startswith(rpc.kvcm + ":"):
            exc = InvalidArgument(f"{name}: {exc.message}")  # a translator's own check names the Tair RPC
        return 200, failure(exc, trace_id, rpc.codes)
    except KvcmError as exc:
        return 200, failure(exc, trace_id, rpc.codes)
    except Exception as exc:  # every call gets a Tair answer, whatever failed
        log.exception("tair: %s failed", name)
        return 200, failure(ServerError(f"internal error: {type(exc).__name__}"), trace_id)
    return 200, {"header": header("OK", "", trace_id), **reply}


#: kvcm RPCs after which the cached storage directories may be wrong.
_STORAGE_CHANGES = frozenset({"add_storage", "update_storage", "remove_storage", "load_config_snapshot"})
_LOCATION = frozenset({"type", "spec_size", "location_specs"})
_SPEC = frozenset({"name", "uri"})


def _fetcher(forward: Callable[[str, dict[str, Any]], Any], params: Mapping[str, Any]) -> Fetch:
    """The storages' specs, asked with the call's own instance and credentials."""

    def fetch(method: str) -> Any:
        call: dict[str, Any] = {"instance_id": params.get("instance_id", "")} if method == "get_storage_specs" else {}
        for key in ("trace_id", "auth"):
            if key in params:
                call[key] = params[key]
        return forward(method, call)

    return fetch


def _locations_in(locations: list[Any], uris: Translator) -> list[dict[str, Any]]:
    """``finishWriteCache.locations`` in kvcm's shape: each URI back in kvcm's form, refused
    (INVALID_ARGUMENT) unless it names a block file under its storage's directory."""
    out = []
    for i, raw in enumerate(locations):
        where = f"locations[{i}]"
        loc = s.message(raw, where, _LOCATION)
        specs = []
        for j, raw_spec in enumerate(s.messages(loc.get("location_specs"), f"{where}.location_specs")):
            at = f"{where}.location_specs[{j}]"
            spec = s.message(raw_spec, at, _SPEC)
            specs.append({"name": s.text(spec.get("name"), f"{at}.name"), "uri": uris.into(spec.get("uri"), f"{at}.uri")})
        out.append({"type": s.STORAGE_TYPE.to_kvcm(loc.get("type"), f"{where}.type") or "unspecified",
                    "spec_size": s.int32(loc.get("spec_size"), f"{where}.spec_size"), "location_specs": specs})
    return out


def _not_here(name: str, surface: str) -> KvcmError:
    if name in UNSUPPORTED:
        return ServerError(f"{name}: not supported by kvcm: {UNSUPPORTED[name]}", Code.UNSUPPORTED)
    if surface == "meta" and name in ADMIN:
        return ServerError(f"{name}: an AdminService RPC, served on the admin port (http.admin_port)", Code.UNSUPPORTED)
    if surface == "admin" and name in META:
        return ServerError(f"{name}: a MetaService RPC, served on the side port (http.port)", Code.UNSUPPORTED)
    return ServerError(f"{name}: no such Tair RPC", Code.UNSUPPORTED)
