"""What the data plane tells the rest of kvcm: a typed listener protocol and its fan-out.

The reclaimer (recency, eviction), the publisher bridge (kvcm's own KV events) and the event log
learn about blocks only through :class:`CacheListener`. Every hook runs after the change it reports
committed, on the thread that made it; a listener that raises is logged and never fails the
request or the other listeners.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvcm.cache.masks import BlockMask
from kvcm.cache.record_codec import Location
from kvcm.proto.wire import EncodableMap

log = logging.getLogger("kvcm.cache.listeners")


class CacheListener:
    """Subclass and override the hooks you need; the others do nothing."""

    def on_read(self, instance_id: str, keys: list[int], now: float) -> None:
        """A lookup returned these keys (in request order)."""

    def on_lookup(self, instance_id: str, query_type: str, keys: list[int], token_ids: Sequence[int] | None,
                  mask: BlockMask | None, sw_size: int, spec_names: Sequence[str] | None) -> None:
        """A ``get_cache_location`` succeeded: the request as the client sent it, with its keys."""

    def on_write_started(self, instance_id: str, session_id: str, keys: list[int], token_ids: Sequence[int] | None,
                         block_mask: EncodableMap, spec_group_names: Sequence[str] | None,
                         timeout: float | None) -> None:
        """A ``start_write_cache`` committed: its session, keys, and the mask of the keys it
        left to write (``block_mask`` of the reply)."""

    def on_write_finished(self, instance_id: str, session_id: str, success: BlockMask | None) -> None:
        """A ``finish_write_cache`` committed, with the client's success mask."""

    def on_serving(self, instance_id: str, key: int, nbytes: int, storage_type: str, parent: int | None,
                   now: float) -> None:
        """One copy of ``key`` became readable (a finished write); ``parent``: the previous block."""

    def on_stored(self, instance_id: str, keys: list[int], parent: int | None,
                  token_ids: Sequence[int] | None) -> None:
        """A finished write made these keys readable (one call per write, after its ``on_serving``)."""

    def on_removed(self, instance_id: str, keys: list[int]) -> None:
        """These keys lost their last readable copy (removed, trimmed, lost or evicted)."""

    def on_cleared(self, instance_id: str) -> None:
        """Every block of the instance went at once (``remove_all_cache``, metadata trim, purge)."""

    def on_evicted(self, instance_id: str, keys: list[int], delay_s: float) -> None:
        """The reclaimer evicted these keys; their space is freed after ``delay_s``."""

    def on_pinned(self, instance_id: str, keys: list[int], ttl_s: float, expires_at: float) -> None:
        """A ``pin_cache`` committed: these keys are pinned until ``expires_at`` (wall clock)."""

    def on_unpinned(self, instance_id: str, keys: list[int]) -> None:
        """An ``unpin_cache`` committed, with the keys of its request."""


class Listeners:
    """The registered listeners, called in registration order."""

    def __init__(self) -> None:
        self._all: list[CacheListener] = []

    def add(self, listener: CacheListener) -> None:
        if not isinstance(listener, CacheListener):
            raise TypeError(f"{type(listener).__name__} is not a CacheListener")
        self._all.append(listener)

    def remove(self, listener: CacheListener) -> None:
        self._all.remove(listener)

    def __bool__(self) -> bool:
        return bool(self._all)

    def read(self, instance_id: str, keys: list[int], now: float) -> None:
        for listener in self._all:
            _call(listener, listener.on_read, instance_id, keys, now)

    def served(self, instance_id: str, served: list[tuple[int, Location, int | None]], now: float) -> None:
        """One finished write: ``(key, location, parent)`` per copy that became readable."""
        for key, loc, parent in served:
            for listener in self._all:
                _call(listener, listener.on_serving, instance_id, key, loc.nbytes, loc.type, parent, now)
        keys = [k for k, _, _ in served]
        for listener in self._all:
            _call(listener, listener.on_stored, instance_id, keys, served[0][2], None)

    def lookup(self, instance_id: str, query_type: str, keys: list[int], token_ids: Sequence[int] | None,
               mask: BlockMask | None, sw_size: int, spec_names: Sequence[str] | None) -> None:
        for listener in self._all:
            _call(listener, listener.on_lookup, instance_id, query_type, keys, token_ids, mask, sw_size, spec_names)

    def write_started(self, instance_id: str, session_id: str, keys: list[int], token_ids: Sequence[int] | None,
                      block_mask: EncodableMap, spec_group_names: Sequence[str] | None,
                      timeout: float | None) -> None:
        for listener in self._all:
            _call(listener, listener.on_write_started, instance_id, session_id, keys, token_ids, block_mask,
                  spec_group_names, timeout)

    def write_finished(self, instance_id: str, session_id: str, success: BlockMask | None) -> None:
        for listener in self._all:
            _call(listener, listener.on_write_finished, instance_id, session_id, success)

    def removed(self, instance_id: str, keys: list[int]) -> None:
        for listener in self._all:
            _call(listener, listener.on_removed, instance_id, keys)

    def cleared(self, instance_id: str) -> None:
        for listener in self._all:
            _call(listener, listener.on_cleared, instance_id)

    def evicted(self, instance_id: str, keys: list[int], delay_s: float) -> None:
        for listener in self._all:
            _call(listener, listener.on_evicted, instance_id, keys, delay_s)

    def pinned(self, instance_id: str, keys: list[int], ttl_s: float, expires_at: float) -> None:
        for listener in self._all:
            _call(listener, listener.on_pinned, instance_id, keys, ttl_s, expires_at)

    def unpinned(self, instance_id: str, keys: list[int]) -> None:
        for listener in self._all:
            _call(listener, listener.on_unpinned, instance_id, keys)


def _call(listener: CacheListener, hook: Callable[..., None], *args: object) -> None:
    try:
        hook(*args)
    except Exception:
        log.exception("listener %s.%s failed", type(listener).__name__, hook.__name__)
