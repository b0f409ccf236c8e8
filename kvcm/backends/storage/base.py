"""The storage backend contract: where kvcm hands out space for KV blocks, and how URIs look.

kvcm never moves KV bytes. A storage backend only *allocates* URIs (and the space behind them
when kvcm owns that space, as for ``file`` and ``shm``), accounts usage, frees space on delete
and probes health; its ``inventory`` lets ``CacheManager.check`` compare what it holds with the
metadata. Clients read and write the block bytes at the URIs themselves.

Every backend implements :class:`StorageBackend`; :mod:`kvcm.backends.storage.registry` keeps the
registry keyed by type name. This module also holds what several backends share: a strict spec
reader, safe opening of files in directories others may write, hole punching, and the slot pool
of ``file``/``shm``. The URIs they hand out are :mod:`kvcm.proto.uris`'.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import secrets
import stat
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from kvcm.errors import InvalidArgument
from kvcm.proto.schema import suggest

log = logging.getLogger("kvcm.backends.storage")

T = TypeVar("T")


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


def damaged(backend: object) -> bool:
    """Whether ``backend`` can look into its containers and found one missing or short."""
    return isinstance(backend, SlotStorage) and backend.damaged()


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


# --------------------------------------------------------------------------------------- specs


class SpecReader:
    """Reads one storage spec strictly: every error names the field, unknown fields are refused
    (a typo such as ``key_count_perfile`` must fail at add_storage, not silently use a default).

    It also records what it read, defaults filled in: :meth:`finish` returns that complete,
    normalized spec as plain builtins (the form the registry stores and ``list_storage`` shows).
    An unset optional text reads as ``None`` and is recorded as ``""`` (Tair's "unset"), so
    reading a normalized spec again gives the same spec."""

    def __init__(self, type_name: str, name: str, spec: Mapping[str, Any] | None) -> None:
        if spec is not None and not isinstance(spec, Mapping):
            raise InvalidArgument(f"storage {name!r}: storage_spec must be a map, got {type(spec).__name__}")
        self._where = f"storage {name!r} ({type_name})"
        self._spec = dict(spec or {})
        self._seen: set[str] = set()
        self._values: dict[str, Any] = {}

    def integer(self, key: str, default: int | None = None, minimum: int = 0) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self._bad(key, f"must be >= {minimum}, got {value}")
        return self._keep(key, value)

    def text(self, key: str, default: str | None = None) -> str:
        value = self._get(key, default)
        if not isinstance(value, str) or not value:
            raise self._bad(key, f"must be a non-empty string, got {value!r}")
        return self._keep(key, value)

    def optional_text(self, key: str) -> str | None:
        if self._spec.get(key) in (None, ""):
            self._seen.add(key)
            self._keep(key, "")
            return None
        return self.text(key)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self._bad(key, f"must be true or false, got {value!r}")
        return self._keep(key, value)

    def fail(self, key: str, why: str) -> InvalidArgument:
        """An error naming ``storage_spec.<key>``, for checks beyond the type (raise it)."""
        return self._bad(key, why)

    def finish(self) -> dict[str, Any]:
        """Refuse fields nobody read; return the normalized spec (every field read, in order)."""
        unknown = sorted(set(self._spec) - self._seen)
        if unknown:
            guess = suggest(unknown[0], sorted(self._seen))
            hint = f"did you mean storage_spec.{guess}? " if guess else ""
            raise self._bad(unknown[0], f"unknown field ({hint}valid: {', '.join(sorted(self._seen))})")
        return dict(self._values)

    def _get(self, key: str, default: Any) -> Any:
        self._seen.add(key)
        # None and "" both mean unset, as in Tair's protos (the registry stores "" defaults).
        if self._spec.get(key) not in (None, ""):
            return self._spec[key]
        if default is None:
            raise self._bad(key, "is required")
        return default

    def _keep(self, key: str, value: T) -> T:
        self._values[key] = value
        return value

    def _bad(self, key: str, why: str) -> InvalidArgument:
        return InvalidArgument(f"{self._where}: storage_spec.{key} {why}")


def check_component(where: str, value: str) -> str:
    """A single path component safe to join under a directory (no "/", "..", NUL)."""
    if not value or "/" in value or "\0" in value or value in (".", ".."):
        raise InvalidArgument(f"{where}: {value!r} is not a valid file name")
    return value


# ---------------------------------------------------------------------------------- safe files
#
# A storage directory may be writable by other local users (``/dev/shm``, a shared root), who can
# plant a symlink, a FIFO or a directory at any name kvcm would use. So every open there refuses
# to follow a symlink, never blocks on a FIFO, and checks it got a regular file; every file kvcm
# creates there is new (O_EXCL), private (0600), and named unpredictably unless the name itself is
# the rendezvous (a container, a marker, a lock).

#: Flags of every open in a storage directory (see above).
SAFE_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: The mode of every file kvcm creates in a storage directory (clients run as kvcm's user).
PRIVATE = 0o600


class NotRegularFile(OSError):
    """A name kvcm uses holds something other than a regular file (a FIFO, a device, a directory)."""


def open_regular(path: str, flags: int, mode: int = PRIVATE) -> int:
    """A descriptor of the regular file ``path`` names (created with ``mode`` if ``flags`` say
    O_CREAT). OSError for a symlink (ELOOP), NotRegularFile for anything but a regular file;
    never blocks, whatever was planted there."""
    fd = os.open(path, flags | SAFE_OPEN, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_unique(stem: str) -> tuple[str, int]:
    """A new private file ``<stem><random hex>``, opened read-write: a name nobody can plant
    anything at in advance, and O_EXCL so nothing already there is ever opened."""
    for _ in range(8):  # a collision of 64 random bits means someone planted that very name
        path = f"{stem}{secrets.token_hex(8)}"
        try:
            return path, os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | SAFE_OPEN, PRIVATE)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free name", stem)


def unlink_own(path: str, fd: int) -> None:
    """Unlink ``path`` only while it still names the file open at ``fd`` (where others may write
    the directory, the name could have been replaced since)."""
    try:
        if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
            os.unlink(path)
    except FileNotFoundError:
        pass


# --------------------------------------------------------------------------------------- holes

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def _load_fallocate() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        # fallocate64 takes a 64-bit off_t on every ABI; plain fallocate only on 64-bit ones.
        fn = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _load_fallocate()


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Return the disk (or tmpfs memory) behind ``[offset, offset+length)`` to the filesystem,
    keeping the file size, so a freed slot in a still-used file stops costing space.

    Returns False where unsupported (not Linux, or a filesystem without hole punching, e.g.
    some NFS servers); the slot is still reused, only the space comes back later."""
    if _fallocate is None or length <= 0:
        return False
    if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        log.warning("punching a hole failed: %s", os.strerror(err))
    return False


def slot_runs(slots: Iterable[int]) -> list[tuple[int, int]]:
    """Coalesce slot ids into ``(first, count)`` runs so adjacent frees cost one syscall."""
    runs: list[tuple[int, int]] = []
    for slot in sorted(set(slots)):
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


# --------------------------------------------------------------------------------------- slots


class Container:
    """One file or segment cut into ``slots`` blocks of ``size`` bytes.

    Slot state is a bytearray (1 = used): one byte per slot keeps a 1 GiB segment of 4 KiB
    blocks at 256 KiB, and ``find`` scans it at C speed. Invariant: no free slot lies below
    ``hint``, so the lowest free slot is ``bits.find(0, hint)``.

    ``lost`` marks a container the metadata references but that is gone from disk: its slots
    are accounted (so deletes balance) but never handed out again."""

    __slots__ = ("bits", "free", "hint", "lost", "name", "size", "slots")

    def __init__(self, name: str, size: int, slots: int, lost: bool = False) -> None:
        self.name = name
        self.size = size
        self.slots = slots
        self.bits = bytearray(slots)
        self.free = slots  # number of free slots
        self.hint = 0
        self.lost = lost

    @property
    def used(self) -> int:
        return self.slots - self.free

    def holds(self, slot: int) -> bool:
        """Whether ``slot`` is reserved."""
        return 0 <= slot < self.slots and self.bits[slot] == 1

    def pop_free(self) -> int:
        """The lowest free slot, now used (callers check ``free`` first)."""
        slot = self.bits.find(0, self.hint)
        self.bits[slot] = 1
        self.free -= 1
        self.hint = slot + 1
        return slot

    def mark(self, slot: int, used: bool) -> bool:
        """Set one slot's state; False if it already had it (or is out of range)."""
        if not 0 <= slot < self.slots or self.bits[slot] == used:
            return False
        self.bits[slot] = used
        self.free += -1 if used else 1
        if not used:
            self.hint = min(self.hint, slot)
        return True


class SlotPool:
    """Slot accounting for containers, grouped by block-size class (instances with different
    block sizes never share a container, so a slot offset is always ``slot * size``).

    Purely in memory: it is rebuilt at start-up from the metadata via ``reserve``. Not
    thread-safe by itself; the owning backend holds its lock around every call."""

    def __init__(self) -> None:
        self._containers: dict[str, Container] = {}
        # size -> containers having a free slot (a dict as an insertion-ordered set)
        self._with_free: dict[int, dict[str, Container]] = {}
        self.slots_used = 0
        self.bytes_used = 0
        self.bytes_allocated = 0  # logical size of all containers (sparse: not all on disk)

    def __len__(self) -> int:
        return len(self._containers)

    def __iter__(self) -> Iterator[Container]:
        return iter(list(self._containers.values()))

    def get(self, name: str) -> Container | None:
        return self._containers.get(name)

    def add(self, container: Container) -> None:
        self._containers[container.name] = container
        self.bytes_allocated += container.slots * container.size
        used = container.used
        self.slots_used += used
        self.bytes_used += used * container.size
        self._offer(container)

    def remove(self, container: Container) -> None:
        del self._containers[container.name]
        self._with_free.get(container.size, {}).pop(container.name, None)
        self.bytes_allocated -= container.slots * container.size
        self.slots_used -= container.used
        self.bytes_used -= container.used * container.size

    def take(self, size: int, count: int) -> list[tuple[Container, int]]:
        """Up to ``count`` free slots of existing containers, fullest container first: packing
        freed slots back into busy containers lets the emptiest ones drain and be unlinked."""
        taken: list[tuple[Container, int]] = []
        candidates = self._with_free.get(size, {})
        for container in sorted(candidates.values(), key=lambda c: c.free):
            n = min(count - len(taken), container.free)
            taken.extend((container, container.pop_free()) for _ in range(n))
            self._count(container, n)
            if not container.free:
                del candidates[container.name]
            if len(taken) == count:
                break
        return taken

    def claim(self, container: Container, slot: int) -> bool:
        """Mark one given slot used (recovery); False if it already was."""
        if not container.mark(slot, True):
            return False
        self._count(container, 1)
        if not container.free:
            self._with_free.get(container.size, {}).pop(container.name, None)
        return True

    def put_back(self, container: Container, slot: int) -> bool:
        """Mark one slot free again; False if it was free already or out of range."""
        if not container.mark(slot, False):
            return False
        self._count(container, -1)
        self._offer(container)
        return True

    def grow(self, container: Container, slots: int) -> None:
        """Give ``container`` ``slots`` slots (recovery: the metadata knows of more slots than
        a truncated file still holds)."""
        extra = slots - container.slots
        if extra <= 0:
            return
        container.bits.extend(bytes(extra))
        container.slots = slots
        container.free += extra
        self.bytes_allocated += extra * container.size
        self._offer(container)

    def withdraw(self, container: Container) -> None:
        """Hand out no more slots of ``container`` (it lost its bytes); accounting stays."""
        self._with_free.get(container.size, {}).pop(container.name, None)

    def _offer(self, container: Container) -> None:
        if container.free and not container.lost:
            self._with_free.setdefault(container.size, {})[container.name] = container

    def _count(self, container: Container, delta: int) -> None:
        self.slots_used += delta
        self.bytes_used += delta * container.size
