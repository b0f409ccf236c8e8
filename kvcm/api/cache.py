"""Data-plane RPCs: ``get_cache_location``, ``get_cache_meta``, ``start_write_cache``,
``finish_write_cache``, ``remove_cache``, ``trim_cache`` (the README's "Data plane" section has an example of each).

Request schemas use Tair's proto field names; every request may carry ``trace_id``; unknown
fields are ignored. Enum values are lower-case names (``"prefix_match"``); Tair's spellings
(``"QT_PREFIX_MATCH"``, ``"TS_REMOVE_ALL_CACHE"``) are accepted too. A bool mask may be sent as
``{"bool_masks": [..]}`` or in proto-JSON form ``{"bool_masks": {"values": [..]}}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from kvcm.dispatch import Method
from kvcm.engines.eventlog import EventLog
from kvcm.engines.service import EngineService
from kvcm.errors import InvalidArgument
from kvcm.manager import CacheManager
from kvcm.masks import BlockMask, derive_keys
from kvcm.proto import wire

Int64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
InstanceId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class WireMask(msgspec.Struct):
    offset: int | None = None
    bool_masks: list[bool] | dict[str, Any] | None = None

    def to_mask(self, field: str) -> BlockMask:
        values = self.bool_masks
        if isinstance(values, dict):
            values = values.get("values", [])
            if not isinstance(values, list) or not all(isinstance(v, bool) for v in values):
                raise InvalidArgument(f"{field}.bool_masks.values: must be a list of booleans")
        return BlockMask(self.offset, values)


def _mask(mask: WireMask | None, field: str = "block_mask") -> BlockMask | None:
    return None if mask is None else mask.to_mask(field)


class _Request(msgspec.Struct, kw_only=True):
    trace_id: str = ""
    instance_id: InstanceId


class _Keys(_Request, kw_only=True):
    block_keys: list[Int64] = []
    token_ids: list[Int64] = []


class GetCacheLocationRequest(_Keys, kw_only=True):
    query_type: str
    block_mask: WireMask | None = None
    sw_size: int = 0
    location_spec_names: list[str] = []
    include_engines: bool = False  # add "engine_locations": per key, the engines holding it
    lora_name: str | None = None  # engine blocks of this LoRA adapter (with include_engines)


class GetCacheMetaRequest(_Keys, kw_only=True):
    block_mask: WireMask | None = None
    detail_level: int = 0


class StartWriteCacheRequest(_Keys, kw_only=True):
    location_spec_group_names: list[str] = []
    write_timeout_seconds: float = 0.0  # 0 = the server's cache.write_timeout_seconds


class FinishWriteCacheRequest(_Request, kw_only=True):
    write_session_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    success_blocks: WireMask | None = None
    locations: list[Any] = []  # accepted and ignored, as in Tair


class RemoveCacheRequest(_Keys, kw_only=True):
    block_mask: WireMask | None = None


class TrimCacheRequest(_Request, kw_only=True):
    strategy: str
    begin_timestamp: int = 0  # wall-clock microseconds (Tair's __lru_time__ unit)
    end_timestamp: int = 0


def _enum(value: str, prefix: str) -> str:
    """``"QT_PREFIX_MATCH"`` and ``"prefix_match"`` both mean ``"prefix_match"``."""
    lowered = value.lower()
    return lowered.removeprefix(prefix)


class CacheApi:
    """Thin adapters from request Structs to :class:`CacheManager` (RPC thread).

    With an event log, each successful data-plane call is also recorded as one of Tair's event
    types (``GetCacheLocation``, ``StartWriteCache``, ``FinishWriteCache``) for the optimizer;
    a write is recorded once it has committed, so a batch that fails to commit leaves no event.
    """

    def __init__(self, manager: CacheManager, engines: EngineService | None = None,
                 event_log: EventLog | None = None) -> None:
        self.m = manager
        self.engines = engines
        self.log = event_log

    def get_cache_location(self, r: GetCacheLocationRequest) -> Any:
        query_type = _enum(r.query_type, "qt_")
        reply = self.m.get_cache_location(r.instance_id, query_type, r.block_keys, r.token_ids,
                                          _mask(r.block_mask), r.sw_size, r.location_spec_names)
        if self.log is not None:
            self.log.get_cache_location(r.instance_id, query_type, self._keys(r), r.token_ids,
                                        msgspec.to_builtins(r.block_mask), r.sw_size, r.location_spec_names)
        if not r.include_engines:
            return reply
        if self.engines is None:
            raise InvalidArgument("include_engines: the engine tier is disabled on this server")
        # Rare path: decode the spliced reply once to add the engine holders of each key.
        result = wire.unpack(reply.data)
        result["engine_locations"] = self.engines.engine_locations(r.instance_id, self._keys(r), r.lora_name)
        return result

    def get_cache_meta(self, r: GetCacheMetaRequest) -> Any:
        return self.m.get_cache_meta(r.instance_id, r.block_keys, r.token_ids, _mask(r.block_mask), r.detail_level)

    def start_write_cache(self, r: StartWriteCacheRequest) -> Any:
        reply = self.m.start_write_cache(r.instance_id, r.block_keys, r.token_ids, r.location_spec_group_names,
                                         r.write_timeout_seconds)
        log = self.log
        if log is not None:
            keys = self._keys(r)

            def record() -> None:
                result = wire.unpack(reply.data)
                log.start_write_cache(r.instance_id, result.get("write_session_id", ""), keys, r.token_ids,
                                      result.get("block_mask"), r.location_spec_group_names,
                                      int(r.write_timeout_seconds))

            self._after_commit(record)
        return reply

    def finish_write_cache(self, r: FinishWriteCacheRequest) -> Any:
        reply = self.m.finish_write_cache(r.instance_id, r.write_session_id, _mask(r.success_blocks, "success_blocks"))
        log = self.log
        if log is not None:
            mask = msgspec.to_builtins(r.success_blocks)
            self._after_commit(lambda: log.finish_write_cache(r.instance_id, r.write_session_id, mask))
        return reply

    def remove_cache(self, r: RemoveCacheRequest) -> Any:
        return self.m.remove_cache(r.instance_id, r.block_keys, r.token_ids, _mask(r.block_mask))

    def trim_cache(self, r: TrimCacheRequest) -> Any:
        return self.m.trim_cache(r.instance_id, _enum(r.strategy, "ts_"), r.begin_timestamp, r.end_timestamp)

    def _after_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the calling request's changes commit (its own savepoint, joined)."""
        with self.m.store.write(join=True) as txn:
            txn.on_commit(fn)

    def _keys(self, r: _Keys) -> list[int]:
        return derive_keys(r.block_keys, r.token_ids, self.m.instance(r.instance_id).block_size)


def methods(manager: CacheManager, engines: EngineService | None = None,
            event_log: EventLog | None = None) -> list[Method]:
    api = CacheApi(manager, engines, event_log)
    return [
        Method("get_cache_location", api.get_cache_location, request=GetCacheLocationRequest),
        Method("get_cache_meta", api.get_cache_meta, request=GetCacheMetaRequest),
        Method("start_write_cache", api.start_write_cache, request=StartWriteCacheRequest, writes=True,
               idempotent=False),
        Method("finish_write_cache", api.finish_write_cache, request=FinishWriteCacheRequest, writes=True,
               idempotent=False),
        Method("remove_cache", api.remove_cache, request=RemoveCacheRequest, writes=True),
        Method("trim_cache", api.trim_cache, request=TrimCacheRequest, writes=True),
    ]
