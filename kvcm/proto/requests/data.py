"""Data-plane requests: ``get_cache_location``, ``get_cache_location_len``, ``get_cache_meta``,
``start_write_cache``, ``finish_write_cache``, ``remove_cache``, ``trim_cache``, ``report_lost``,
``pin_cache`` and ``unpin_cache`` (docs/rpc.md has an example of each).

Field names are Tair's proto field names; every request may carry ``trace_id`` and ``auth``; an
unknown field, at any depth, is INVALID_ARGUMENT (:mod:`kvcm.proto.schema`). Enum values are
lower-case names (``"prefix_match"``); Tair's spellings (``"QT_PREFIX_MATCH"``,
``"TS_REMOVE_ALL_CACHE"``) are accepted too. A bool mask may be sent as ``{"bool_masks": [..]}``
or in proto-JSON form ``{"bool_masks": {"values": [..]}}`` (no other key).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvcm.proto.requests.prompt import PromptRequest
from kvcm.proto.schema import KEYS_CEILING, Flags, Int64, RequestBase

__all__ = [
    "BoolMasks", "FinishWriteCacheRequest", "GetCacheLocationLenRequest", "GetCacheLocationRequest",
    "GetCacheMetaRequest", "InstanceId", "KeysRequest", "PinCacheRequest", "PinKeys", "RemoveCacheRequest",
    "ReportLostRequest", "SentLocation", "SentLocationSpec", "StartWriteCacheRequest", "TrimCacheRequest",
    "UnpinCacheRequest", "WireMask",
]

InstanceId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class BoolMasks(msgspec.Struct, forbid_unknown_fields=True):
    """Tair's proto-JSON form of a bool mask, ``{"values": [..]}``."""

    values: Flags = []


class WireMask(msgspec.Struct, forbid_unknown_fields=True):
    """A block mask as requests send it: the first ``offset`` keys, or one flag per key."""

    offset: int | None = None
    bool_masks: Flags | BoolMasks | None = None


# msgspec.Struct named again only so that linters see a Struct (its defaults are copied, not shared).
class _Request(RequestBase, msgspec.Struct, kw_only=True):
    instance_id: InstanceId


class KeysRequest(PromptRequest, msgspec.Struct, kw_only=True):
    """A data-plane request naming blocks by ``block_keys`` or a prompt (:class:`PromptRequest`)."""

    instance_id: InstanceId


class GetCacheLocationRequest(KeysRequest, kw_only=True):
    query_type: str
    block_mask: WireMask | None = None
    sw_size: int = 0
    location_spec_names: list[str] = []
    include_engines: bool = False  # add "engine_locations": per key, the engines holding it
    reply_format: Literal["classic", "compact"] = "classic"  # kvcm.proto.locations


class GetCacheLocationLenRequest(KeysRequest, kw_only=True):
    """``get_cache_location``'s lookup fields (engine holders have no count of their own)."""

    query_type: str
    block_mask: WireMask | None = None
    sw_size: int = 0
    location_spec_names: list[str] = []


class GetCacheMetaRequest(KeysRequest, kw_only=True):
    block_mask: WireMask | None = None
    detail_level: int = 0


class StartWriteCacheRequest(KeysRequest, kw_only=True):
    location_spec_group_names: list[str] = []
    write_timeout_seconds: float = 0.0  # 0 = the server's cache.write_timeout_seconds


class SentLocationSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(max_length=256)] = ""
    uri: Annotated[str, msgspec.Meta(max_length=4096)] = ""


class SentLocation(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A location a Tair client echoes back on finish: the shape kvcm handed out."""

    type: Annotated[str, msgspec.Meta(max_length=64)] = ""
    spec_size: int = 0
    location_specs: Annotated[list[SentLocationSpec], msgspec.Meta(max_length=256)] = []


class FinishWriteCacheRequest(_Request, kw_only=True):
    write_session_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    success_blocks: WireMask | None = None
    # Accepted and not used, as in Tair (the session knows its locations), but held to the
    # shape kvcm hands out: a URI of another scheme is a client bug worth an error, not silence.
    locations: Annotated[list[SentLocation], msgspec.Meta(max_length=KEYS_CEILING)] = []


class RemoveCacheRequest(KeysRequest, kw_only=True):
    block_mask: WireMask | None = None


class ReportLostRequest(KeysRequest, kw_only=True):
    block_mask: WireMask | None = None


class TrimCacheRequest(_Request, kw_only=True):
    strategy: str
    begin_timestamp: int = 0  # wall-clock microseconds (Tair's __lru_time__ unit)
    end_timestamp: int = 0


#: A pin request's keys: at least one (an empty pin is a mistake, never "pin nothing").
PinKeys = Annotated[list[Int64], msgspec.Meta(min_length=1, max_length=KEYS_CEILING)]


class PinCacheRequest(_Request, kw_only=True):
    block_keys: PinKeys
    ttl_seconds: Annotated[float, msgspec.Meta(gt=0)]  # at most cache.max_pin_ttl_s


class UnpinCacheRequest(_Request, kw_only=True):
    block_keys: PinKeys
