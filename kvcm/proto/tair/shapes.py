"""Tair's response messages, field by field: the one table every Tair reply is filled from.

Tair's gateway prints a response with protobuf's JSON printer, ``preserve_proto_field_names``
and ``always_print_fields_with_no_presence`` (its ``ProtoMessageJsonUtil`` and the fast codec
beside it): every field without presence is printed whatever its value (a string as ``""``, an
int32 as ``0``, an int64 or uint64 as ``"0"``, a bool as ``false``, an enum by the name of its
zero value, a repeated field as ``[]``), while a singular message field, or a oneof member, is
printed only when it was set. An error reply sets only its header, so it carries the header and
every field without presence at its default; a client reading ``response["storage_configs"]``
before checking the status gets ``""``, never a KeyError. The fields here are those of
meta_service.proto and admin_service.proto, in their declaration order (the printer's order).
"""

from __future__ import annotations

from collections.abc import Mapping

from kvcm.proto.wire import Encodable

#: A field's kind: ``string``, ``int32``, ``int64``, ``uint64``, ``bool``, ``double``,
#: ``repeated``, ``map``, ``enum:<the zero value's name>``, or ``message`` (printed when set).
Field = tuple[str, str]

#: MetaService's header carries ``tracer_result``; AdminService's does not.
HEADERS: dict[str, tuple[Field, ...]] = {
    "meta": (("status", "message"), ("request_id", "string"), ("tracer_result", "string")),
    "admin": (("status", "message"), ("request_id", "string")),
}
STATUS: tuple[Field, ...] = (("code", "enum:UNSPECIFIED"), ("message", "string"))

#: Response message -> its fields after ``header`` (field 1 of every response).
MESSAGES: dict[str, tuple[Field, ...]] = {
    "CommonResponse": (),
    # MetaService
    "RegisterInstanceResponse": (("storage_configs", "string"), ("extra_info", "string")),
    "meta.GetInstanceInfoResponse": (("instance_group", "string"), ("instance_info", "message")),
    "GetCacheLocationResponse": (("locations", "repeated"),),
    "GetCacheLocationLenResponse": (("cache_location_len", "int64"),),
    "GetCacheMetaResponse": (("locations", "repeated"), ("metas", "repeated")),
    "StartWriteCacheResponse": (("write_session_id", "string"), ("block_mask", "message"),
                                ("locations", "repeated")),
    "GetClusterInfoResponse": (("self_node_id", "string"), ("leader_node_id", "string"),
                               ("leader_endpoint", "message")),
    "ReportEventResponse": (("item_results", "repeated"), ("committed_snapshot_version", "string"),
                            ("retry_after_ms", "uint64"), ("snapshot_required", "bool"), ("extra_info", "string")),
    "GetHostCacheStateResponse": (("hosts", "repeated"),),
    "GetCacheLocationsByBackendResponse": (("key_locations", "repeated"),),
    # AdminService
    "ListStorageResponse": (("storage", "repeated"),),
    "GetInstanceGroupResponse": (("instance_group", "message"),),
    "ListInstanceGroupResponse": (("instance_group", "repeated"),),
    "admin.GetInstanceInfoResponse": (("instance_info", "message"),),
    "ListInstanceInfoResponse": (("instance_info", "repeated"),),
    "ListAccountResponse": (("accounts", "repeated"),),
    "ConfigSnapShotResponse": (("config_snapshot", "string"),),
    "GetMetricsResponse": (("timestamp", "int64"), ("metrics", "repeated"), ("extra_data", "string")),
    "CheckHealthResponse": (("is_leader", "bool"), ("is_health", "bool"), ("elector_last_loop_time_ms", "int64")),
    "GetManagerClusterInfoResponse": (("info_updated_time", "int64"), ("self_leader_expiration_time", "int64"),
                                      ("self_node_id", "string"), ("leader_node_id", "string"),
                                      ("leader_endpoint", "message")),
    "GetLeaderElectorConfigResponse": (("campaign_delay_time_ms", "int64"),),
    "MigrateCacheResponse": (("accepted", "int64"), ("rejected", "int64")),
    "ListAsyncCopyQuarantineResponse": (("records", "repeated"),),
    # nested messages kvcm fills (the others are built whole by their translators)
    "InstanceInfo": (("quota_group_name", "string"), ("instance_group_name", "string"), ("instance_id", "string"),
                     ("block_size", "int32"), ("location_spec_infos", "repeated"), ("model_deployment", "message"),
                     ("location_spec_groups", "repeated"), ("default_query_type", "enum:QT_UNSPECIFIED")),
    "ModelDeployment": (("model_name", "string"), ("dtype", "string"), ("use_mla", "bool"), ("tp_size", "int32"),
                        ("dp_size", "int32"), ("lora_name", "string"), ("pp_size", "int32"), ("extra", "string"),
                        ("user_data", "string"), ("use_eagle_pop", "bool")),
    "InstanceGroup": (("name", "string"), ("storage_candidates", "repeated"), ("global_quota_group_name", "string"),
                      ("max_instance_count", "int64"), ("quota", "message"), ("cache_config", "message"),
                      ("user_data", "string"), ("version", "int64"), ("extra_info", "string"),
                      ("event_report_storage_candidates", "repeated"), ("revisit_interval_buckets", "string")),
    "InstanceGroupQuota": (("capacity", "int64"), ("quota_config", "repeated")),
    "CacheConfig": (("reclaim_strategy", "message"), ("data_storage_strategy", "enum:CPS_UNSPECIFIED"),
                    ("meta_indexer_config", "message"), ("migration_config", "message")),
    "CacheReclaimStrategy": (("storage_unique_name", "string"), ("reclaim_policy", "enum:POLICY_UNSPECIFIED"),
                             ("trigger_strategy", "message"), ("trigger_period_seconds", "int32"),
                             ("reclaim_step_size", "int32"), ("reclaim_step_percentage", "int32"),
                             ("delay_before_delete_ms", "int32")),
    "TriggerStrategy": (("used_size", "int64"), ("used_percentage", "double")),
    "MetaIndexerConfig": (("max_key_count", "int64"), ("mutex_shard_num", "int64"), ("batch_key_size", "int64"),
                          ("meta_storage_backend_config", "message"), ("meta_cache_policy_config", "message"),
                          ("persist_metadata_interval_time_ms", "message")),
    "NfsStorageSpec": (("root_path", "string"), ("key_count_per_file", "int32")),
    "ThreeFSStorageSpec": (("cluster_name", "string"), ("mountpoint", "string"), ("root_dir", "string"),
                           ("key_count_per_file", "int32"), ("touch_file_when_create", "bool")),
    "MooncakeStorageSpec": (("local_hostname", "string"), ("metadata_connstring", "string"), ("protocol", "string"),
                            ("rdma_device", "string"), ("master_service_entry", "string")),
    "TairMemPoolStorageSpec": (("domain", "string"), ("timeout", "int32"), ("service_discovery_url", "string"),
                               ("media_type", "int32")),
    "MetaNodeEndpoint": (("node_id", "string"), ("host", "string"), ("meta_rpc_port", "int32"),
                         ("meta_http_port", "int32"), ("custom_info", "string")),
    "NodeEndpoint": (("node_id", "string"), ("host", "string"), ("meta_rpc_port", "int32"),
                     ("meta_http_port", "int32"), ("admin_rpc_port", "int32"), ("admin_http_port", "int32"),
                     ("custom_info", "string")),
}

#: Tair RPC -> its response message, per service (the four names both have differ in shape).
META_REPLIES: dict[str, str] = {
    "registerInstance": "RegisterInstanceResponse", "getInstanceInfo": "meta.GetInstanceInfoResponse",
    "getCacheLocation": "GetCacheLocationResponse", "getCacheLocationLen": "GetCacheLocationLenResponse",
    "getCacheMeta": "GetCacheMetaResponse", "startWriteCache": "StartWriteCacheResponse",
    "finishWriteCache": "CommonResponse", "removeCache": "CommonResponse", "trimCache": "CommonResponse",
    "getClusterInfo": "GetClusterInfoResponse", "reportEvent": "ReportEventResponse",
    "getHostCacheState": "GetHostCacheStateResponse",
    "getCacheLocationsByBackend": "GetCacheLocationsByBackendResponse",
}
ADMIN_REPLIES: dict[str, str] = {
    **{name: "CommonResponse" for name in (
        "addStorage", "enableStorage", "disableStorage", "removeStorage", "updateStorage", "createInstanceGroup",
        "updateInstanceGroup", "removeInstanceGroup", "removeCache", "registerInstance", "removeInstance",
        "addAccount", "deleteAccount", "loadConfigSnapshot", "leaderDemote", "updateLeaderElectorConfig",
        "updateLogger", "breakGlassReleaseAsyncCopy")},
    "listStorage": "ListStorageResponse", "getInstanceGroup": "GetInstanceGroupResponse",
    "listInstanceGroup": "ListInstanceGroupResponse", "getCacheMeta": "GetCacheMetaResponse",
    "getInstanceInfo": "admin.GetInstanceInfoResponse", "listInstanceInfo": "ListInstanceInfoResponse",
    "listAccount": "ListAccountResponse", "genConfigSnapshot": "ConfigSnapShotResponse",
    "getMetrics": "GetMetricsResponse", "checkHealth": "CheckHealthResponse",
    "getManagerClusterInfo": "GetManagerClusterInfoResponse",
    "getLeaderElectorConfig": "GetLeaderElectorConfigResponse", "migrateCache": "MigrateCacheResponse",
    "listAsyncCopyQuarantine": "ListAsyncCopyQuarantineResponse",
}
REPLIES: dict[str, dict[str, str]] = {"meta": META_REPLIES, "admin": ADMIN_REPLIES}


def default(kind: str) -> Encodable:
    """The value Tair's printer shows for a field without presence left at its default."""
    if kind.startswith("enum:"):
        return kind[5:]
    defaults: dict[str, Encodable] = {"string": "", "int32": 0, "int64": "0", "uint64": "0", "bool": False,
                                      "double": 0, "repeated": [], "map": {}}
    if kind not in defaults:
        raise ValueError(f"a {kind} field has presence: it has no default to print")
    return defaults[kind]


def printed(message: str) -> frozenset[str]:
    """The fields Tair prints for ``message`` whatever is set (its fields without presence)."""
    return frozenset(name for name, kind in MESSAGES[message] if kind != "message")


def fill(message: str, given: Mapping[str, Encodable]) -> dict[str, Encodable]:
    """``message`` as Tair prints it: the fields given, every other field without presence at its
    default, in declaration order. A field given that the message lacks is kvcm's own fault (a
    translator printing what Tair never sends): a TypeError, answered as an internal error."""
    fields = MESSAGES[message]
    unknown = set(given) - {name for name, _ in fields}
    if unknown:
        raise TypeError(f"{message} has no field {', '.join(sorted(unknown))}")
    out: dict[str, Encodable] = {}
    for name, kind in fields:
        if name in given:
            out[name] = given[name]
        elif kind != "message":
            out[name] = default(kind)
    return out


def header(service: str, code: str, message: str, request_id: str) -> dict[str, Encodable]:
    """The response header of ``service`` (``meta`` or ``admin``), every field printed."""
    out: dict[str, Encodable] = {"status": {"code": code, "message": message}, "request_id": request_id}
    if "tracer_result" in dict(HEADERS[service]):
        out["tracer_result"] = ""
    return out


def reply(service: str, rpc: str, header_fields: dict[str, Encodable],
          fields: Mapping[str, Encodable]) -> dict[str, Encodable]:
    """A whole reply of ``rpc`` on ``service``: its header, then its message's fields filled. A
    name with no response message here (not a Tair RPC) gets the header alone."""
    message = REPLIES[service].get(rpc)
    if message is None:
        return {"header": header_fields}
    return {"header": header_fields, **fill(message, fields)}
