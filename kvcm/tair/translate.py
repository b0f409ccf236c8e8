"""Tair KVCM's RPCs on kvcm: one request and one reply translator per RPC, in two tables.

A Tair call is translated to exactly one kvcm RPC (Tair JSON -> kvcm params), forwarded as any
``/api`` call is (so kvcm's validation, auth and group commit apply to the translated request),
and its reply translated back (kvcm result -> Tair JSON). Nothing here implements an RPC.

Every reply has Tair's header, ``{"status": {"code", "message"}, "request_id"}``; a kvcm error
becomes the Tair code of :data:`TAIR_CODES` with kvcm's precise name in front of the message.
``META`` holds MetaService, ``ADMIN`` AdminService (which shares four names with different reply
shapes); :data:`UNSUPPORTED` are Tair RPCs kvcm has no equivalent for. The translators
themselves are :mod:`kvcm.tair.requests` (Tair JSON -> kvcm params) and :mod:`kvcm.tair.replies`
(kvcm result -> Tair JSON).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvcm.errors import Code, InvalidArgument, KvcmError, ServerError
from kvcm.proto import tair as s
from kvcm.proto.tair import shapes
from kvcm.proto.wire import Decoded, DecodedMap, Encodable
from kvcm.tair import events as ev
from kvcm.tair import replies as rep
from kvcm.tair import requests as req
from kvcm.tair.replies import Context as Context  # re-exported: the listener makes one per call
from kvcm.tair.replies import leader_endpoint as leader_endpoint  # re-exported
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
    # another manager answers (Tair's clients try their other managers on it; kvcm's name the shard)
    Code.WRONG_SHARD: "SERVER_NOT_LEADER",
}


@dataclass(frozen=True)
class Rpc:
    kvcm: str  # the kvcm method
    request: Callable[[DecodedMap], dict[str, Encodable]]  # Tair body (header-less) -> kvcm params
    reply: Callable[[Decoded, Context], dict[str, Encodable]]  # kvcm result -> Tair reply fields
    codes: Mapping[Code, str] = field(default_factory=dict)  # this RPC's own Tair codes, over TAIR_CODES
    # a call that takes several kvcm calls (reportEvent's items): (forward, translated params) -> result
    run: Callable[[Forward, dict[str, Encodable]], Decoded] | None = None


#: ``(kvcm method, params) -> result``: the call, forwarded as any ``/api`` call is.
Forward = Callable[[str, dict[str, Encodable]], Decoded]


def _body(fields: str) -> frozenset[str]:
    return frozenset({"trace_id", *fields.split()})


# -- the tables -----------------------------------------------------------------------------------

_KEYS = "instance_id block_keys token_ids " + " ".join(req.EXTRAS)

#: Tair name -> (fields of its request message, the translator).
META: dict[str, tuple[frozenset[str], Rpc]] = {
    "registerInstance": (_body("instance_group instance_id block_size location_spec_infos model_deployment "
                               "location_spec_groups default_query_type"),
                         Rpc("register_instance", req.register_instance_in, rep.registered)),
    "getInstanceInfo": (_body("instance_id"), Rpc("get_instance_info", req.instance_id_in, rep.instance_meta)),
    "getCacheLocation": (_body(f"{_KEYS} query_type block_mask sw_size location_spec_names"),
                         Rpc("get_cache_location", req.get_cache_location_in, rep.locations)),
    "getCacheLocationLen": (_body(f"{_KEYS} query_type sw_size"),
                            Rpc("get_cache_location_len", req.get_cache_location_len_in, rep.location_len)),
    "getCacheMeta": (_body(f"{_KEYS} block_mask detail_level"), Rpc("get_cache_meta", req.get_cache_meta_in, rep.meta)),
    "startWriteCache": (_body(f"{_KEYS} location_spec_group_names write_timeout_seconds min_replica_count"),
                        Rpc("start_write_cache", req.start_write_cache_in, rep.write_started)),
    "finishWriteCache": (_body("instance_id write_session_id success_blocks locations"),
                         Rpc("finish_write_cache", req.finish_write_cache_in, rep.empty)),
    "removeCache": (_body(f"{_KEYS} block_mask"), Rpc("remove_cache", req.remove_cache_in, rep.empty)),
    "trimCache": (_body("instance_id strategy begin_timestamp end_timestamp"),
                  Rpc("trim_cache", req.trim_cache_in, rep.empty)),
    "getClusterInfo": (_body("instance_id"), Rpc("get_manager_cluster_info", req.nothing_in, rep.cluster)),
    # a source that is not registered (or another tenant's) is Tair's NODE_NOT_REGISTERED
    "reportEvent": (_body("instance_id host_ip_port events storage_type"),
                    Rpc("report_events", ev.report_event_in, rep.reported, {Code.NOT_FOUND: "NODE_NOT_REGISTERED"},
                        ev.run)),
    "getHostCacheState": (_body("instance_id query_type block_cache_keys medium p2p_host_count"),
                          Rpc("get_host_cache_state", req.host_cache_state_in, rep.host_state)),
}

ADMIN: dict[str, tuple[frozenset[str], Rpc]] = {
    "addStorage": (_body("storage"), Rpc("add_storage", req.add_storage_in, rep.empty)),
    "enableStorage": (_body("storage_unique_name"), Rpc("enable_storage", req.storage_name_in, rep.empty)),
    "disableStorage": (_body("storage_unique_name"), Rpc("disable_storage", req.storage_name_in, rep.empty)),
    "removeStorage": (_body("storage_unique_name"), Rpc("remove_storage", req.storage_name_in, rep.empty)),
    "updateStorage": (_body("storage force_update"), Rpc("update_storage", req.update_storage_in, rep.empty)),
    "listStorage": (_body(""), Rpc("list_storage", req.nothing_in, rep.storages)),
    "createInstanceGroup": (_body("instance_group"), Rpc("create_instance_group", req.create_group_in, rep.empty)),
    "updateInstanceGroup": (_body("instance_group current_version"),
                            Rpc("update_instance_group", req.update_group_in, rep.empty)),
    "removeInstanceGroup": (_body("name"), Rpc("remove_instance_group", req.group_name_in, rep.empty)),
    "getInstanceGroup": (_body("name"), Rpc("get_instance_group", req.group_name_in, rep.group)),
    "listInstanceGroup": (_body(""), Rpc("list_instance_groups", req.nothing_in, rep.groups)),
    "getCacheMeta": META["getCacheMeta"],
    "removeCache": META["removeCache"],
    "registerInstance": (META["registerInstance"][0], Rpc("register_instance", req.register_instance_in, rep.empty)),
    "removeInstance": (_body("instance_group instance_id"), Rpc("remove_instance", req.remove_instance_in, rep.empty)),
    "getInstanceInfo": (_body("instance_id"), Rpc("get_instance_info", req.instance_id_in, rep.instance_admin)),
    "listInstanceInfo": (_body("instance_group_name"), Rpc("list_instance_info", req.list_instances_in, rep.instances)),
    "addAccount": (_body("user_name password role groups"), Rpc("add_account", req.add_account_in, rep.empty)),
    "deleteAccount": (_body("user_name"), Rpc("delete_account", req.user_name_in, rep.empty)),
    "listAccount": (_body(""), Rpc("list_account", req.nothing_in, rep.accounts)),
    "genConfigSnapshot": (_body(""), Rpc("gen_config_snapshot", req.nothing_in, rep.snapshot)),
    "loadConfigSnapshot": (_body("config_snapshot"), Rpc("load_config_snapshot", req.load_snapshot_in, rep.empty)),
    "getMetrics": (_body(""), Rpc("get_metrics", req.nothing_in, rep.metrics)),
    "checkHealth": (_body(""), Rpc("check_health", req.nothing_in, rep.health)),
    "getManagerClusterInfo": (_body(""), Rpc("get_manager_cluster_info", req.nothing_in, rep.manager_cluster)),
    "leaderDemote": (_body(""), Rpc("leader_demote", req.nothing_in, rep.empty)),
    "getLeaderElectorConfig": (_body(""), Rpc("get_leader_elector_config", req.nothing_in, rep.elector)),
    "updateLeaderElectorConfig": (_body("campaign_delay_time_ms"),
                                  Rpc("update_leader_elector_config", req.elector_in, rep.empty)),
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


def header(code: str, message: str, trace_id: str, service: str = "admin") -> dict[str, Encodable]:
    """A Tair response header, every field printed (MetaService's has ``tracer_result`` too)."""
    return shapes.header(service, code, message, f"{trace_id}_{int(time.time() * 1e6)}")


def failure(exc: KvcmError, trace_id: str, codes: Mapping[Code, str] | None = None, rpc: str = "",
            service: str = "admin") -> dict[str, Encodable]:
    """The reply of a failed call: its header, and the fields of ``rpc``'s response message (if it
    is a Tair RPC of ``service``) at their defaults, as Tair prints an error."""
    code = (codes or {}).get(exc.code) or TAIR_CODES.get(exc.code, "INTERNAL_ERROR")
    message = exc.message if code == exc.code.name else f"{exc.code.name}: {exc.message}"
    return shapes.reply(service, rpc, header(code, message, trace_id, service), {})


def refused(exc: KvcmError, body: Mapping[str, object]) -> dict[str, Encodable]:
    """The Tair reply to a call the HTTP side refused before translating it (no credentials)."""
    trace_id = body.get("trace_id")
    return failure(exc, trace_id if isinstance(trace_id, str) else "")


def _service(name: str, surface: str) -> str:
    """The service whose response message a call on this listener answers with."""
    for table in SURFACES[surface]:
        if name in table:
            return "meta" if table is META else "admin"
    return "meta" if name in shapes.META_REPLIES and surface != "admin" else "admin"


def serve(name: str, body: DecodedMap, surface: str, ctx: Context,
          forward: Forward) -> tuple[int, dict[str, Encodable]]:
    """(HTTP status, Tair reply) of one call; logical errors are 200 with their Tair code. Every
    reply, success or error, carries its response message's fields (:mod:`kvcm.proto.tair.shapes`)."""
    trace_id = body.get("trace_id")
    trace_id = trace_id if isinstance(trace_id, str) else ""
    service = _service(name, surface)
    entry = next((table[name] for table in SURFACES[surface] if name in table), None)
    if entry is None:  # an RPC kvcm lacks is a logical answer; a name not served here is a 404
        return (200 if name in UNSUPPORTED else 404), failure(_not_here(name, surface), trace_id, rpc=name,
                                                              service=service)
    fields, rpc = entry
    try:
        reply = _call(rpc, fields, body, trace_id, ctx, forward)
        return 200, shapes.reply(service, name, header("OK", "", trace_id, service), reply)
    except InvalidArgument as exc:
        if exc.code is Code.INVALID_ARGUMENT and not exc.message.startswith(rpc.kvcm + ":"):
            exc = InvalidArgument(f"{name}: {exc.message}")  # a translator's own check names the Tair RPC
        return 200, failure(exc, trace_id, rpc.codes, name, service)
    except KvcmError as exc:
        return 200, failure(exc, trace_id, rpc.codes, name, service)
    except Exception as exc:  # every call gets a Tair answer, whatever failed
        log.exception("tair: %s failed", name)
        return 200, failure(ServerError(f"internal error: {type(exc).__name__}"), trace_id, rpc=name,
                            service=service)


def _call(rpc: Rpc, fields: frozenset[str], body: DecodedMap, trace_id: str, ctx: Context,
          forward: Forward) -> dict[str, Encodable]:
    """Translate the call, forward it, translate its result: the reply's fields."""
    s.text(body.get("trace_id"), "trace_id")
    auth = body.get("auth")
    request = s.message({k: v for k, v in body.items() if k != "auth"}, "", fields)
    params = rpc.request(request)
    if trace_id:
        params["trace_id"] = trace_id
    if auth is not None:
        params["auth"] = auth
    uris = ctx.roots.of(auth).translator(_fetcher(forward, params))
    if "locations" in params:  # finishWriteCache's, checked by its translator: kvcm's URIs now
        params["locations"] = _locations_in(s.messages(request.get("locations"), "locations"), uris)
    result = forward(rpc.kvcm, params) if rpc.run is None else rpc.run(forward, params)
    if rpc.kvcm in _STORAGE_CHANGES:
        ctx.roots.clear()
    ctx.uris = uris
    return rpc.reply(result, ctx)


#: kvcm RPCs after which the cached storage directories may be wrong.
_STORAGE_CHANGES = frozenset({"add_storage", "update_storage", "remove_storage", "load_config_snapshot"})
_LOCATION = frozenset({"type", "spec_size", "location_specs"})
_SPEC = frozenset({"name", "uri"})


def _fetcher(forward: Forward, params: Mapping[str, Encodable]) -> Fetch:
    """The storages' specs, asked with the call's own instance and credentials."""

    def fetch(method: str) -> Decoded:
        call: dict[str, Encodable] = \
            {"instance_id": params.get("instance_id", "")} if method == "get_storage_specs" else {}
        for key in ("trace_id", "auth"):
            if key in params:
                call[key] = params[key]
        return forward(method, call)

    return fetch


def _locations_in(locations: list[Decoded], uris: Translator) -> list[dict[str, Encodable]]:
    """``finishWriteCache.locations`` in kvcm's shape: each URI back in kvcm's form, refused
    (INVALID_ARGUMENT) unless it names a block file under its storage's directory."""
    out: list[dict[str, Encodable]] = []
    for i, raw in enumerate(locations):
        where = f"locations[{i}]"
        loc = s.message(raw, where, _LOCATION)
        specs: list[Encodable] = []
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
