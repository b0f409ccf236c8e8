"""Where blocks' bytes are: the open descriptors and mapped segments the handlers cache
(:class:`HandleCache`), and the remembered :class:`Place` of each block in them that
:class:`~kvcm.blocks.io.BlockIO`'s hot path reads.

An evicted descriptor or mapping is closed only when the last operation using it lets go of it
(reference counting), never under a running copy.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from kvcm.errors import Code, InvalidArgument, NotFound, ServerError

OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
_PLACES_MAX = 16384  # the places one handle remembers (one per block it holds; a few MB at most)


class Place:
    """Where one URI's bytes are, as its handler found them: bytes ``start:end`` of an open
    descriptor (``file``: ``handle``) or of a mapped segment (``shm``: the mapping and its
    view, ``map`` and ``view``). The place holds them itself, so the hot path reads one
    attribute instead of going through the cache (a weak reference and a flag cost most of the
    SDK's time next to a 64 KiB copy). The cache alone still decides how many descriptors and
    mappings stay open: a handle it lets go (evicted, unlinked, cleared) clears itself from
    every place that uses it (:meth:`Handle.retire`), so it is never used from here again even
    while a running I/O still holds it, and the URI takes the full path; a mapping closed
    meanwhile raises ``ValueError`` on use, which sends it there too.

    A slotted class, not a NamedTuple: its attributes are read on every hot-path I/O, and slot
    reads are the interpreter's cheapest."""

    __slots__ = ("end", "handle", "map", "path", "size", "start", "view")

    def __init__(self, start: int, size: int, path: str) -> None:
        self.handle: Fd | None = None  # file: the descriptor's handle, None once let go
        self.map: mmap.mmap | None = None  # shm: the segment's mapping and view, None once let go
        self.view: memoryview | None = None
        self.start = start
        self.end = start + size
        self.size = size
        self.path = path  # for error messages

    def write(self, data: memoryview, handle: Fd) -> None:
        """Finish a file write the hot path began (``handle``: the one it took from here)."""
        try:
            if os.pwrite(handle.fd, data, self.start) != self.size:
                pwrite_rest(handle.fd, data, self.start)
        except OSError as exc:
            raise io_error("write", self.path, exc) from exc

    def read_into(self, out: memoryview | bytearray, handle: Fd) -> None:
        """Finish a file read the hot path began (see :meth:`write`)."""
        try:
            if os.preadv(handle.fd, [out], self.start) != self.size:
                pread_rest(handle.fd, memoryview(out), self.start, self.path)
        except OSError as exc:
            raise io_error("read", self.path, exc) from exc




def io_error(what: str, path: str, exc: OSError) -> ServerError | NotFound:
    if isinstance(exc, FileNotFoundError):
        return NotFound(f"{what} {path}: no such file (deleted, or the storage is mounted elsewhere on this host)")
    return ServerError(f"{what} {path}: {exc.strerror or exc}", Code.IO_ERROR)



class Handle(ABC):
    """What the caches keep open (a descriptor, a mapping), and the remembered places that use
    it: each place holds what it needs of the handle itself (one attribute read on the hot
    path), and the handle clears that from all of them when its cache lets it go."""

    __slots__ = ("__weakref__", "live", "places")

    def __init__(self) -> None:
        self.live = True  # false once its cache let it go
        # The places that use this handle, by (offset, size): one per block, so bounded by the
        # blocks it holds however often BlockIO forgets and remembers them.
        self.places: dict[tuple[int, int], Place] = {}

    def place(self, start: int, size: int, path: str) -> Place:
        """The remembered place of bytes ``start:start+size``."""
        found = self.places.get((start, size))
        if found is None:
            found = Place(start, size, path)
            self._fill(found)
            if len(self.places) >= _PLACES_MAX:
                _let_go(list(self.places.values()))
                self.places.clear()
            self.places[(start, size)] = found
            if not self.live:  # retired meanwhile (another thread's eviction): never used
                _let_go([found])
        return found

    @abstractmethod
    def _fill(self, place: Place) -> None:
        """Give a new place what it needs of this handle."""

    def retire(self) -> None:
        """Its cache let it go: cleared from every place that uses it (``live`` first, so a
        place made meanwhile sees it), so none uses it again, even while a running I/O still
        holds it."""
        self.live = False
        _let_go(list(self.places.values()))
        self.places.clear()


def _let_go(places: list[Place]) -> None:
    for place in places:
        place.handle = place.map = place.view = None


class Fd(Handle):
    """One open descriptor, closed when the last reference goes: an evicted entry is never
    closed under a pwrite still using it (and its number never reused meanwhile)."""

    __slots__ = ("fd", "size")

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd
        self.size = -1

    def _fill(self, place: Place) -> None:
        place.handle = self  # the handle, never its number: a closed number can be reused

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class Map(Handle):
    """One segment mapped whole; unmapped when the last reference (a running copy) goes."""

    __slots__ = ("fd", "map", "view")

    def __init__(self, fd: Fd) -> None:
        super().__init__()
        self.fd = fd  # kept to tell an unlinked segment (st_nlink 0) from a live one
        self.map = mmap.mmap(fd.fd, fd.size)
        self.view = memoryview(self.map)

    def _fill(self, place: Place) -> None:
        place.map, place.view = self.map, self.view

    def __del__(self) -> None:
        view, mapped = getattr(self, "view", None), getattr(self, "map", None)  # None if __init__ failed
        try:
            if view is not None:
                view.release()
            if mapped is not None:
                mapped.close()
        except BufferError:
            # A copy on another thread still holds a slice of the view (places hold the view,
            # not this handle): the mapping goes with the mmap object once that copy is done.
            pass


K = TypeVar("K", bound=Hashable)
H = TypeVar("H", bound="Handle")


class HandleCache(Generic[K, H]):
    """Path -> open object, bounded. Hits take no lock (a dict read is atomic); misses and
    evictions take it. On a miss, entries whose file was unlinked (kvcm freed the container) are
    dropped first, so a cached handle never pins freed disk or tmpfs memory for long."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self.items: dict[K, H] = {}

    def get(self, key: K, make: Callable[[K], H], nlink: Callable[[H], int]) -> H:
        item = self.items.get(key)
        if item is not None:
            return item
        with self._lock:
            item = self.items.get(key)
            if item is None:
                self._drop_unlinked(nlink)
                item = make(key)
                while len(self.items) >= self._limit:
                    self.items.pop(next(iter(self.items))).retire()  # the oldest
                self.items[key] = item
            return item

    def clear(self) -> None:
        with self._lock:
            for item in self.items.values():
                item.retire()
            self.items.clear()

    def _drop_unlinked(self, nlink: Callable[[H], int]) -> None:
        for path, item in list(self.items.items()):
            try:
                gone = nlink(item) == 0
            except OSError:
                gone = True
            if gone:
                self.items.pop(path).retire()


def open_regular(path: str, flags: int, dir_fd: int | None = None) -> Fd:
    handle = Fd(os.open(path, flags, dir_fd=dir_fd))  # closes it again if anything below raises
    st = os.fstat(handle.fd)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(f"{path} is not a regular file")
    handle.size = st.st_size
    return handle



def nlink(item: Fd | Map) -> int:
    fd = item.fd if isinstance(item, Fd) else item.fd.fd
    return os.fstat(fd).st_nlink


def pwrite_rest(fd: int, data: memoryview, offset: int) -> None:
    """Finish a short write (signals, NFS) by writing the whole block again from its start:
    positional, so rewriting the part already written is harmless."""
    done = os.pwrite(fd, data, offset)
    while done < len(data):
        wrote = os.pwrite(fd, data[done:], offset + done)
        if wrote <= 0:
            raise OSError(5, "short write")
        done += wrote


def pread_rest(fd: int, out: memoryview, offset: int, path: str) -> None:
    """Finish a short read (see :func:`pwrite_rest`)."""
    done = os.preadv(fd, [out], offset)
    while done < len(out):
        got = os.preadv(fd, [out[done:]], offset + done)
        if got <= 0:
            raise ServerError(f"read {path}: the file ended {len(out) - done} bytes early", Code.IO_ERROR)
        done += got

