"""Data-plane RPCs: ``get_cache_location``, ``get_cache_location_len`` (the number of locations
alone, Tair's ``getCacheLocationLen``), ``get_cache_meta``, ``start_write_cache``,
``finish_write_cache``, ``remove_cache``, ``trim_cache``, ``report_lost`` (a client could not
read blocks kvcm handed out: they stop being served), ``pin_cache`` and ``unpin_cache`` (soft
pins: keys kept whatever the eviction policy says, :mod:`kvcm.cache.pins`); docs/rpc.md has an
example of each.

The requests (and how masks and Tair's enum spellings are sent) are
:mod:`kvcm.proto.requests.data`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from kvcm.api.costs import (
    COMPACT_BYTES_PER_KEY,
    COMPACT_BYTES_PER_SPEC,
    REPLY_BYTES_PER_SPEC,
    US_PER_CONTAINER,
    US_PER_HELD_PIN,
    US_PER_KEY,
    US_PER_SLOT,
)
from kvcm.api.token_keys import TokenWork, hash_tokens, prompt_work
from kvcm.backends.storage.base import is_slot_storage
from kvcm.cache.keys import derive_keys
from kvcm.cache.manager import CacheManager
from kvcm.cache.masks import BlockMask
from kvcm.engines.service import EngineService
from kvcm.errors import InvalidArgument
from kvcm.proto import wire
from kvcm.proto.requests.data import (
    BoolMasks,
    FinishWriteCacheRequest,
    GetCacheLocationLenRequest,
    GetCacheLocationRequest,
    GetCacheMetaRequest,
    KeysRequest,
    PinCacheRequest,
    RemoveCacheRequest,
    ReportLostRequest,
    SentLocation,
    StartWriteCacheRequest,
    TrimCacheRequest,
    UnpinCacheRequest,
    WireMask,
)
from kvcm.proto.uris import parse_block_uri
from kvcm.proto.wire import Raw
from kvcm.rpc.dispatch import Estimate, Method


def _mask(mask: WireMask | None) -> BlockMask | None:
    """A request's mask as the data plane takes it (a proto-JSON ``{"values": [..]}`` unwrapped)."""
    if mask is None:
        return None
    values = mask.bool_masks
    return BlockMask(mask.offset, values.values if isinstance(values, BoolMasks) else values)


@functools.lru_cache(maxsize=256)  # on every request; the handful of spellings repeat
def _enum(value: str, prefix: str) -> str:
    """``"QT_PREFIX_MATCH"`` and ``"prefix_match"`` both mean ``"prefix_match"``."""
    lowered = value.lower()
    return lowered.removeprefix(prefix)


class CacheApi:
    """Thin adapters from request Structs to :class:`CacheManager` (RPC thread). What the event
    log records of each call comes from the data plane's listeners
    (:class:`kvcm.publish.bridge.StorageEvents`), once the call's changes committed."""

    def __init__(self, manager: CacheManager, engines: EngineService | None = None) -> None:
        self.m = manager
        self.engines = engines

    def get_cache_location(self, r: GetCacheLocationRequest) -> Raw | dict[str, object]:
        reply = self.m.get_cache_location(r.instance_id, _enum(r.query_type, "qt_"), r.block_keys, r.token_ids,
                                          _mask(r.block_mask), r.sw_size, r.location_spec_names,
                                          compact=r.reply_format == "compact")
        if not r.include_engines:
            return reply
        if self.engines is None:
            raise InvalidArgument("include_engines: the engine tier is disabled on this server")
        # Rare path: decode the spliced reply once to add the engine holders of each key.
        result: dict[str, object] = wire.unpack(reply.data)
        result["engine_locations"] = self.engines.engine_locations(r.instance_id, self._keys(r), r.lora_name)
        return result

    def get_cache_location_len(self, r: GetCacheLocationLenRequest) -> dict[str, int]:
        count = self.m.get_cache_location_len(r.instance_id, _enum(r.query_type, "qt_"), r.block_keys, r.token_ids,
                                              _mask(r.block_mask), r.sw_size, r.location_spec_names)
        return {"cache_location_len": count}

    def get_cache_meta(self, r: GetCacheMetaRequest) -> Mapping[str, object]:
        return self.m.get_cache_meta(r.instance_id, r.block_keys, r.token_ids, _mask(r.block_mask), r.detail_level)

    def start_write_cache(self, r: StartWriteCacheRequest) -> Raw:
        return self.m.start_write_cache(r.instance_id, r.block_keys, r.token_ids, r.location_spec_group_names,
                                        r.write_timeout_seconds)

    def finish_write_cache(self, r: FinishWriteCacheRequest) -> Mapping[str, object]:
        _check_sent_uris(r.locations)
        return self.m.finish_write_cache(r.instance_id, r.write_session_id, _mask(r.success_blocks))

    def remove_cache(self, r: RemoveCacheRequest) -> Mapping[str, object]:
        return self.m.remove_cache(r.instance_id, r.block_keys, r.token_ids, _mask(r.block_mask))

    def report_lost(self, r: ReportLostRequest) -> Mapping[str, object]:
        return self.m.report_lost(r.instance_id, r.block_keys, r.token_ids, _mask(r.block_mask))

    def trim_cache(self, r: TrimCacheRequest) -> Mapping[str, object]:
        return self.m.trim_cache(r.instance_id, _enum(r.strategy, "ts_"), r.begin_timestamp, r.end_timestamp)

    def pin_cache(self, r: PinCacheRequest) -> Mapping[str, object]:
        return self.m.pin_cache(r.instance_id, r.block_keys, r.ttl_seconds)

    def unpin_cache(self, r: UnpinCacheRequest) -> Mapping[str, object]:
        return self.m.unpin_cache(r.instance_id, r.block_keys)

    def _keys(self, r: KeysRequest) -> list[int]:
        return derive_keys(r.block_keys, r.token_ids, self.m.instance(r.instance_id).block_size)


#: A lookup's kind of work (:data:`kvcm.api.costs.US_PER_KEY`) by query type; an unknown type
#: is costed as the dearest and then refused by the handler.
_FULL = {"prefix_match": "prefix_match", "batch_get": "batch_get", "reverse_roll_sw_match": "reverse_roll_sw_match"}
#: The same for the length alone: only a prefix walk has a cheaper form (the others count every
#: key's copy as they do for the full reply).
_LENGTH = {**_FULL, "prefix_match": "prefix_match_len"}


class CacheCosts:
    """The dispatcher's pre-run hooks of the data plane: keys from ``token_ids`` and estimates
    (per key, from :mod:`kvcm.api.costs`)."""

    def __init__(self, manager: CacheManager, engines: EngineService | None = None) -> None:
        self.m = manager
        self.engines = engines

    def tokens(self, r: KeysRequest) -> TokenWork | None:
        return prompt_work(r, bool(r.block_keys), lambda: self.m.instance(r.instance_id).block_size)

    def _per_key(self, r: KeysRequest, per_key: float, reply: bool = True, compact: bool = False) -> Estimate:
        keys = len(r.block_keys)
        specs = len(self.m.instance(r.instance_id).specs)
        per_reply_key = COMPACT_BYTES_PER_KEY + specs * COMPACT_BYTES_PER_SPEC if compact else specs * REPLY_BYTES_PER_SPEC
        return Estimate(keys * per_key, keys * per_reply_key if reply else 0, per_key, keys)

    def get_cache_location(self, r: GetCacheLocationRequest) -> Estimate:
        query = _FULL.get(_enum(r.query_type, "qt_"), "batch_get")
        compact = r.reply_format == "compact"
        per_key = US_PER_KEY["prefix_match_compact" if compact and query == "prefix_match" else query]
        if r.include_engines and self.engines is not None:
            # each key's holders, one entry per source holding it (at most every source followed)
            followed = sum(1 for state in self.engines.index.sources() if state.spec.instance_id == r.instance_id)
            per_key += US_PER_KEY["engine_location"] * followed
        return self._per_key(r, per_key, compact=compact)

    def get_cache_location_len(self, r: GetCacheLocationLenRequest) -> Estimate:
        return self._per_key(r, US_PER_KEY[_LENGTH.get(_enum(r.query_type, "qt_"), "batch_get")], reply=False)

    def get_cache_meta(self, r: GetCacheMetaRequest) -> Estimate:
        return self._per_key(r, US_PER_KEY["get_cache_meta"])

    def start_write_cache(self, r: StartWriteCacheRequest) -> Estimate:
        inst = self.m.instance(r.instance_id)
        per_key = US_PER_KEY["start_write_cache"] + sum(self._per_slot(inst.group, size) for _, size in inst.specs)
        return self._per_key(r, per_key)

    def _per_slot(self, group: str, size: int) -> float:
        """One spec of one block on the group's first storage: its slot, and its share of a new
        container (a storage with one block per file creates a file for every slot)."""
        candidates = self.m.group_view(group).candidates
        backend = self.m.pool.get(candidates[0]) if candidates else None
        slots = backend.slots_per_container(size) if is_slot_storage(backend) else 0
        return US_PER_SLOT + (US_PER_CONTAINER / slots if slots > 0 else 0.0)

    def remove_cache(self, r: RemoveCacheRequest | ReportLostRequest) -> Estimate:
        return self._per_key(r, US_PER_KEY["remove_cache"], reply=False)

    def pins(self, r: PinCacheRequest | UnpinCacheRequest) -> Estimate:
        per_key = US_PER_KEY["pin_cache"]
        held = self.m.pins.count(r.instance_id) * US_PER_HELD_PIN
        return Estimate(len(r.block_keys) * per_key + held, 0, per_key, len(r.block_keys))


def methods(manager: CacheManager, engines: EngineService | None = None) -> list[Method]:
    api = CacheApi(manager, engines)
    costs = CacheCosts(manager, engines)
    return [
        Method("get_cache_location", api.get_cache_location, request=GetCacheLocationRequest,
               cost=costs.get_cache_location, prepare=hash_tokens(costs.tokens)),
        Method("get_cache_location_len", api.get_cache_location_len, request=GetCacheLocationLenRequest,
               cost=costs.get_cache_location_len, prepare=hash_tokens(costs.tokens)),
        Method("get_cache_meta", api.get_cache_meta, request=GetCacheMetaRequest, cost=costs.get_cache_meta,
               prepare=hash_tokens(costs.tokens)),
        Method("start_write_cache", api.start_write_cache, request=StartWriteCacheRequest, writes=True,
               idempotent=False, cost=costs.start_write_cache, prepare=hash_tokens(costs.tokens)),
        Method("finish_write_cache", api.finish_write_cache, request=FinishWriteCacheRequest, writes=True,
               idempotent=False),
        Method("remove_cache", api.remove_cache, request=RemoveCacheRequest, writes=True, cost=costs.remove_cache,
               prepare=hash_tokens(costs.tokens)),
        Method("report_lost", api.report_lost, request=ReportLostRequest, writes=True, cost=costs.remove_cache,
               prepare=hash_tokens(costs.tokens)),
        Method("trim_cache", api.trim_cache, request=TrimCacheRequest, writes=True),
        Method("pin_cache", api.pin_cache, request=PinCacheRequest, writes=True, cost=costs.pins),
        Method("unpin_cache", api.unpin_cache, request=UnpinCacheRequest, writes=True, cost=costs.pins),
    ]


def _check_sent_uris(locations: list[SentLocation]) -> None:
    for i, location in enumerate(locations):
        for j, spec in enumerate(location.location_specs):
            if spec.uri:  # "" is a filler entry's
                try:
                    parse_block_uri(spec.uri)
                except InvalidArgument as exc:
                    raise InvalidArgument(f"locations[{i}].location_specs[{j}].uri: {exc.message}") from None
