"""The storage backend contract: where kvcm hands out space for KV blocks, and what it holds.

kvcm never moves KV bytes. A storage backend only *allocates* URIs (and the space behind them
when kvcm owns that space, as for ``file`` and ``shm``), accounts usage, frees space on delete
and probes health; its ``inventory`` lets ``CacheManager.check`` compare what it holds with the
metadata. Clients read and write the block bytes at the URIs themselves.

Every backend implements :class:`StorageBackend`; :mod:`kvcm.backends.storage.registry` keeps the
registry keyed by type name. What several backends share lives beside this module: the strict
spec reader (:mod:`~kvcm.backends.storage.specs`), safe opening of files in directories others
may write and hole punching (:mod:`~kvcm.backends.storage.safe_files`), and the slot pool of
``file``/``shm`` (:mod:`~kvcm.backends.storage.slots`). The URIs they hand out are
:mod:`kvcm.proto.uris`'.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeGuard, runtime_checkable


@runtime_checkable
class StorageBackend(Protocol):
    """One opened storage. Thread-safe: the RPC thread allocates and releases while the deleter
    thread deletes and the health thread probes, so every implementation guards its state with
    its own lock (``health`` never takes it: a slow probe must not stall allocation)."""

    type_name: str  # "file", "shm", "3fs", "mooncake", "tairmempool"
    name: str  # the storage's global_unique_name; the host part of every URI it hands out

    def open(self) -> None:
        """Prepare the storage (create the root, discover existing containers)."""

    def close(self) -> None:
        """Stop handing out space. Never destroys data: a restarted kvcm finds it again."""

    def allocate(self, count: int, size: int) -> list[str]:
        """``count`` URIs for blocks of ``size`` bytes, reserved until released or deleted.

        All or nothing. Raises ``CapacityError`` (NO_STORAGE_AVAILABLE when closed,
        CAPACITY_EXHAUSTED when full) so the caller can fall over to the next storage."""

    def release(self, uris: Iterable[str]) -> None:
        """Give back URIs whose metadata never committed (nothing for an owner to delete)."""

    def reserve(self, uris: Iterable[str]) -> None:
        """Start-up recovery: mark URIs found in the metadata as used (idempotent). Every valid
        URI is reserved; then InvalidArgument reports any bad ones (skip ``sweep`` then)."""

    def delete(self, uris: Iterable[str]) -> list[str]:
        """Free data and slots. Returns deletion tasks for an external owner ([] when freed here)."""

    def exists(self, uri: str) -> bool:
        """Whether ``uri`` is currently reserved here (and its container is present)."""

    def usage(self) -> dict[str, int]:
        """``bytes_used``, ``bytes_capacity`` (0 = unknown/unlimited), ``slots_used``, ..."""

    def health(self) -> bool:
        """A real probe (write/read/remove a probe object); never raises."""

    def sweep(self) -> int:
        """After recovery (``reserve``): remove containers no reserved URI points at; count removed."""

    def inventory(self) -> Inventory:
        """Everything this storage holds reserved, and what lies on disk: what
        ``CacheManager.check`` compares with the metadata. Costs a pass over every reserved slot."""



@runtime_checkable
class SlotStorage(Protocol):
    """The optional capability of a storage of fixed-size slots in containers it owns and can
    look into (``file``, ``shm``); checked with ``isinstance``. Storages kvcm cannot look into
    (external ones) only learn of lost blocks from clients, and never hand a slot on."""

    def damaged(self) -> bool:
        """Whether a container was found missing or short (its blocks' bytes are gone)."""
        ...

    def lost(self, uris: Iterable[str]) -> set[str]:
        """The URIs among ``uris`` whose bytes are gone."""
        ...

    def rescan(self) -> int:
        """Look at the containers again; how many are newly damaged."""
        ...

    def reusable(self, uris: Sequence[str], sizes: Sequence[int]) -> list[bool]:
        """Per slot: whether it can take a new block as it is (in-line eviction hands a slot
        from its victim to a writer)."""
        ...

    def intact(self) -> bool:
        """Whether :meth:`reusable` would say yes to every slot a record names (open, no
        container lost or damaged)."""
        ...

    def slots_per_container(self, size: int) -> int:
        """Slots of ``size`` bytes one container holds (a write's cost estimate)."""
        ...


_SLOT_CLASSES: dict[type, bool] = {}  # one entry per backend class kvcm has (a handful)


def is_slot_storage(backend: object) -> TypeGuard[SlotStorage]:
    """``isinstance(backend, SlotStorage)``, decided once per class: a Protocol's own check
    costs about 10 µs on Python 3.11, and write requests ask it per spec."""
    cls = type(backend)
    known = _SLOT_CLASSES.get(cls)
    if known is None:
        known = _SLOT_CLASSES[cls] = isinstance(backend, SlotStorage)
    return known


def damaged(backend: object) -> bool:
    """Whether ``backend`` can look into its containers and found one missing or short."""
    return is_slot_storage(backend) and backend.damaged()


# ---------------------------------------------------------------------------------- inventory


@dataclass(frozen=True)
class Slot:
    """Where one reserved URI's bytes live: ``container`` ("" for a store kvcm does not own),
    the byte range ``[offset, offset + size)`` in it."""

    container: str
    offset: int
    size: int


@dataclass(frozen=True)
class Inventory:
    """One storage's own view of what it holds, for comparing it with the metadata.

    ``reserved`` lists every reserved URI; ``containers`` the containers it accounts, with the
    number of slots used in each; ``on_disk`` the containers present with the names kvcm gives
    them, and their sizes in bytes (None where the space belongs to another system, so there
    is nothing to list); ``orphans`` the containers found at open that no reserved URI
    claimed and no sweep removed yet."""

    reserved: Mapping[str, Slot]
    containers: Mapping[str, int]
    on_disk: Mapping[str, int] | None
    orphans: frozenset[str]
    slots_used: int
    bytes_used: int
