"""Tair's InstanceGroup (quota, cache config, reclaim strategy) as kvcm's, and back."""

from __future__ import annotations

from kvcm.errors import InvalidArgument
from kvcm.proto.tair.enums import CACHE_PREFER_STRATEGY, RECLAIM_POLICY, STORAGE_TYPE
from kvcm.proto.tair.fields import (
    as_list,
    as_map,
    as_maps,
    double,
    int32,
    int64,
    message,
    messages,
    out64,
    path,
    text,
    texts,
)
from kvcm.proto.tair.shapes import fill
from kvcm.proto.wire import Decoded, DecodedMap, Encodable

_GROUP = frozenset({"name", "storage_candidates", "global_quota_group_name", "max_instance_count", "quota",
                    "cache_config", "user_data", "version", "extra_info", "event_report_storage_candidates",
                    "revisit_interval_buckets"})
_QUOTA = frozenset({"capacity", "quota_config"})
_QUOTA_CONFIG = frozenset({"storage_type", "capacity"})
_CACHE_CONFIG = frozenset({"reclaim_strategy", "data_storage_strategy", "cache_prefer_strategy",
                           "meta_indexer_config", "migration_config"})
_RECLAIM = frozenset({"storage_unique_name", "reclaim_policy", "trigger_strategy", "trigger_period_seconds",
                      "reclaim_step_size", "reclaim_step_percentage", "delay_before_delete_ms", "ttl_seconds"})
_TRIGGER = frozenset({"used_size", "used_percentage"})


def group_in(value: Decoded, where: str) -> dict[str, Encodable]:
    """A Tair InstanceGroup as kvcm's, with only the fields given (an update merges them).
    ``version`` is left out: it is the compare-and-set input of an update, not a field to set."""
    group = message(value, where, _GROUP)
    out: dict[str, Encodable] = {}
    for key in ("name", "global_quota_group_name", "user_data"):
        if key in group:
            out[key] = text(group[key], path(where, key))
    if "storage_candidates" in group:
        out["storage_candidates"] = texts(group["storage_candidates"], path(where, "storage_candidates"))
    if "max_instance_count" in group:
        out["max_instance_count"] = int64(group["max_instance_count"], path(where, "max_instance_count"))
    if group.get("quota") is not None:
        out["quota"] = _quota_in(group["quota"], path(where, "quota"))
    cache = message(group.get("cache_config"), path(where, "cache_config"), _CACHE_CONFIG)
    if cache.get("reclaim_strategy") is not None:
        out["reclaim_strategy"] = _reclaim_in(cache["reclaim_strategy"], path(where, "cache_config.reclaim_strategy"))
    indexer, at = cache.get("meta_indexer_config"), path(where, "cache_config.meta_indexer_config")
    if indexer is not None and not isinstance(indexer, dict):
        raise InvalidArgument(f"{at}: expected an object")
    if indexer is not None:  # the indexer's other settings (backend, shards, cache) are Tair's own
        out["max_block_count"] = int64(indexer.get("max_key_count"), path(at, "max_key_count"))
    _check_unused(group, cache, where)
    return out


def _check_unused(group: DecodedMap, cache: DecodedMap, where: str) -> None:
    """Tair-only settings, checked for their type and not used (docs/tair.md)."""
    for key in ("data_storage_strategy", "cache_prefer_strategy"):
        CACHE_PREFER_STRATEGY.parse(cache.get(key), path(where, f"cache_config.{key}"))
    for key in ("extra_info", "revisit_interval_buckets"):
        text(group.get(key), path(where, key))
    texts(group.get("event_report_storage_candidates"), path(where, "event_report_storage_candidates"))


def group_version(value: Decoded, where: str) -> int:
    return int64(message(value, where, _GROUP).get("version"), path(where, "version"))


def _quota_in(value: Decoded, where: str) -> dict[str, Encodable]:
    quota = message(value, where, _QUOTA)
    items: list[dict[str, Encodable]] = []
    for i, raw in enumerate(messages(quota.get("quota_config"), path(where, "quota_config"))):
        at = f"{where}.quota_config[{i}]"
        item = message(raw, at, _QUOTA_CONFIG)
        kind = STORAGE_TYPE.to_kvcm(item.get("storage_type"), path(at, "storage_type"))
        if kind is None:
            raise InvalidArgument(f"{at}.storage_type: required")
        items.append({"storage_type": kind, "capacity": int64(item.get("capacity"), path(at, "capacity"))})
    return {"capacity": int64(quota.get("capacity"), path(where, "capacity")), "quota_config": items}


def _reclaim_in(value: Decoded, where: str) -> dict[str, Encodable]:
    """Tair's reclaim strategy: the policy, the watermark (``trigger_strategy.used_percentage``)
    (and ``used_size``, kvcm's ``used_bytes``) and the delete delay map to kvcm's; the schedule
    knobs (period, step) are the server's in kvcm and accepted unused."""
    reclaim = message(value, where, _RECLAIM)
    out: dict[str, Encodable] = {}
    policy = RECLAIM_POLICY.to_kvcm(reclaim.get("reclaim_policy"), path(where, "reclaim_policy"))
    if policy is not None:
        out["reclaim_policy"] = policy
    trigger = message(reclaim.get("trigger_strategy"), path(where, "trigger_strategy"), _TRIGGER)
    if "used_size" in trigger:
        out["used_bytes"] = int64(trigger["used_size"], path(where, "trigger_strategy.used_size"))
    percentage = double(trigger.get("used_percentage"), path(where, "trigger_strategy.used_percentage"))
    if percentage:
        out["used_percentage"] = percentage
    for key in ("delay_before_delete_ms", "ttl_seconds"):
        if key in reclaim:
            out[key] = int64(reclaim[key], path(where, key))
    text(reclaim.get("storage_unique_name"), path(where, "storage_unique_name"))
    for key in ("trigger_period_seconds", "reclaim_step_size", "reclaim_step_percentage"):
        int32(reclaim.get(key), path(where, key))
    return out


def group_out(group: DecodedMap) -> dict[str, Encodable]:
    """A kvcm instance group as Tair's InstanceGroup, every field printed (those kvcm does not keep
    at their defaults; ``migration_config``, a message kvcm never sets, left out as Tair's
    printer leaves out a message nobody set)."""
    quota = as_map(group.get("quota") or {})
    quota_configs: list[Encodable] = [
        {"storage_type": STORAGE_TYPE.out(q["storage_type"]), "capacity": out64(q["capacity"])}
        for q in as_maps(quota.get("quota_config") or [])]
    cache = fill("CacheConfig", {
        "reclaim_strategy": _strategy_out(as_map(group.get("reclaim_strategy") or {})),
        "meta_indexer_config": fill("MetaIndexerConfig", {"max_key_count": out64(group.get("max_block_count"))})})
    return fill("InstanceGroup", {
        "name": group["name"],
        "storage_candidates": list(as_list(group.get("storage_candidates") or [])),
        "global_quota_group_name": group.get("global_quota_group_name", ""),
        "max_instance_count": out64(group.get("max_instance_count")),
        "quota": fill("InstanceGroupQuota", {"capacity": out64(quota.get("capacity")), "quota_config": quota_configs}),
        "cache_config": cache,
        "user_data": group.get("user_data", ""),
        "version": out64(group.get("version")),
    })


def _strategy_out(reclaim: DecodedMap) -> dict[str, Encodable]:
    strategy = fill("CacheReclaimStrategy", {
        "reclaim_policy": RECLAIM_POLICY.out(reclaim.get("reclaim_policy", "")),
        "trigger_strategy": fill("TriggerStrategy", {"used_size": out64(reclaim.get("used_bytes")),
                                                     "used_percentage": reclaim.get("used_percentage", 0.0)}),
        "delay_before_delete_ms": reclaim.get("delay_before_delete_ms", 0),
    })
    if reclaim.get("ttl_seconds"):
        strategy["ttl_seconds"] = reclaim["ttl_seconds"]  # kvcm's extension: the TTL policy's age
    return strategy
