"""Storages of fixed-size slots in container files of one directory (``file``, ``shm``).

:class:`DirectoryStorage` holds the slot machinery: containers packed by the slot pool
(:mod:`~kvcm.backends.storage.slots`), freed slots reused first, a partially freed container
getting the freed ranges punched out (``fallocate``), and a fully freed one unlinked, so disk
space really returns; recovery of the slots the metadata names at start-up; and the containers
found missing or short (lost blocks). Its subclasses name the containers and format the URIs
(:mod:`~kvcm.backends.storage.file`, :mod:`~kvcm.backends.storage.shm`: a segment in
``/dev/shm`` is just a file in a tmpfs directory).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence

from kvcm.backends.storage.base import Inventory, Slot
from kvcm.backends.storage.ownership import Marker, Owner, claim, standalone_owner
from kvcm.backends.storage.safe_files import (
    PRIVATE,
    SAFE_OPEN,
    KeptDescriptors,
    create_unique,
    punch_hole,
    unlink_own,
)
from kvcm.backends.storage.slots import Container, SlotPool, slot_runs
from kvcm.backends.storage.specs import Spec
from kvcm.errors import CapacityError, Code, InvalidArgument, KvcmError, ServerError
from kvcm.lockfile import drop_lock_file, hold_lock_file

log = logging.getLogger("kvcm.backends.storage")

_NO_SPACE = {28, 122}  # ENOSPC, EDQUOT: the storage is full, not broken
_STATVFS_TTL = 0.05  # seconds a free-space reading is reused (charged with allocations meanwhile)

_PUNCH_FDS = 16  # container descriptors a storage keeps open for freeing


class DirectoryStorage(ABC):
    """Slot allocation over sparse container files in one directory.

    Thread ownership: shared by the RPC thread (allocate, release), the deleter thread (delete)
    and the health thread (health). Slot state and container files are changed only under
    ``self._lock``; holes are punched under it too, because a slot returned to the free set
    before its hole is punched could be handed out, written, and then zeroed. ``health`` takes
    no lock. Subclasses provide naming and URI format (the ``_`` hooks below).
    """

    type_name = ""
    container_label = "containers"  # the usage() key counting containers
    spec_source: Mapping[str, object] | None = None  # the spec it was opened with (set by open_backend)
    spec: Spec  # the normalized spec (``read_spec``), set by the subclass

    def __init__(self, name: str, directory: str, capacity_bytes: int, owner: Owner | None = None) -> None:
        self.name = name
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.owner = owner or standalone_owner(self.type_name, name)
        self.storage_id = self.owner.storage_id  # part of every container name this storage makes
        self.previous_owner: Marker | None = None  # the foreign marker this open adopted or discarded
        self._lock = threading.Lock()
        self._pool = SlotPool()
        # Found on disk at open, no reserved URI yet: name -> bytes. Ours (named with our id) are
        # swept after recovery; the others (older names, other ids) are served if the metadata
        # names them and otherwise left alone: kvcm cannot prove it created them.
        self._unclaimed: dict[str, int] = {}
        self._foreign: dict[str, int] = {}
        # Containers whose bytes are (partly) gone: name -> bytes still on disk (0 = missing).
        # Their slots past that size are lost; nothing new is allocated in them.
        self._damaged: dict[str, int] = {}
        self._punch_fds = KeptDescriptors(_PUNCH_FDS)  # of containers, for freeing
        self._found_size: dict[str, int] = {}  # bytes on disk of containers adopted at start-up
        self._next_index = 0
        self._opened = False
        self._free_seen, self._free_at = 0, -1.0  # the last statvfs reading (_free_disk_bytes)
        # Until ``reserve`` ran, the URIs freed before it saw them: a storage reopened while
        # serving is recovered from a walk of the metadata that a concurrent free may overtake,
        # and a slot freed once must not be reserved again by that walk.
        self._reserved = False
        self._freed_early: set[str] = set()

    # ----------------------------------------------------------------- hooks for subclasses

    @abstractmethod
    def _slots_per_container(self, size: int) -> int:
        ...

    def slots_per_container(self, size: int) -> int:
        """How many blocks of ``size`` bytes share one container (file or segment): what a write
        costs in container creations per block, for the dispatcher's estimate."""
        try:
            return self._slots_per_container(size)
        except KvcmError:  # a size this storage cannot hold: the write will fall over elsewhere
            return 1

    @abstractmethod
    def _container_name(self, size: int, index: int) -> str:
        ...

    @abstractmethod
    def _scan(self) -> Iterator[tuple[str, int, str]]:
        """``(container name, index, storage id or "")`` of every entry in the directory named
        the way a kvcm storage names its containers (never following a symlink)."""
        ...

    @abstractmethod
    def _entries(self) -> Iterator[str]:
        """Names in the directory that belong to this storage's namespace (for shm: those
        starting with its prefix), kvcm's own control files included."""
        ...

    @abstractmethod
    def _index_of(self, container_name: str) -> int:
        ...

    @abstractmethod
    def _uri(self, container: Container, slot: int) -> str:
        ...

    @abstractmethod
    def _locate(self, uri: str) -> tuple[str, int, int]:
        """``(container name, slot, size)`` of one of our URIs; InvalidArgument otherwise."""
        ...

    def _prepare_directory(self) -> None:
        if not os.path.isdir(self.directory):
            raise ServerError(f"storage {self.name!r}: {self.directory} is not a directory", Code.IO_ERROR)

    def _probe_stem(self) -> str:
        """The start of a probe file's name; a random part follows (see :meth:`health`)."""
        return ".kvcm-probe-"

    def _lock_name(self) -> str:
        return ".kvcm-lock"

    def _marker_name(self) -> str:
        return ".kvcm-storage"

    def _is_control(self, name: str) -> bool:
        """kvcm's own lock, marker, probe and temp files (not data)."""
        return name.startswith(".kvcm-")

    # ----------------------------------------------------------------------------- lifecycle

    def path_of(self, container_name: str) -> str:
        return os.path.join(self.directory, container_name)

    def open(self) -> None:
        with self._lock:
            if self._opened:
                return
            self._prepare_directory()
            lock = self.path_of(self._lock_name())
            hold_lock_file(lock, f"storage {self.name!r}", f"{self.type_name} storage {self.name!r} ({lock})")
            try:
                self._claim()
                self._find_existing()
            except BaseException:
                drop_lock_file(lock)
                raise
            self._opened = True

    def _claim(self) -> None:
        """Prove the directory is this storage's (ownership marker), or refuse to touch it."""
        where = f"{self.type_name} storage {self.name!r}: {self._namespace_label()}"
        data = sum(1 for entry in self._entries() if not self._is_control(entry))
        previous = claim(self.path_of(self._marker_name()), self.owner, self.name, where, data)
        self.previous_owner = previous
        if previous is not None and self.owner.discards(previous):
            if previous.authentic or previous.takeover:  # signed by this data dir, or by this host's kvcm
                self._discard(previous.ids())
            else:  # anyone can write a marker: only a signed one vouches for what kvcm named
                log.warning("storage %s: the marker found in %s is not signed by this data dir; nothing discarded",
                            self.name, self._namespace_label())

    def _namespace_label(self) -> str:
        return self.directory

    def _discard(self, storage_ids: set[str]) -> None:
        """Delete the containers previous owners named with their ids: provably kvcm's (marker
        and name agree); anything else in the directory stays."""
        removed = 0
        for name, _, sid in list(self._scan()):
            if sid and sid in storage_ids:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path_of(name))
                    removed += 1
        log.warning("storage %s: discarded %d container(s) of storage id(s) %s", self.name, removed,
                    ", ".join(sorted(storage_ids)))

    def _find_existing(self) -> None:
        """Note containers left by an earlier run; ``reserve`` adopts them, ``sweep`` drops ours."""
        for name, index, sid in self._scan():
            size = os.stat(self.path_of(name), follow_symlinks=False).st_size
            if sid == self.storage_id:
                self._unclaimed[name] = size
                self._next_index = max(self._next_index, index + 1)
            else:
                self._foreign[name] = size

    def close(self) -> None:
        """Stop allocating. Files stay: they hold data a restarted kvcm will serve again."""
        with self._lock:
            self._punch_fds.close()
            if self._opened:
                self._opened = False
                drop_lock_file(self.path_of(self._lock_name()))

    # ---------------------------------------------------------------------------- allocation

    def allocate(self, count: int, size: int) -> list[str]:
        if count < 0 or size <= 0:
            raise InvalidArgument(f"allocate needs count >= 0 and size > 0, got {count}, {size}")
        slots_per = self._slots_per_container(size)
        with self._lock:
            self._check_can_allocate(count * size)
            taken = self._pool.take(size, count)
            try:
                while len(taken) < count:
                    self._create(size, slots_per)
                    taken.extend(self._pool.take(size, count - len(taken)))
            except BaseException:
                self._free_locked(taken)
                raise
            return [self._uri(container, slot) for container, slot in taken]

    def _check_can_allocate(self, nbytes: int) -> None:
        if not self._opened:
            raise CapacityError(f"storage {self.name!r} is closed", Code.NO_STORAGE_AVAILABLE)
        if self.capacity_bytes and self._pool.bytes_used + nbytes > self.capacity_bytes:
            raise CapacityError(
                f"storage {self.name!r}: {nbytes} more bytes exceed capacity_bytes "
                f"{self.capacity_bytes} ({self._pool.bytes_used} used)",
                Code.CAPACITY_EXHAUSTED,
            )
        # Files are sparse, so creating them always succeeds; check the real free space now
        # rather than letting clients hit ENOSPC halfway through writing their blocks.
        if nbytes and self._free_disk_bytes(nbytes) < nbytes:
            raise CapacityError(f"storage {self.name!r}: filesystem has < {nbytes} bytes free", Code.CAPACITY_EXHAUSTED)

    def _free_disk_bytes(self, nbytes: int) -> int:
        """Free bytes of the filesystem, less what was handed out since the last look.

        ``statvfs`` costs as much as the rest of an allocation, so a reading is reused for
        :data:`_STATVFS_TTL` seconds, charged with every allocation made meanwhile."""
        now = time.monotonic()
        if now - self._free_at > _STATVFS_TTL or self._free_seen < nbytes:
            try:
                st = os.statvfs(self.directory)
            except OSError as exc:
                raise CapacityError(f"storage {self.name!r}: {exc}", Code.NO_STORAGE_AVAILABLE) from exc
            self._free_seen, self._free_at = st.f_bavail * st.f_frsize, now
        free = self._free_seen
        if free >= nbytes:
            self._free_seen -= nbytes
        return free

    def _create(self, size: int, slots: int) -> Container:
        """A new sparse container file (never reusing a name: a late delete can't hit it)."""
        while True:
            name = self._container_name(size, self._next_index)
            self._next_index += 1
            path = self.path_of(name)
            if self._pool.get(name) is not None:
                continue  # a lost container keeps its name until its URIs are deleted
            try:
                self._make_parent(path)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | SAFE_OPEN, PRIVATE)
            except FileExistsError:
                continue  # someone left a file with this name; skip it, sweep() decides its fate
            except OSError as exc:
                raise self._io_error("create", path, exc) from exc
            break
        try:
            os.ftruncate(fd, slots * size)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise self._io_error("size", path, exc) from exc
        finally:
            os.close(fd)
        container = Container(name, size, slots)
        self._pool.add(container)
        return container

    def _make_parent(self, path: str) -> None:
        """The container's directory, never a symlink leading out of the storage."""
        parent = os.path.dirname(path)
        if parent != self.directory:
            os.makedirs(parent, 0o700, exist_ok=True)
            if os.path.islink(parent):
                raise OSError(40, "is a symbolic link; kvcm does not follow links out of its storage", parent)

    def _io_error(self, what: str, path: str, exc: OSError) -> KvcmError:
        if exc.errno in _NO_SPACE:
            return CapacityError(f"storage {self.name!r}: {what} {path}: {exc.strerror}", Code.CAPACITY_EXHAUSTED)
        return ServerError(f"storage {self.name!r}: {what} {path}: {exc.strerror}", Code.IO_ERROR)

    def reusable(self, uris: Sequence[str], sizes: Sequence[int]) -> list[bool]:
        """Per URI: whether its slot can take a new block of ``sizes[i]`` bytes as it is.

        For a slot whose copy the caller's transaction drops (in-line eviction without a grace
        delay) and whose URI the same transaction gives a new block: the slot then stays
        reserved throughout instead of being freed (hole punched) and allocated again. Yes
        only for a slot :meth:`allocate` could hand out had it been freed: reserved, of that
        size, in a container still in service (not lost or damaged) of an open storage.
        Changes nothing; a malformed or foreign URI is just not reusable."""
        located: list[tuple[str, int, int] | None] = []
        for uri in uris:
            try:
                located.append(self._locate(uri))
            except KvcmError:
                located.append(None)
        out: list[bool] = []
        with self._lock:
            for where, size in zip(located, sizes):
                container = None if where is None or not self._opened else self._pool.get(where[0])
                out.append(container is not None and where is not None and not container.lost
                           and container.size == where[2] == size and container.holds(where[1]))
        return out

    def intact(self) -> bool:
        """Open, with no container lost or damaged: then every slot the metadata names is
        reserved in a container in service (what ``reserve`` at open and every free since keep
        true), and :meth:`reusable` would say yes to any of them for a block of its size."""
        return self._opened and not self._damaged

    # ------------------------------------------------------------------------------- freeing

    def release(self, uris: Iterable[str]) -> None:
        # A session that failed may still have written some bytes: free exactly like delete.
        self.delete(uris)

    def delete(self, uris: Iterable[str]) -> list[str]:
        """Free slots (punching their space out) and unlink emptied files. Unknown URIs are
        ignored so a retried delete is harmless; malformed or foreign ones raise first."""
        uris = list(uris)
        located = [self._locate(uri) for uri in uris]
        with self._lock:
            if not self._reserved:
                self._freed_early.update(u for u, (name, _, _) in zip(uris, located) if self._pool.get(name) is None)
            taken = [(c, slot) for name, slot, _ in located if (c := self._pool.get(name)) is not None]
            self._free_locked(taken)
        return []

    def _free_locked(self, taken: Iterable[tuple[Container, int]]) -> None:
        touched: dict[str, tuple[Container, list[int]]] = {}
        for container, slot in taken:
            if self._pool.put_back(container, slot):
                touched.setdefault(container.name, (container, []))[1].append(slot)
        for container, slots in touched.values():
            if container.used == 0:
                self._drop(container)
            elif not container.lost:
                self._punch(container, slots)

    def _drop(self, container: Container) -> None:
        self._pool.remove(container)
        self._damaged.pop(container.name, None)
        self._punch_fds.drop(container.name)
        try:
            os.unlink(self.path_of(container.name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("storage %s: cannot remove %s: %s", self.name, container.name, exc)

    def _punch(self, container: Container, slots: list[int]) -> None:
        fd = self._punch_fd(container.name)
        if fd is None:
            return
        for first, n in slot_runs(slots):
            if not punch_hole(fd, first * container.size, n * container.size):
                break  # unsupported here: the slot is reused later, only the space waits

    def _punch_fd(self, name: str) -> int | None:
        """A descriptor of container ``name`` for freeing, kept open (:class:`KeptDescriptors`)."""
        try:
            return self._punch_fds.get(name, self.path_of(name))
        except OSError as exc:
            log.warning("storage %s: cannot open %s to free slots: %s", self.name, name, exc)
            return None

    # ------------------------------------------------------------------------------ recovery

    def reserve(self, uris: Iterable[str]) -> None:
        """Mark URIs from the metadata as used, adopting the files found at open(). Every valid
        URI is reserved even if others are bad (a skipped one could be handed out again over
        live data); then InvalidArgument reports the bad ones, and the caller skips sweep()."""
        bad = 0
        with self._lock:
            for uri in uris:
                if uri in self._freed_early:
                    continue
                try:
                    self._reserve_one(uri)
                except KvcmError as exc:
                    bad += 1
                    log.warning("storage %s: not reserving: %s", self.name, exc)
            self._reserved = True
            self._freed_early.clear()
        if bad:
            raise InvalidArgument(f"storage {self.name!r}: {bad} uri(s) could not be reserved (see log)")

    def _reserve_one(self, uri: str) -> None:
        name, slot, size = self._locate(uri)
        container = self._pool.get(name) or self._adopt(name, slot, size)
        if container.size == size and slot >= container.slots and name in self._found_size:
            self._pool.grow(container, slot + 1)  # the file is shorter than its blocks: damaged below
        if container.size != size or slot >= container.slots:
            raise InvalidArgument(
                f"{uri!r}: slot {slot} of size {size} does not fit {name} "
                f"({container.slots} slots of {container.size} bytes)"
            )
        self._pool.claim(container, slot)
        present = self._found_size.get(name)
        if present is not None and (slot + 1) * size > present and name not in self._damaged:
            log.warning("storage %s: %s is shorter (%d bytes) than its blocks need", self.name, name, present)
            self._damage(container, present)

    def _adopt(self, name: str, slot: int, size: int) -> Container:
        on_disk = self._unclaimed.pop(name, None)
        if on_disk is None:
            on_disk = self._foreign.pop(name, None)
        if on_disk is None:
            # The metadata outlived the data (e.g. shm after a reboot). Account the slots so
            # deletes balance, but never hand out space in it and report its URIs as lost.
            log.warning("storage %s: %s is referenced by metadata but missing", self.name, name)
            container = Container(name, size, max(self._slots_per_container(size), slot + 1), lost=True)
            self._damaged[name] = 0
        else:
            container = Container(name, size, max(on_disk // size, slot + 1))
            self._found_size[name] = on_disk  # checked against every slot reserve() claims in it
        self._pool.add(container)
        self._next_index = max(self._next_index, self._index_of(name) + 1)
        return container

    def sweep(self) -> int:
        """Remove files found at open() that no reserved URI claimed (a crash between allocate
        and the metadata commit leaves such orphans). Call once, after recovery."""
        with self._lock:
            self._found_size.clear()
            orphans = list(self._unclaimed)
            self._unclaimed.clear()
            for name in orphans:
                try:
                    os.unlink(self.path_of(name))
                except OSError as exc:
                    log.warning("storage %s: cannot remove orphan %s: %s", self.name, name, exc)
        return len(orphans)

    # ------------------------------------------------------------------------- observation

    def exists(self, uri: str) -> bool:
        name, slot, size = self._locate(uri)
        with self._lock:
            container = self._pool.get(name)
            present = self._damaged.get(name)
            reserved = container is not None and container.holds(slot)
            intact = present is None or (slot + 1) * size <= present
        return reserved and intact and os.path.exists(self.path_of(name))

    # -------------------------------------------------------------------------- lost blocks

    def damaged(self) -> bool:
        """Whether any container is known to have lost bytes (then :meth:`lost` may say yes)."""
        return bool(self._damaged)

    def lost(self, uris: Iterable[str]) -> set[str]:
        """The URIs among ``uris`` whose bytes are gone: their container vanished, or is too
        short to hold their slot. Malformed or foreign URIs are not ours to judge."""
        if not self._damaged:
            return set()
        out: set[str] = set()
        with self._lock:
            for uri in uris:
                try:
                    name, slot, size = self._locate(uri)
                except KvcmError:
                    continue
                present = self._damaged.get(name)
                if present is not None and (slot + 1) * size > present:
                    out.add(uri)
        return out

    def rescan(self) -> int:
        """Look at every container on disk; note those that vanished or shrank since. Returns
        how many became damaged. Stats run outside the lock (a slow mount must not stall
        allocation); a container dropped meanwhile is skipped."""
        with self._lock:
            expected = [(c.name, c.slots * c.size) for c in self._pool if c.name not in self._damaged]
        newly = 0
        for name, need in expected:
            try:
                present = os.stat(self.path_of(name), follow_symlinks=False).st_size
            except FileNotFoundError:
                present = 0
            except OSError:
                continue  # an unreadable mount is the health probe's to report
            if present >= need:
                continue
            with self._lock:
                container = self._pool.get(name)
                if container is None or name in self._damaged:
                    continue
                log.warning("storage %s: %s %s", self.name, name, "vanished" if not present else f"shrank to {present} bytes")
                self._damage(container, present)
                newly += 1
        return newly

    def _damage(self, container: Container, present: int) -> None:
        """Only ``present`` bytes of ``container`` remain: its later slots are lost, and no new
        block goes into it (under the lock)."""
        self._damaged[container.name] = present
        container.lost = True
        self._pool.withdraw(container)
        self._punch_fds.drop(container.name)  # a vanished file's space is held while a descriptor is open

    def inventory(self) -> Inventory:
        """Every reserved slot as its URI, and the kvcm-named containers on disk, read under the
        lock so no allocation or free lands between the two."""
        with self._lock:
            reserved: dict[str, Slot] = {}
            containers: dict[str, int] = {}
            for container in self._pool:
                containers[container.name] = container.used
                slot = container.bits.find(1)
                while slot >= 0:  # one step per used slot: a big, mostly free segment costs little
                    reserved[self._uri(container, slot)] = Slot(container.name, slot * container.size, container.size)
                    slot = container.bits.find(1, slot + 1)
            on_disk: dict[str, int] = {}
            for name, _, sid in self._scan():
                if sid != self.storage_id and self._pool.get(name) is None:
                    continue  # not this storage's name, and no recorded block lives in it: left alone
                with contextlib.suppress(FileNotFoundError):
                    on_disk[name] = os.stat(self.path_of(name)).st_size
            return Inventory(reserved, containers, on_disk, frozenset(self._unclaimed),
                             self._pool.slots_used, self._pool.bytes_used)

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {
                "bytes_used": self._pool.bytes_used,
                "bytes_capacity": self.capacity_bytes,
                "slots_used": self._pool.slots_used,
                "bytes_allocated": self._pool.bytes_allocated,
                self.container_label: len(self._pool),
                "orphans": len(self._unclaimed),
                "foreign": len(self._foreign),
                "lost": len(self._damaged),
            }

    def health(self) -> bool:
        """Write, read back and remove a probe file. Never creates the directory: a vanished
        NFS mount point must read as unhealthy, not be papered over with a local directory.

        The probe file is new (O_EXCL) and randomly named: whatever others planted in the
        directory (a symlink to a file to truncate, a directory, a FIFO) is never opened."""
        if not self._opened:
            return False
        payload = os.urandom(64)
        try:
            path, fd = create_unique(self.path_of(self._probe_stem()))
            try:
                ok = os.write(fd, payload) == len(payload) and os.pread(fd, len(payload), 0) == payload
            finally:
                unlink_own(path, fd)
                os.close(fd)
        except OSError as exc:
            log.info("storage %s: health probe failed: %s", self.name, exc)
            return False
        return ok
