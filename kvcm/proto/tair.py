"""Tair KVCM's proto3-JSON shapes, both ways: scalars, enums, masks, locations, storages, groups.

Input follows proto3 JSON as Tair's server parses it: int64 (and int32) as a number or a decimal
string, enums by name or by number, ``null`` as unset, field names as the protos spell them (the
lowerCamel JSON names are accepted too). Output follows Tair's printer with
``preserve_proto_field_names``: int64 as decimal strings (a JSON number above 2^53 loses digits in
JavaScript and in many JSON libraries), enums by name. Every error is INVALID_ARGUMENT naming the
field path, as kvcm's own validation does.

This module knows Tair's side only; what each Tair value means in kvcm (``ST_NFS`` is ``file``,
``POLICY_LRU`` is ``lru``) is in the enum tables here, and the shapes of kvcm's side are those
of its own RPCs (docs/rpc.md), which then validate the translated request strictly.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from kvcm.errors import InvalidArgument

_INT64 = range(-(1 << 63), 1 << 63)
_INT32 = range(-(1 << 31), 1 << 31)
_DECIMAL = re.compile(r"-?[0-9]{1,20}")
_CAMEL = re.compile(r"(?<=[a-z0-9])([A-Z])")


def path(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


# -- scalars --------------------------------------------------------------------------------------


def _integer(value: Any, where: str, bounds: range, kind: str) -> int:
    if value is None:
        return 0
    if isinstance(value, str) and _DECIMAL.fullmatch(value):
        value = int(value)
    if type(value) is float and value.is_integer():  # proto3 JSON allows 1.0 for an integer
        value = int(value)
    if type(value) is not int:
        raise InvalidArgument(f"{where}: expected {kind} (a number or a decimal string), got {_show(value)}")
    if value not in bounds:
        raise InvalidArgument(f"{where}: {value} does not fit in {kind}")
    return value


def int64(value: Any, where: str) -> int:
    return _integer(value, where, _INT64, "int64")


def int32(value: Any, where: str) -> int:
    return _integer(value, where, _INT32, "int32")


def int64_list(value: Any, where: str) -> list[int]:
    """A repeated int64. Lists of plain numbers (what clients send) are returned as they are:
    kvcm's own schema checks their range."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidArgument(f"{where}: expected a list of int64, got {_show(value)}")
    if all(type(v) is int for v in value):
        return value
    return [int64(_element(v, f"{where}[{i}]"), f"{where}[{i}]") for i, v in enumerate(value)]


def _element(value: Any, where: str) -> Any:
    """An element of a repeated field: ``null`` there is no unset value, and never 0 or ""."""
    if value is None:
        raise InvalidArgument(f"{where}: null in a list (a repeated field has no unset elements)")
    return value


def text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidArgument(f"{where}: expected a string, got {_show(value)}")
    return value


def texts(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidArgument(f"{where}: expected a list of strings, got {_show(value)}")
    return [text(_element(v, f"{where}[{i}]"), f"{where}[{i}]") for i, v in enumerate(value)]


def boolean(value: Any, where: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidArgument(f"{where}: expected true or false, got {_show(value)}")
    return value


def double(value: Any, where: str) -> float:
    if value is None:
        return 0.0
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{where}: expected a number, got {_show(value)}")
    if isinstance(value, float) and not math.isfinite(value):  # "NaN", "inf": float() takes them
        raise InvalidArgument(f"{where}: {value} is not a finite number")
    return float(value)


def out64(value: Any) -> str:
    """An int64 as Tair prints it: a decimal string."""
    return str(int(value or 0))


def _show(value: Any) -> str:
    return json.dumps(value, default=str)[:60]


# -- messages -------------------------------------------------------------------------------------


def message(value: Any, where: str, names: frozenset[str]) -> dict[str, Any]:
    """A message: an object whose keys are fields of the proto (lowerCamel JSON names too).
    Returns it with snake_case keys; an unknown key is INVALID_ARGUMENT naming its path."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where or 'body'}: expected an object, got {_show(value)}")
    if value.keys() <= names:  # the usual case: nothing to rename
        return value
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = key if key in names else _CAMEL.sub(r"_\1", key).lower()
        if name not in names:
            raise unknown(where, key, names)
        if name in out:
            raise InvalidArgument(f"{path(where, name)}: given twice (as {name} and as its JSON name)")
        out[name] = item
    return out


def unknown(where: str, key: str, names: Iterable[str]) -> InvalidArgument:
    close = difflib.get_close_matches(key, list(names), n=1)
    hint = f" (did you mean {path(where, close[0])}?)" if close else ""
    return InvalidArgument(f"unknown field {path(where, key[:100])}{hint}")


def messages(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidArgument(f"{where}: expected a list, got {_show(value)}")
    for i, item in enumerate(value):
        _element(item, f"{where}[{i}]")
    return value


# -- enums ----------------------------------------------------------------------------------------


class Enum:
    """One Tair enum: names, numbers, and the kvcm value of each (None: no kvcm equivalent).
    ``out`` picks the Tair name for a kvcm value where several Tair names share it."""

    def __init__(self, name: str, values: Mapping[str, tuple[int, str | None]],
                 out: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.values = dict(values)
        self.by_number = {number: key for key, (number, _) in values.items()}
        self.to_kvcm_value = {key: kvcm for key, (_, kvcm) in values.items()}
        self.from_kvcm_value = {kvcm: key for key, (_, kvcm) in reversed(list(values.items())) if kvcm is not None}
        self.from_kvcm_value.update(out or {})

    def parse(self, value: Any, where: str) -> str:
        """The Tair name of an input value (a name or a number); null is the zero value."""
        if value is None:
            return self.by_number[0]
        if type(value) is int and value in self.by_number:
            return self.by_number[value]
        if isinstance(value, str) and value in self.values:
            return value
        raise InvalidArgument(f"{where}: {_show(value)} is not a {self.name} (one of {', '.join(self.values)})")

    def to_kvcm(self, value: Any, where: str) -> str | None:
        """The kvcm value of an input value; None for the zero value (unset)."""
        name = self.parse(value, where)
        kvcm = self.to_kvcm_value[name]
        if kvcm is None and self.values[name][0] != 0:
            raise InvalidArgument(f"{where}: {name} is not supported by kvcm (docs/tair.md)")
        return kvcm

    def out(self, kvcm: str) -> str:
        return self.from_kvcm_value.get(kvcm, self.by_number[0])


#: kvcm-only values get numbers from 101 up, clear of Tair's, and a KVCM in their name.
STORAGE_TYPE = Enum("StorageType", {
    "ST_UNSPECIFIED": (0, None), "ST_3FS": (1, "3fs"), "ST_MOONCAKE": (2, "mooncake"),
    "ST_TAIRMEMPOOL": (3, "tairmempool"), "ST_NFS": (4, "file"), "ST_VCNS_3FS": (5, "3fs"),
    "ST_DUMMY": (6, None), "ST_EVENT_REPORT_L1P5": (7, None), "ST_EVENT_REPORT_L2": (8, None),
    "ST_TAIRMEMPOOL_SSD": (9, "tairmempool"), "ST_KVCM_SHM": (101, "shm"),
}, out={"3fs": "ST_3FS", "tairmempool": "ST_TAIRMEMPOOL", "unspecified": "ST_UNSPECIFIED"})

QUERY_TYPE = Enum("QueryType", {
    "QT_UNSPECIFIED": (0, None), "QT_BATCH_GET": (1, "batch_get"), "QT_PREFIX_MATCH": (2, "prefix_match"),
    "QT_REVERSE_ROLL_SW_MATCH": (3, "reverse_roll_sw_match"), "QT_PREFIX_MATCH_WITH_MAMBA": (4, None),
})

TRIM_STRATEGY = Enum("TrimStrategy", {
    "TS_UNSPECIFIED": (0, None), "TS_REMOVE_ALL_CACHE": (1, "remove_all_cache"),
    "TS_REMOVE_ALL_META": (2, "remove_all_meta"), "TS_TIMESTAMP": (3, "timestamp"),
})

RECLAIM_POLICY = Enum("ReclaimPolicy", {
    "POLICY_UNSPECIFIED": (0, None), "POLICY_LRU": (1, "lru"), "POLICY_LFU": (2, "lfu"), "POLICY_TTL": (3, "ttl"),
    "POLICY_KVCM_LEAF_LRU": (101, "leaf_lru"),
})

ACCOUNT_ROLE = Enum("AccountRole", {"ROLE_USER": (0, "user"), "ROLE_ADMIN": (1, "admin")})

#: Tair's write-placement hint; accepted and not used (kvcm writes in storage_candidates order).
CACHE_PREFER_STRATEGY = Enum("CachePreferStrategy", {name: (i, "") for i, name in enumerate((
    "CPS_UNSPECIFIED", "CPS_ALWAYS_3FS", "CPS_PREFER_3FS", "CPS_ALWAYS_MOONCAKE", "CPS_PREFER_MOONCAKE",
    "CPS_ALWAYS_TAIR_MEMPOOL", "CPS_PREFER_TAIR_MEMPOOL", "CPS_ALWAYS_VCNS_3FS", "CPS_PREFER_VCNS_3FS",
    "CPS_ALWAYS_TAIR_MEMPOOL_SSD", "CPS_PREFER_TAIR_MEMPOOL_SSD"))})


# -- masks and locations --------------------------------------------------------------------------

_MASK = frozenset({"offset", "bool_masks"})
_BOOL_MASKS = frozenset({"values"})


def mask_in(value: Any, where: str) -> dict[str, Any] | None:
    """``{"offset": n}`` or ``{"bool_masks": {"values": [...]}}`` (a oneof); ``{}`` stays ``{}``,
    which kvcm reads as "mask nothing" and refuses where it would widen a delete."""
    if value is None:
        return None
    mask = message(value, where, _MASK)
    if "offset" in mask and "bool_masks" in mask:
        raise InvalidArgument(f"{where}: offset and bool_masks are a oneof; give one")
    if "offset" in mask:
        return {"offset": int32(mask["offset"], path(where, "offset"))}
    if "bool_masks" in mask:
        flags = message(mask["bool_masks"], path(where, "bool_masks"), _BOOL_MASKS).get("values")
        if flags is None:
            return {"bool_masks": []}
        if not isinstance(flags, list):
            raise InvalidArgument(f"{where}.bool_masks.values: expected a list of booleans, got {_show(flags)}")
        return {"bool_masks": flags}
    return {}


def mask_out(mask: Mapping[str, Any]) -> dict[str, Any]:
    if "bool_masks" in mask:
        return {"bool_masks": {"values": mask["bool_masks"]}}
    return {"offset": mask.get("offset", 0)}


def locations_out(locations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kvcm's locations (``{type, spec_size, location_specs}``, their URIs already Tair's:
    :mod:`kvcm.tair.uris`) in Tair's shape, changed in place: a forwarded reply is the call's
    own, and a lookup's reply has a location per key."""
    out = STORAGE_TYPE.out
    for loc in locations:
        loc["type"] = out(loc["type"])
    return locations


# -- storages -------------------------------------------------------------------------------------

#: kvcm storage type -> (the oneof member of Tair's StorageConfig, the Tair fields of its spec).
#: A spec may also carry kvcm's own fields of that type (docs/storages.md): they are passed on.
_SPECS: dict[str, tuple[str, tuple[str, ...]]] = {
    "file": ("nfs", ("root_path", "key_count_per_file")),
    "3fs": ("threefs", ("cluster_name", "mountpoint", "root_dir", "key_count_per_file", "touch_file_when_create")),
    "mooncake": ("mooncake", ("local_hostname", "metadata_connstring", "protocol", "rdma_device",
                              "master_service_entry")),
    "tairmempool": ("tair_mem_pool", ("domain", "timeout", "service_discovery_url", "media_type")),
    "shm": ("shm", ("shm_dir", "prefix", "segment_size", "capacity_bytes")),
}
_MEMBERS = {member: kind for kind, (member, _) in _SPECS.items()} | {"vcnsthreefs": "3fs"}
_NOT_KVCM = ("local", "dummy", "event_report")  # Tair members with no kvcm storage type
_STORAGE = frozenset({"global_unique_name", "check_storage_available_when_open", "storage_type",
                      *_MEMBERS, *_NOT_KVCM})
_SPEC_INTS = frozenset({"key_count_per_file", "timeout", "remote_port", "segment_size", "capacity_bytes",
                        "file_size", "node_id", "range_id"})
_MEDIA_TYPES = {0: None, 2: "dram", 5: "ssd"}  # Tair's TairMemPoolStorageSpec.media_type numbers


def storage_in(value: Any, where: str) -> dict[str, Any]:
    """A Tair StorageConfig as a kvcm storage ``{global_unique_name, storage_type, storage_spec}``."""
    config = message(value, where, _STORAGE)
    members = [m for m in (*_MEMBERS, *_NOT_KVCM) if config.get(m) is not None]
    if len(members) != 1:
        raise InvalidArgument(f"{where}: give exactly one storage spec of {', '.join(_MEMBERS)}"
                              f"{'' if not members else ', not ' + ' and '.join(members)}")
    member = members[0]
    if member in _NOT_KVCM:
        raise InvalidArgument(f"{path(where, member)}: kvcm has no such storage type (docs/tair.md)")
    kind = _MEMBERS[member]
    declared = STORAGE_TYPE.to_kvcm(config.get("storage_type"), path(where, "storage_type"))
    if declared is not None and declared != kind:
        raise InvalidArgument(f"{path(where, 'storage_type')}: {STORAGE_TYPE.parse(config['storage_type'], '')} "
                              f"does not match the spec given ({member})")
    spec = _spec_in(config[member], path(where, member), kind)
    if kind == "3fs" and boolean(config.get("check_storage_available_when_open"), where):
        spec["check_storage_available_when_open"] = True
    return {"global_unique_name": text(config.get("global_unique_name"), path(where, "global_unique_name")),
            "storage_type": kind, "storage_spec": spec}


def _spec_in(value: Any, where: str, kind: str) -> dict[str, Any]:
    """The spec's fields for kvcm: proto3 defaults of Tair's own fields are unset (kvcm's defaults
    apply), kvcm's fields pass as given (its backend refuses what it does not know)."""
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: expected an object, got {_show(value)}")
    tair_fields = set(_SPECS[kind][1])
    spec: dict[str, Any] = {}
    for key, item in value.items():
        name = key if key in tair_fields else _CAMEL.sub(r"_\1", key).lower()
        if name == "media_type" and kind == "tairmempool":
            item = _media_type(item, path(where, name))
        elif name in _SPEC_INTS:
            item = int64(item, path(where, name))
        if name in tair_fields and item in (None, "", 0, False):
            continue
        spec[name] = item
    return spec


def _media_type(value: Any, where: str) -> str | None:
    if isinstance(value, str) and not _DECIMAL.fullmatch(value):
        return value  # kvcm's own spelling ("dram", "ssd")
    number = int32(value, where)
    if number not in _MEDIA_TYPES:
        raise InvalidArgument(f"{where}: {number} is not a media type kvcm knows (0, 2 = DRAM, 5 = SSD)")
    return _MEDIA_TYPES[number]


def storage_out(storage: Mapping[str, Any]) -> dict[str, Any]:
    """A kvcm storage as Tair's StorageConfig: its spec cut to Tair's fields."""
    kind = storage["storage_type"]
    spec = storage.get("storage_spec") or {}
    out: dict[str, Any] = {"global_unique_name": storage["global_unique_name"]}
    if kind in _SPECS:
        member, fields = _SPECS[kind]
        tair_spec = {name: spec[name] for name in fields if name in spec}
        if kind == "tairmempool" and "media_type" in tair_spec:
            tair_spec["media_type"] = {"dram": 2, "ssd": 5}.get(tair_spec["media_type"], 0)
        if kind == "shm" and "capacity_bytes" in tair_spec:
            tair_spec["capacity_bytes"] = out64(tair_spec["capacity_bytes"])
        out[member] = tair_spec
    out["check_storage_available_when_open"] = bool(spec.get("check_storage_available_when_open", False))
    out["storage_type"] = STORAGE_TYPE.out(kind)
    return out


# -- instance groups ------------------------------------------------------------------------------

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


def group_in(value: Any, where: str) -> dict[str, Any]:
    """A Tair InstanceGroup as kvcm's, with only the fields given (an update merges them).
    ``version`` is left out: it is the compare-and-set input of an update, not a field to set."""
    group = message(value, where, _GROUP)
    out: dict[str, Any] = {}
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
    # Tair-only settings, checked for their type and not used (docs/tair.md)
    for key in ("data_storage_strategy", "cache_prefer_strategy"):
        CACHE_PREFER_STRATEGY.parse(cache.get(key), path(where, f"cache_config.{key}"))
    for key in ("extra_info", "revisit_interval_buckets"):
        text(group.get(key), path(where, key))
    texts(group.get("event_report_storage_candidates"), path(where, "event_report_storage_candidates"))
    return out


def group_version(value: Any, where: str) -> int:
    return int64(message(value, where, _GROUP).get("version"), path(where, "version"))


def _quota_in(value: Any, where: str) -> dict[str, Any]:
    quota = message(value, where, _QUOTA)
    items = []
    for i, raw in enumerate(messages(quota.get("quota_config"), path(where, "quota_config"))):
        at = f"{where}.quota_config[{i}]"
        item = message(raw, at, _QUOTA_CONFIG)
        kind = STORAGE_TYPE.to_kvcm(item.get("storage_type"), path(at, "storage_type"))
        if kind is None:
            raise InvalidArgument(f"{at}.storage_type: required")
        items.append({"storage_type": kind, "capacity": int64(item.get("capacity"), path(at, "capacity"))})
    return {"capacity": int64(quota.get("capacity"), path(where, "capacity")), "quota_config": items}


def _reclaim_in(value: Any, where: str) -> dict[str, Any]:
    """Tair's reclaim strategy: the policy, the watermark (``trigger_strategy.used_percentage``)
    and the delete delay map to kvcm's; the schedule knobs (period, step) are the server's in kvcm
    and accepted unused; a watermark in bytes (``used_size``) has no kvcm equivalent."""
    reclaim = message(value, where, _RECLAIM)
    out: dict[str, Any] = {}
    policy = RECLAIM_POLICY.to_kvcm(reclaim.get("reclaim_policy"), path(where, "reclaim_policy"))
    if policy is not None:
        out["reclaim_policy"] = policy
    trigger = message(reclaim.get("trigger_strategy"), path(where, "trigger_strategy"), _TRIGGER)
    if int64(trigger.get("used_size"), path(where, "trigger_strategy.used_size")):
        raise InvalidArgument(f"{where}.trigger_strategy.used_size: kvcm's watermark is a share of the quota; "
                              "use used_percentage")
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


def group_out(group: Mapping[str, Any]) -> dict[str, Any]:
    quota = group.get("quota") or {}
    reclaim = group.get("reclaim_strategy") or {}
    strategy: dict[str, Any] = {
        "reclaim_policy": RECLAIM_POLICY.out(reclaim.get("reclaim_policy", "")),
        "trigger_strategy": {"used_size": "0", "used_percentage": reclaim.get("used_percentage", 0.0)},
        "delay_before_delete_ms": reclaim.get("delay_before_delete_ms", 0),
    }
    if reclaim.get("ttl_seconds"):
        strategy["ttl_seconds"] = reclaim["ttl_seconds"]  # kvcm's extension: the TTL policy's age
    return {
        "name": group["name"],
        "storage_candidates": list(group.get("storage_candidates") or []),
        "global_quota_group_name": group.get("global_quota_group_name", ""),
        "max_instance_count": out64(group.get("max_instance_count")),
        "quota": {"capacity": out64(quota.get("capacity")),
                  "quota_config": [{"storage_type": STORAGE_TYPE.out(q["storage_type"]), "capacity": out64(q["capacity"])}
                                   for q in quota.get("quota_config") or []]},
        "cache_config": {"reclaim_strategy": strategy},
        "user_data": group.get("user_data", ""),
        "version": out64(group.get("version")),
    }


# -- instances ------------------------------------------------------------------------------------

_SPEC_INFO = frozenset({"name", "size"})
_SPEC_GROUP = frozenset({"name", "spec_names"})
_DEPLOYMENT = frozenset({"model_name", "dtype", "use_mla", "tp_size", "dp_size", "lora_name", "pp_size", "extra",
                         "user_data", "use_eagle_pop"})
_DEPLOYMENT_INTS = ("tp_size", "dp_size", "pp_size")


def spec_infos_in(value: Any, where: str) -> list[dict[str, Any]]:
    out = []
    for i, raw in enumerate(messages(value, where)):
        item = message(raw, f"{where}[{i}]", _SPEC_INFO)
        out.append({"name": text(item.get("name"), f"{where}[{i}].name"), "size": int64(item.get("size"), f"{where}[{i}].size")})
    return out


def spec_groups_in(value: Any, where: str) -> list[dict[str, Any]]:
    out = []
    for i, raw in enumerate(messages(value, where)):
        item = message(raw, f"{where}[{i}]", _SPEC_GROUP)
        out.append({"name": text(item.get("name"), f"{where}[{i}].name"),
                    "spec_names": texts(item.get("spec_names"), f"{where}[{i}].spec_names")})
    return out


def deployment_in(value: Any, where: str) -> dict[str, Any]:
    deployment = message(value, where, _DEPLOYMENT)
    out: dict[str, Any] = {}
    for key in ("model_name", "dtype", "lora_name", "extra", "user_data"):
        if key in deployment:
            out[key] = text(deployment[key], path(where, key))
    for key in _DEPLOYMENT_INTS:
        if key in deployment:
            out[key] = int32(deployment[key], path(where, key))
    if "use_mla" in deployment:
        out["use_mla"] = boolean(deployment["use_mla"], path(where, "use_mla"))
    if boolean(deployment.get("use_eagle_pop"), path(where, "use_eagle_pop")):
        raise InvalidArgument(f"{where}.use_eagle_pop: kvcm does not shorten the full-attention prefix (docs/tair.md)")
    return out


def instance_out(info: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "quota_group_name": info.get("quota_group_name", ""),
        "instance_group_name": info["instance_group_name"],
        "instance_id": info["instance_id"],
        "block_size": info["block_size"],
        "location_spec_infos": [{"name": s["name"], "size": out64(s["size"])} for s in info["location_spec_infos"]],
        "model_deployment": dict(info.get("model_deployment") or {}),
        "location_spec_groups": [{"name": g["name"], "spec_names": list(g["spec_names"])}
                                 for g in info.get("location_spec_groups") or []],
    }


def endpoint_parts(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); ("", 0) for ipc:// and what does not parse."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme != "tcp":
        return "", 0
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    return (host, int(port)) if port.isdigit() else ("", 0)


# -- reported events (ReportEvent) ------------------------------------------------------------------

#: The kvcm ``report_events`` op of each Tair event type; adds and deletes share one (``events``).
REPORT_EVENT_TYPE = Enum("ReportEventType", {
    "EVENT_UNSPECIFIED": (0, None), "EVENT_NODE_REGISTER": (1, "register"), "EVENT_BLOCK_ADD": (2, "events"),
    "EVENT_BLOCK_DELETE": (3, "events"), "EVENT_HOST_DOWN": (4, "down"), "EVENT_HEARTBEAT": (5, "heartbeat"),
    "EVENT_BLOCK_SNAPSHOT": (6, "snapshot"),
})

#: Tair's storage types a reporter declares (an event-report backend each); another is refused.
REPORTER_STORAGE = {"ST_EVENT_REPORT_L1P5": "L1P5", "ST_EVENT_REPORT_L2": "L2"}

#: The oneof member each event type carries its parameters in.
_PARAMS = {"EVENT_NODE_REGISTER": "node_register", "EVENT_BLOCK_ADD": "block_add",
           "EVENT_BLOCK_DELETE": "block_delete", "EVENT_HOST_DOWN": "host_down", "EVENT_HEARTBEAT": "heartbeat",
           "EVENT_BLOCK_SNAPSHOT": "block_snapshot"}
_ITEM = frozenset({"event_type", *_PARAMS.values()})
_REGISTER = frozenset({"mediums"})
_ADD = frozenset({"block_key", "uri", "medium", "specs"})
_DELETE = frozenset({"block_key", "medium", "spec_names"})
_SNAPSHOT = frozenset({"medium", "blocks"})
_SNAPSHOT_ITEM = frozenset({"block_key", "medium", "specs"})
_HEARTBEAT = frozenset({"system_status"})
_LOCATION_SPEC = frozenset({"name", "uri"})
_MAX_MEDIUM = 32  # kvcm's bound on a medium name


class ReportedEvent:
    """One Tair event item read: its kvcm op and, for blocks, ``(kind, medium, key)`` with kind
    ``add`` or ``remove``."""

    __slots__ = ("blocks", "name", "op")

    def __init__(self, name: str, op: str, blocks: list[tuple[str, str, int]]) -> None:
        self.name, self.op, self.blocks = name, op, blocks


def event_in(value: Any, where: str) -> ReportedEvent:
    """A Tair ``EventItem``: its type is required and its parameters, if given, are those of its
    type (the oneof member named after it); each block needs its key and a medium."""
    item = message(value, where, _ITEM)
    name = REPORT_EVENT_TYPE.parse(item.get("event_type"), path(where, "event_type"))
    op = REPORT_EVENT_TYPE.to_kvcm(name, path(where, "event_type"))
    if op is None:
        raise InvalidArgument(f"{where}.event_type: required (one of {', '.join(_PARAMS)})")
    member = _PARAMS[name]
    for other in _PARAMS.values():
        if other != member and item.get(other) is not None:
            raise InvalidArgument(f"{path(where, other)}: not the parameters of {name} (give {member})")
    at = path(where, member)
    params = item.get(member)
    if name == "EVENT_NODE_REGISTER":
        texts(message(params, at, _REGISTER).get("mediums"), path(at, "mediums"))  # kvcm's blocks name theirs
    elif name == "EVENT_HEARTBEAT":
        _status_map(message(params, at, _HEARTBEAT).get("system_status"), path(at, "system_status"))
    elif name == "EVENT_HOST_DOWN":
        message(params, at, frozenset())
    elif name == "EVENT_BLOCK_ADD":
        add = _required(params, at, _ADD)
        text(add.get("uri"), path(at, "uri"))
        _specs(add.get("specs"), path(at, "specs"))
        return ReportedEvent(name, op, [("add", _medium(add.get("medium"), path(at, "medium")),
                                         _block_key(add.get("block_key"), path(at, "block_key")))])
    elif name == "EVENT_BLOCK_DELETE":
        delete = _required(params, at, _DELETE)
        texts(delete.get("spec_names"), path(at, "spec_names"))  # kvcm drops the block, whatever the specs
        return ReportedEvent(name, op, [("remove", _medium(delete.get("medium"), path(at, "medium")),
                                         _block_key(delete.get("block_key"), path(at, "block_key")))])
    else:
        return ReportedEvent(name, op, _snapshot(_required(params, at, _SNAPSHOT), at))
    return ReportedEvent(name, op, [])


def _snapshot(snapshot: dict[str, Any], where: str) -> list[tuple[str, str, int]]:
    """The snapshot's blocks; a key twice on one medium is refused (the same key on two is two
    holdings). The deprecated snapshot-wide ``medium`` is the medium of blocks that name none."""
    legacy = text(snapshot.get("medium"), path(where, "medium"))
    out: list[tuple[str, str, int]] = []
    seen: set[tuple[str, int]] = set()
    for i, raw in enumerate(messages(snapshot.get("blocks"), path(where, "blocks"))):
        at = f"{where}.blocks[{i}]"
        block = message(raw, at, _SNAPSHOT_ITEM)
        _specs(block.get("specs"), path(at, "specs"))
        medium = _medium(block.get("medium") or legacy, path(at, "medium"))
        key = _block_key(block.get("block_key"), path(at, "block_key"))
        if (medium.upper(), key) in seen:
            raise InvalidArgument(f"{at}.block_key: {key} is listed twice on medium {medium!r}")
        seen.add((medium.upper(), key))
        out.append(("add", medium, key))
    return out


def _required(value: Any, where: str, names: frozenset[str]) -> dict[str, Any]:
    if value is None:
        raise InvalidArgument(f"{where}: required by its event_type")
    return message(value, where, names)


def _block_key(value: Any, where: str) -> int:
    """A block key: Tair's proto spells it an int64 in a string; a JSON number is taken too."""
    if value is None or value == "":
        raise InvalidArgument(f"{where}: required (an int64 as a decimal string)")
    return int64(value, where)


def _medium(value: Any, where: str) -> str:
    medium = text(value, where)
    if not medium:
        raise InvalidArgument(f"{where}: required (the cache tier holding the block: gpu, hbm, mem, disk...)")
    if len(medium) > _MAX_MEDIUM:
        raise InvalidArgument(f"{where}: longer than {_MAX_MEDIUM} characters")
    return medium


def _specs(value: Any, where: str) -> None:
    """The block's LocationSpecs, checked and not kept: kvcm counts the blocks a host holds and
    hands out no engine-side URIs."""
    for i, raw in enumerate(messages(value, where)):
        spec = message(raw, f"{where}[{i}]", _LOCATION_SPEC)
        text(spec.get("name"), f"{where}[{i}].name")
        text(spec.get("uri"), f"{where}[{i}].uri")


def _status_map(value: Any, where: str) -> None:
    """``map<string, string>``: opaque observability data, checked and not kept (Tair keeps none either)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: expected an object of strings, got {_show(value)}")
    for key, item in value.items():
        text(item, f"{where}.{key[:100]}")
