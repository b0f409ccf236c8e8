"""The storage tier seen from outside: forwards the data plane's changes to kvcm's own
vLLM-format publisher, and its requests and reclaim decisions to the JSON-lines event log.

:class:`StorageEvents` is a :class:`~kvcm.cache.listeners.CacheListener`; the data plane
calls it after each change has committed, on whichever thread made the change. Publishing only
queues (the publisher thread sends), and the log appends one line, so the request path pays
microseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from kvcm.cache.listeners import CacheListener
from kvcm.cache.masks import BlockMask
from kvcm.proto.wire import EncodableMap
from kvcm.publish.eventlog import EventLog
from kvcm.publish.publisher import EventPublisher

_STORAGE_MEDIUM = "STORAGE"


class StorageEvents(CacheListener):
    """Listener: BlockStored / BlockRemoved / AllBlocksCleared out; requests, pins and reclaim decisions logged."""

    def __init__(
        self,
        publisher: EventPublisher | None,
        event_log: EventLog | None,
        block_size_of: Callable[[str], int],
    ) -> None:
        self.publisher = publisher
        self.event_log = event_log
        self._block_size_of = block_size_of

    def on_lookup(self, instance_id: str, query_type: str, keys: list[int], token_ids: Sequence[int] | None,
                  mask: BlockMask | None, sw_size: int, spec_names: Sequence[str] | None) -> None:
        if self.event_log is not None:
            self.event_log.get_cache_location(instance_id, query_type, keys, token_ids or (), _builtins(mask), sw_size,
                                              spec_names or ())

    def on_write_started(self, instance_id: str, session_id: str, keys: list[int], token_ids: Sequence[int] | None,
                         block_mask: EncodableMap, spec_group_names: Sequence[str] | None,
                         timeout: float | None) -> None:
        if self.event_log is not None:
            self.event_log.start_write_cache(instance_id, session_id, keys, token_ids or (), block_mask,
                                             spec_group_names or (), int(timeout or 0))

    def on_write_finished(self, instance_id: str, session_id: str, success: BlockMask | None) -> None:
        if self.event_log is not None:
            self.event_log.finish_write_cache(instance_id, session_id, _builtins(success))

    def on_stored(self, instance_id: str, keys: Sequence[int], parent: int | None, token_ids: Sequence[int] | None) -> None:
        if self.publisher is not None:
            self.publisher.block_stored(instance_id, keys, parent, token_ids or (), self._block_size_of(instance_id),
                                        _STORAGE_MEDIUM)

    def on_removed(self, instance_id: str, keys: Sequence[int]) -> None:
        if self.publisher is not None:
            self.publisher.block_removed(instance_id, keys, _STORAGE_MEDIUM)

    def on_cleared(self, instance_id: str) -> None:
        if self.publisher is not None:
            self.publisher.all_cleared(instance_id)

    def on_evicted(self, instance_id: str, keys: Sequence[int], delay_s: float) -> None:
        if self.event_log is not None:
            self.event_log.cache_reclaim_submit(instance_id, keys, [], int(delay_s * 1e6))

    def on_pinned(self, instance_id: str, keys: list[int], ttl_s: float, expires_at: float) -> None:
        if self.event_log is not None:
            self.event_log.pin_cache(instance_id, keys, ttl_s, expires_at)

    def on_unpinned(self, instance_id: str, keys: list[int]) -> None:
        if self.event_log is not None:
            self.event_log.unpin_cache(instance_id, keys)


def _builtins(mask: BlockMask | None) -> object:
    """A mask as the log writes it: ``{"offset": n}``, ``{"bool_masks": [...]}`` or null."""
    return None if mask is None else msgspec.to_builtins(mask)
