"""The storage tier seen from outside: forwards the cache manager's changes to kvcm's own
vLLM-format publisher and to the JSON-lines event log.

:class:`StorageEvents` is a cache-manager listener (``CacheManager.add_listener``); the manager
calls it after each change has committed, on whichever thread made the change. Publishing only
queues (the publisher thread sends), and the log appends one line, so the request path pays
microseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcm.engines.eventlog import EventLog
from kvcm.engines.publisher import EventPublisher

_STORAGE_MEDIUM = "STORAGE"


class StorageEvents:
    """Listener: BlockStored / BlockRemoved / AllBlocksCleared out, reclaim decisions logged."""

    def __init__(
        self,
        publisher: EventPublisher | None,
        event_log: EventLog | None,
        block_size_of: Callable[[str], int],
    ) -> None:
        self.publisher = publisher
        self.event_log = event_log
        self._block_size_of = block_size_of

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
