"""Tair KVCM's proto3-JSON shapes, both ways: scalars, enums, masks, locations, storages, groups.

Input follows proto3 JSON as Tair's server parses it: int64 (and int32) as a number or a decimal
string, enums by name or by number, ``null`` as unset, field names as the protos spell them (the
lowerCamel JSON names are accepted too). Output follows Tair's printer with
``preserve_proto_field_names``: int64 as decimal strings (a JSON number above 2^53 loses digits in
JavaScript and in many JSON libraries), enums by name. Every error is INVALID_ARGUMENT naming the
field path, as kvcm's own validation does.

This package knows Tair's side only; what each Tair value means in kvcm (``ST_NFS`` is ``file``,
``POLICY_LRU`` is ``lru``) is in the enum tables (:mod:`~kvcm.proto.tair.enums`), and the shapes
of kvcm's side are those of its own RPCs (docs/rpc.md), which then validate the translated
request strictly. One module per concept: :mod:`~kvcm.proto.tair.fields` (scalars, messages),
:mod:`~kvcm.proto.tair.enums`, :mod:`~kvcm.proto.tair.locations` (masks, locations),
:mod:`~kvcm.proto.tair.storages`, :mod:`~kvcm.proto.tair.groups`,
:mod:`~kvcm.proto.tair.instances`, :mod:`~kvcm.proto.tair.events` (``ReportEvent``); their
names are all here too. :mod:`~kvcm.proto.tair.shapes` is the table of Tair's response messages
every reply is filled from (every field, on success and on error).
"""

from __future__ import annotations

from kvcm.proto.tair.enums import (
    ACCOUNT_ROLE,
    CACHE_PREFER_STRATEGY,
    QUERY_TYPE,
    RECLAIM_POLICY,
    REPORT_EVENT_TYPE,
    STORAGE_TYPE,
    TRIM_STRATEGY,
    Enum,
)
from kvcm.proto.tair.events import REPORTER_STORAGE, ReportedEvent, event_in
from kvcm.proto.tair.fields import (
    as_list,
    as_map,
    as_maps,
    as_str,
    boolean,
    double,
    int32,
    int64,
    int64_list,
    message,
    messages,
    out64,
    path,
    text,
    texts,
    unknown,
)
from kvcm.proto.tair.groups import group_in, group_out, group_version
from kvcm.proto.tair.instances import deployment_in, endpoint_parts, instance_out, spec_groups_in, spec_infos_in
from kvcm.proto.tair.locations import locations_out, mask_in, mask_out
from kvcm.proto.tair.storages import storage_in, storage_out

__all__ = [
    "ACCOUNT_ROLE", "CACHE_PREFER_STRATEGY", "QUERY_TYPE", "RECLAIM_POLICY", "REPORTER_STORAGE", "REPORT_EVENT_TYPE",
    "STORAGE_TYPE", "TRIM_STRATEGY", "Enum", "ReportedEvent", "as_list", "as_map", "as_maps", "as_str", "boolean",
    "deployment_in", "double", "endpoint_parts", "event_in", "group_in", "group_out", "group_version", "instance_out",
    "int32", "int64", "int64_list", "locations_out", "mask_in", "mask_out", "message", "messages", "out64", "path",
    "spec_groups_in", "spec_infos_in", "storage_in", "storage_out", "text", "texts", "unknown",
]
