"""Tair's StorageConfig as a kvcm storage, and back.

A Tair storage config names one spec (a oneof member per storage type); kvcm's storage has a
type and a spec map. A spec may also carry kvcm's own fields of that type (docs/storages.md):
they are passed on.
"""

from __future__ import annotations

from kvcm.errors import InvalidArgument
from kvcm.proto.tair.enums import STORAGE_TYPE
from kvcm.proto.tair.fields import (
    CAMEL,
    DECIMAL,
    as_map,
    as_str,
    boolean,
    int32,
    int64,
    message,
    out64,
    path,
    show,
    text,
)
from kvcm.proto.tair.shapes import fill
from kvcm.proto.wire import Decoded, DecodedMap, Encodable

#: kvcm storage type -> (the oneof member of Tair's StorageConfig, the Tair fields of its spec).
_SPECS: dict[str, tuple[str, tuple[str, ...]]] = {
    "file": ("nfs", ("root_path", "key_count_per_file")),
    "3fs": ("threefs", ("cluster_name", "mountpoint", "root_dir", "key_count_per_file", "touch_file_when_create")),
    "mooncake": ("mooncake", ("local_hostname", "metadata_connstring", "protocol", "rdma_device",
                              "master_service_entry")),
    "tairmempool": ("tair_mem_pool", ("domain", "timeout", "service_discovery_url", "media_type")),
    "shm": ("shm", ("shm_dir", "prefix", "segment_size", "capacity_bytes")),
}
#: Tair's spec message of each member kvcm prints (every field, defaults included).
_SPEC_MESSAGES = {"nfs": "NfsStorageSpec", "threefs": "ThreeFSStorageSpec", "mooncake": "MooncakeStorageSpec",
                  "tair_mem_pool": "TairMemPoolStorageSpec"}
_MEMBERS = {member: kind for kind, (member, _) in _SPECS.items()} | {"vcnsthreefs": "3fs"}
_NOT_KVCM = ("local", "dummy", "event_report")  # Tair members with no kvcm storage type
_STORAGE = frozenset({"global_unique_name", "check_storage_available_when_open", "storage_type",
                      *_MEMBERS, *_NOT_KVCM})
_SPEC_INTS = frozenset({"key_count_per_file", "timeout", "remote_port", "segment_size", "capacity_bytes",
                        "file_size", "node_id", "range_id"})
_MEDIA_TYPES = {0: None, 2: "dram", 5: "ssd"}  # Tair's TairMemPoolStorageSpec.media_type numbers
_MEDIA_NUMBERS = {"dram": 2, "ssd": 5}


def storage_in(value: Decoded, where: str) -> dict[str, Encodable]:
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


def _spec_in(value: Decoded, where: str, kind: str) -> DecodedMap:
    """The spec's fields for kvcm: proto3 defaults of Tair's own fields are unset (kvcm's defaults
    apply), kvcm's fields pass as given (its backend refuses what it does not know)."""
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: expected an object, got {show(value)}")
    tair_fields = set(_SPECS[kind][1])
    spec: DecodedMap = {}
    for key, item in value.items():
        name = key if key in tair_fields else CAMEL.sub(r"_\1", key).lower()
        if name == "media_type" and kind == "tairmempool":
            item = _media_type(item, path(where, name))
        elif name in _SPEC_INTS:
            item = int64(item, path(where, name))
        if name in tair_fields and item in (None, "", 0, False):
            continue
        spec[name] = item
    return spec


def _media_type(value: Decoded, where: str) -> str | None:
    if isinstance(value, str) and not DECIMAL.fullmatch(value):
        return value  # kvcm's own spelling ("dram", "ssd")
    number = int32(value, where)
    if number not in _MEDIA_TYPES:
        raise InvalidArgument(f"{where}: {number} is not a media type kvcm knows (0, 2 = DRAM, 5 = SSD)")
    return _MEDIA_TYPES[number]


def storage_out(storage: DecodedMap) -> dict[str, Encodable]:
    """A kvcm storage as Tair's StorageConfig: its spec cut to Tair's fields."""
    kind = as_str(storage["storage_type"])
    spec = as_map(storage.get("storage_spec") or {})
    out: dict[str, Encodable] = {"global_unique_name": storage["global_unique_name"]}
    if kind in _SPECS:
        member, fields = _SPECS[kind]
        tair_spec: dict[str, Encodable] = {name: spec[name] for name in fields if name in spec}
        media = spec.get("media_type")
        if kind == "tairmempool" and "media_type" in spec:
            tair_spec["media_type"] = _MEDIA_NUMBERS.get(media, 0) if isinstance(media, str) else 0
        if kind == "shm" and "capacity_bytes" in spec:
            tair_spec["capacity_bytes"] = out64(spec["capacity_bytes"])
        message = _SPEC_MESSAGES.get(member)
        out[member] = fill(message, tair_spec) if message is not None else tair_spec  # shm is kvcm's own
    out["check_storage_available_when_open"] = bool(spec.get("check_storage_available_when_open", False))
    out["storage_type"] = STORAGE_TYPE.out(kind)
    return out
