"""Tair's request bodies as kvcm's params: one translator per Tair RPC (Tair JSON -> kvcm params).

Each takes the body as :func:`kvcm.proto.tair.message` read it (snake_case keys, header-less)
and returns the params of the one kvcm RPC it becomes; kvcm's own validation then checks them
strictly. :mod:`kvcm.tair.translate` pairs them with their kvcm method and reply translator.
"""

from __future__ import annotations

from kvcm.errors import InvalidArgument
from kvcm.proto import tair as s
from kvcm.proto.wire import DecodedMap, Encodable

#: A prompt's extra keys (docs/engines.md "Keys"): kvcm's fields, taken by Tair's routes with token_ids.
EXTRAS = ("extra_keys", "mm_features", "lora_name", "cache_salt")


def _keys(body: DecodedMap) -> dict[str, Encodable]:
    out: dict[str, Encodable] = {"instance_id": s.text(body.get("instance_id"), "instance_id")}
    if body.get("block_keys") is not None:
        out["block_keys"] = s.int64_list(body["block_keys"], "block_keys")
    if body.get("token_ids") is not None:
        out["token_ids"] = s.int64_list(body["token_ids"], "token_ids")
    for name in EXTRAS:  # kvcm's own fields (Tair has none for them), checked by kvcm's schema
        if body.get(name) is not None:
            out[name] = body[name]
    return out


def _mask(out: dict[str, Encodable], body: DecodedMap, field: str, kvcm_field: str | None = None) -> dict[str, Encodable]:
    mask = s.mask_in(body.get(field), field)
    if mask is not None:
        out[kvcm_field or field] = mask
    return out


def _query_type(out: dict[str, Encodable], body: DecodedMap) -> dict[str, Encodable]:
    kind = s.QUERY_TYPE.to_kvcm(body.get("query_type"), "query_type")
    if kind is None:
        raise InvalidArgument("query_type: required (kvcm keeps no per-instance default_query_type)")
    out["query_type"] = kind
    if body.get("sw_size") is not None:
        out["sw_size"] = s.int32(body["sw_size"], "sw_size")
    return out


def get_cache_location_in(body: DecodedMap) -> dict[str, Encodable]:
    out = _query_type(_mask(_keys(body), body, "block_mask"), body)
    if body.get("location_spec_names") is not None:
        out["location_spec_names"] = s.texts(body["location_spec_names"], "location_spec_names")
    return out


def get_cache_location_len_in(body: DecodedMap) -> dict[str, Encodable]:
    return _query_type(_keys(body), body)


def get_cache_meta_in(body: DecodedMap) -> dict[str, Encodable]:
    out = _mask(_keys(body), body, "block_mask")
    if body.get("detail_level") is not None:
        out["detail_level"] = s.int32(body["detail_level"], "detail_level")
    return out


def start_write_cache_in(body: DecodedMap) -> dict[str, Encodable]:
    out = _keys(body)
    if body.get("location_spec_group_names") is not None:
        out["location_spec_group_names"] = s.texts(body["location_spec_group_names"], "location_spec_group_names")
    if body.get("write_timeout_seconds") is not None:
        out["write_timeout_seconds"] = s.int32(body["write_timeout_seconds"], "write_timeout_seconds")
    if s.int32(body.get("min_replica_count"), "min_replica_count") > 1:
        raise InvalidArgument("min_replica_count: kvcm keeps one copy of a key; 0 or 1 only")
    return out


def finish_write_cache_in(body: DecodedMap) -> dict[str, Encodable]:
    out: dict[str, Encodable] = {"instance_id": s.text(body.get("instance_id"), "instance_id"),
                                 "write_session_id": s.text(body.get("write_session_id"), "write_session_id")}
    locations = s.messages(body.get("locations"), "locations")  # ignored by kvcm, as by Tair
    if locations:
        out["locations"] = locations  # checked and made kvcm's URIs by serve (they need the roots)
    return _mask(out, body, "success_blocks")


def remove_cache_in(body: DecodedMap) -> dict[str, Encodable]:
    return _mask(_keys(body), body, "block_mask")


#: Tair's TrimCacheRequest times are int32 wall-clock seconds (an int32 holds no finer unit of
#: today); kvcm's ``trim_cache`` reads microseconds.
MICROS_PER_SECOND = 1_000_000


def trim_cache_in(body: DecodedMap) -> dict[str, Encodable]:
    """Tair's trim: ``begin_timestamp`` / ``end_timestamp`` in seconds, as kvcm's microseconds."""
    out: dict[str, Encodable] = {"instance_id": s.text(body.get("instance_id"), "instance_id")}
    strategy = s.TRIM_STRATEGY.to_kvcm(body.get("strategy"), "strategy")
    if strategy is None:
        raise InvalidArgument("strategy: required (TS_REMOVE_ALL_CACHE, TS_REMOVE_ALL_META or TS_TIMESTAMP)")
    out["strategy"] = strategy
    for key in ("begin_timestamp", "end_timestamp"):
        if body.get(key) is not None:
            out[key] = s.int32(body[key], key) * MICROS_PER_SECOND
    return out


def register_instance_in(body: DecodedMap) -> dict[str, Encodable]:
    s.QUERY_TYPE.parse(body.get("default_query_type"), "default_query_type")  # accepted, not kept
    out: dict[str, Encodable] = {
        "instance_group": s.text(body.get("instance_group"), "instance_group"),
        "instance_id": s.text(body.get("instance_id"), "instance_id"),
        "block_size": s.int32(body.get("block_size"), "block_size"),
        "location_spec_infos": s.spec_infos_in(body.get("location_spec_infos"), "location_spec_infos"),
        "location_spec_groups": s.spec_groups_in(body.get("location_spec_groups"), "location_spec_groups"),
    }
    if body.get("model_deployment") is not None:
        out["model_deployment"] = s.deployment_in(body["model_deployment"], "model_deployment")
    return out


def instance_id_in(body: DecodedMap) -> dict[str, Encodable]:
    return {"instance_id": s.text(body.get("instance_id"), "instance_id")}


def remove_instance_in(body: DecodedMap) -> dict[str, Encodable]:
    return {**instance_id_in(body), "instance_group": s.text(body.get("instance_group"), "instance_group")}


def nothing_in(body: DecodedMap) -> dict[str, Encodable]:
    return {}


def storage_name_in(body: DecodedMap) -> dict[str, Encodable]:
    return {"storage_unique_name": s.text(body.get("storage_unique_name"), "storage_unique_name")}


def group_name_in(body: DecodedMap) -> dict[str, Encodable]:
    return {"name": s.text(body.get("name"), "name")}


def add_storage_in(body: DecodedMap) -> dict[str, Encodable]:
    return {"storage": s.storage_in(body.get("storage"), "storage")}


def update_storage_in(body: DecodedMap) -> dict[str, Encodable]:
    return {"storage": s.storage_in(body.get("storage"), "storage"),
            "force_update": s.boolean(body.get("force_update"), "force_update")}


def create_group_in(body: DecodedMap) -> dict[str, Encodable]:
    return {"instance_group": s.group_in(body.get("instance_group"), "instance_group")}


def update_group_in(body: DecodedMap) -> dict[str, Encodable]:
    group = s.group_in(body.get("instance_group"), "instance_group")
    version = s.int64(body.get("current_version"), "current_version") or \
        s.group_version(body.get("instance_group"), "instance_group")
    return {"instance_group": group, "current_version": version or None}  # none given: kvcm says required


def list_instances_in(body: DecodedMap) -> dict[str, Encodable]:
    return {"instance_group_name": s.text(body.get("instance_group_name"), "instance_group_name")}


def add_account_in(body: DecodedMap) -> dict[str, Encodable]:
    # Tair has no per-group tenancy: its accounts may use every group unless kvcm's ``groups`` says.
    groups = s.texts(body["groups"], "groups") if body.get("groups") is not None else ["*"]
    return {"user_name": s.text(body.get("user_name"), "user_name"),
            "password": s.text(body.get("password"), "password"),
            "role": s.ACCOUNT_ROLE.to_kvcm(body.get("role"), "role"), "groups": groups}


def user_name_in(body: DecodedMap) -> dict[str, Encodable]:
    return {"user_name": s.text(body.get("user_name"), "user_name")}


def load_snapshot_in(body: DecodedMap) -> dict[str, Encodable]:
    return {"config_snapshot": s.text(body.get("config_snapshot"), "config_snapshot")}


def reporter_source_id(instance_id: str, storage_type: str, host_ip_port: str) -> str:
    """The kvcm push source of a Tair reporter: Tair names one by instance, declared storage type
    and host, so two storage types of one host are two sources (of one pod, the host)."""
    return f"tair/{instance_id}/{s.REPORTER_STORAGE[storage_type]}/{host_ip_port}"


def host_cache_state_in(body: DecodedMap) -> dict[str, Encodable]:
    """Tair's GetHostCacheState as kvcm's ``get_host_cache_state``: prefix matching only (an
    unset query_type means it too: there is no other answer)."""
    kind = s.QUERY_TYPE.parse(body.get("query_type"), "query_type")
    if kind not in ("QT_UNSPECIFIED", "QT_PREFIX_MATCH"):
        raise InvalidArgument(f"query_type: {kind} is not answered; kvcm matches hosts by prefix (QT_PREFIX_MATCH)")
    out: dict[str, Encodable] = {"instance_id": s.text(body.get("instance_id"), "instance_id"),
                                 "query_type": "prefix_match",
                                 "block_cache_keys": s.int64_list(body.get("block_cache_keys"), "block_cache_keys")}
    medium = s.texts(body.get("medium"), "medium")
    if medium:
        out["medium"] = medium
    if body.get("p2p_host_count") is not None:
        out["p2p_host_count"] = s.int32(body["p2p_host_count"], "p2p_host_count")
    return out


def elector_in(body: DecodedMap) -> dict[str, Encodable]:
    return {"campaign_delay_time_ms": s.int64(body.get("campaign_delay_time_ms", 0), "campaign_delay_time_ms")}

