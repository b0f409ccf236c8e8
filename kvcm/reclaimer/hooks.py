"""What the reclaimer needs of the cache (:class:`CacheHooks`), and the optional capabilities it
looks for, each a ``Protocol`` checked with ``isinstance``: soft pins (:class:`PinnedCache`),
usage net of frees (:class:`ExactUsage`), a deleter queue whose head it can watch
(:func:`deleter_head`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from kvcm.backends.metastore.base import MetaStore, from_u64
from kvcm.cache.deleter import DB as DELETES
from kvcm.cache.listeners import CacheListener


class CacheHooks(Protocol):
    """The part of ``kvcm.cache.manager.CacheManager`` the reclaimer uses; optional capabilities
    are :class:`PinnedCache` and :class:`ExactUsage` (and a deleter whose head it watches:
    :func:`deleter_head`)."""

    clock: Callable[[], float]

    def add_listener(self, listener: CacheListener) -> None: ...
    def usage(self, group: str) -> Mapping[str, Any]: ...
    def evict(self, instance_id: str, keys: list[int], storage_type: str | None = None) -> int: ...
    def instances_of_group(self, group: str) -> list[str]: ...
    def serving_keys(self, instance_id: str) -> Iterable[tuple[Any, ...]]: ...


class PinView(Protocol):
    """``manager.pins`` (:mod:`kvcm.cache.pins`): blocks no policy may pick while pinned."""

    def is_pinned(self, instance_id: str, key: int, now: float) -> bool: ...


@runtime_checkable
class PinnedCache(Protocol):
    """The optional capability of a cache with soft pins; checked with ``isinstance``."""

    pins: PinView


@runtime_checkable
class ExactUsage(Protocol):
    """The optional capability of a cache that knows its usage less what is being freed;
    without it the reclaimer subtracts its own in-flight evictions."""

    def usage_net_of_frees(self, groups: Iterable[str]) -> Mapping[str, tuple[int, dict[str, int]]]: ...


@runtime_checkable
class DueWatch(Protocol):
    """A deleter that tells the due time of its oldest pending delete (None: queue empty)."""

    def next_due(self) -> float | None: ...


@runtime_checkable
class HasDeleter(Protocol):
    """A cache with a deleter; what the reclaimer can watch of it is :class:`DueWatch`."""

    deleter: object


@runtime_checkable
class StoredDeletes(Protocol):
    """A cache whose deleter keeps its queue in the store (:mod:`kvcm.cache.deleter`'s table,
    keyed ``u64(due_ms) + u64(seq)``, in due order)."""

    deleter: object
    store: MetaStore | None


def deleter_head(manager: object) -> Callable[[], float | None] | None:
    """A probe for the due time of the deleter's oldest pending delete (None: queue empty), or
    None when the manager has no deleter queue to look at (test doubles).

    The deleter frees in due order, so every delete due *before* the head is done: that tells
    the reclaimer exactly when bytes it evicted stop counting in usage, however far the deleter
    lags. Uses the deleter's ``next_due()`` when it has one (:class:`DueWatch`), else reads the
    head of the store's queue (:class:`StoredDeletes`).
    """
    if isinstance(manager, HasDeleter) and isinstance(manager.deleter, DueWatch):
        return manager.deleter.next_due
    if not isinstance(manager, StoredDeletes) or manager.deleter is None or manager.store is None:
        return None
    store = manager.store

    def head() -> float | None:
        with store.read() as view:
            for key, _ in view.scan(DELETES, limit=1):
                return from_u64(key[:8]) / 1000.0
        return None

    return head
