"""Block I/O at the URIs kvcm hands out: decode a URI, find its storage, write and read the bytes.

kvcm never moves KV bytes; a client writes each block at the URI ``start_write_cache`` returned
and reads it at the URI ``get_cache_location`` returns. This module does that for the storages
kvcm owns the space of, from the client-visible storage specs of ``get_storage_specs``::

    with kvcm.Client(endpoint) as client, BlockIO.for_instance(client, "qwen-7b-a") as io:
        io.write(uri, block)            # bytes, memoryview, numpy array: any contiguous buffer
        io.read_into(uri, out)          # into the caller's buffer, no copy in between

* ``file``: ``os.pwrite`` / ``os.preadv`` on a cache of open descriptors (``O_DIRECT`` optional).
* ``shm``: a copy into / out of a cached ``mmap`` of the segment.
* ``3fs``, ``mooncake``, ``tairmempool`` (kvcm only invents their URIs): :class:`Unsupported`,
  carrying the decoded URI, unless a handler for the type is registered (:meth:`BlockIO.register`).

Docs: docs/blocks.md (URI formats, the spec RPC, thread-safety, O_DIRECT, custom handlers).

Thread-safety: one :class:`BlockIO` may be shared by any number of threads. Reads and writes are
positional (``pwrite``/``preadv``, or a copy at an offset of a mapping), so they never share a
file position; the caches are dicts changed only under a lock, and an evicted descriptor or
mapping is closed only when the last operation using it lets go of it (reference counting),
never under a running copy.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import msgspec

from kvcm.errors import Code, InvalidArgument, NotFound, ServerError
from kvcm.proto.uris import BlockUri, FileUri, MooncakeUri, PaceUri, ShmUri, ThreeFsUri, parse_block_uri

__all__ = [
    "BlockHandler", "BlockIO", "BlockUri", "FileUri", "MooncakeUri", "PaceUri", "Resolved", "ShmUri",
    "StorageSpec", "ThreeFsUri", "UnknownStorage", "Unsupported", "parse", "specs_of_reply",
]

#: Decode any URI kvcm hands out (``file``, ``shm``, ``hf3fs``, ``mooncake``, ``pace``) into its
#: typed form; InvalidArgument on anything else. The same decoder the server's backends use.
parse = parse_block_uri

#: ``O_DIRECT`` needs offsets, sizes and buffer addresses aligned to the device's logical block;
#: 4096 covers every common one.
DIRECT_ALIGN = 4096
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
U = TypeVar("U", bound=BlockUri)


# ------------------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class StorageSpec:
    """The client-visible part of one storage (``get_storage_specs``): name, type, and the spec
    fields a client needs (``root_path`` of ``file``, ``shm_dir`` of ``shm``, ...)."""

    name: str
    type: str
    spec: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_wire(cls, item: Any) -> StorageSpec:
        if not isinstance(item, Mapping):
            raise InvalidArgument(f"a storage spec must be a map, got {type(item).__name__}")
        name, kind, spec = item.get("global_unique_name"), item.get("storage_type"), item.get("storage_spec", {})
        if not isinstance(name, str) or not isinstance(kind, str) or not isinstance(spec, Mapping):
            raise InvalidArgument(f"a storage spec needs global_unique_name, storage_type, storage_spec: {item!r:.200}")
        return cls(name, kind, dict(spec))

    def path_field(self, key: str) -> str:
        """An absolute path of the spec (``root_path``, ``shm_dir``); InvalidArgument otherwise."""
        value = self.spec.get(key)
        if not isinstance(value, str) or not os.path.isabs(value):
            raise InvalidArgument(f"{self.type} storage {self.name!r}: its spec has no absolute {key} ({value!r:.200})")
        return value


def specs_of_reply(reply: Any) -> list[StorageSpec]:
    """The storages of a ``get_storage_specs`` reply."""
    items = reply.get("storages") if isinstance(reply, Mapping) else None
    if not isinstance(items, list):
        raise InvalidArgument("a get_storage_specs reply holds a list 'storages'")
    return [StorageSpec.from_wire(item) for item in items]


class UnknownStorage(NotFound):
    """A URI names a storage the instance's specs do not list, even after a refresh."""


class Unsupported(ServerError):
    """kvcm.blocks has no transfer for this storage type (the URI-only stores). ``block`` is the
    decoded URI (``parts`` the same as a dict) and ``spec`` the storage's client-visible spec,
    everything a transfer of one's own needs; :meth:`BlockIO.register` plugs one in."""

    def __init__(self, block: BlockUri, spec: StorageSpec) -> None:
        self.block = block
        self.spec = spec
        self.parts = msgspec.structs.asdict(block)
        super().__init__(
            f"{spec.type} storage {spec.name!r}: no built-in transfer for this URI-only store; register a handler "
            f"with BlockIO.register({spec.type!r}, handler). URI parts: {self.parts}",
            Code.UNSUPPORTED,
        )


class BlockHandler(Protocol):
    """The transfer of one storage type. ``data`` and ``out`` are flat byte views of exactly
    ``block.size`` bytes; ``out`` is writable. Called from any thread (see the module doc)."""

    def write(self, block: BlockUri, spec: StorageSpec, data: memoryview) -> None: ...

    def read_into(self, block: BlockUri, spec: StorageSpec, out: memoryview) -> None: ...


@runtime_checkable
class ClosingHandler(Protocol):
    """A handler that holds resources (descriptors, mappings): :meth:`BlockIO.close` closes it."""

    def close(self) -> None: ...


@runtime_checkable
class CheckingHandler(Protocol):
    """A handler that checks a block against its spec before a read allocates the block's size
    (a hostile size must fail, not exhaust memory)."""

    def check(self, block: BlockUri, spec: StorageSpec) -> None: ...


class _Caller(Protocol):
    def call(self, method: str, params: dict[str, Any] | None = None) -> Any: ...


@dataclass(frozen=True)
class Resolved:
    """Where a ``file`` or ``shm`` block's bytes are: ``size`` bytes at ``offset`` of ``path``."""

    path: str
    offset: int
    size: int


class _Place:
    """Where one URI's bytes are, as its handler found them: bytes ``start:end`` of an open
    descriptor (``file``: ``handle``) or of a mapped segment (``shm``: the mapping and its
    view, ``map`` and ``view``). The place holds them itself, so the hot path reads one
    attribute instead of going through the cache (a weak reference and a flag cost most of the
    SDK's time next to a 64 KiB copy). The cache alone still decides how many descriptors and
    mappings stay open: a handle it lets go (evicted, unlinked, cleared) clears itself from
    every place that uses it (:meth:`_Handle.retire`), so it is never used from here again even
    while a running I/O still holds it, and the URI takes the full path; a mapping closed
    meanwhile raises ``ValueError`` on use, which sends it there too.

    A slotted class, not a NamedTuple: its attributes are read on every hot-path I/O, and slot
    reads are the interpreter's cheapest."""

    __slots__ = ("end", "handle", "map", "path", "size", "start", "view")

    def __init__(self, start: int, size: int, path: str) -> None:
        self.handle: _Fd | None = None  # file: the descriptor's handle, None once let go
        self.map: mmap.mmap | None = None  # shm: the segment's mapping and view, None once let go
        self.view: memoryview | None = None
        self.start = start
        self.end = start + size
        self.size = size
        self.path = path  # for error messages

    def write(self, data: memoryview, handle: _Fd) -> None:
        """Finish a file write the hot path began (``handle``: the one it took from here)."""
        try:
            if os.pwrite(handle.fd, data, self.start) != self.size:
                _pwrite_rest(handle.fd, data, self.start)
        except OSError as exc:
            raise _io_error("write", self.path, exc) from exc

    def read_into(self, out: memoryview | bytearray, handle: _Fd) -> None:
        """Finish a file read the hot path began (see :meth:`write`)."""
        try:
            if os.preadv(handle.fd, [out], self.start) != self.size:
                _pread_rest(handle.fd, memoryview(out), self.start, self.path)
        except OSError as exc:
            raise _io_error("read", self.path, exc) from exc


_PLACES_MAX = 16384  # URIs whose place BlockIO remembers (a few MB at most)


# ------------------------------------------------------------------------------------ BlockIO


class BlockIO:
    """Reads and writes blocks at kvcm URIs. ``fetch_specs`` returns the storages URIs may name
    (e.g. :meth:`for_instance`); it is called at the first use and again whenever a URI names
    a storage not seen yet, so a storage added to the group later works without a restart.

    ``mounts`` maps a ``file`` storage name to this host's mount point of its root (an NFS
    export mounted elsewhere than on the kvcm host). ``direct`` opens files with ``O_DIRECT``
    (offsets, sizes multiples of :data:`DIRECT_ALIGN`; unaligned buffers go through a bounce
    buffer). At most ``max_files`` descriptors and ``max_segments`` mappings stay cached."""

    def __init__(
        self,
        fetch_specs: Callable[[], Iterable[StorageSpec]],
        *,
        mounts: Mapping[str, str] | None = None,
        direct: bool = False,
        max_files: int = 256,
        max_segments: int = 64,
    ) -> None:
        if max_files < 1 or max_segments < 1:
            raise InvalidArgument("max_files and max_segments must be at least 1")
        self._fetch = fetch_specs
        self._specs: dict[str, StorageSpec] | None = None
        self._refresh_lock = threading.Lock()
        # URI -> where its bytes are, for URIs met before (see _Place): a repeated block's I/O
        # skips parsing and lookups. Cleared by refresh, close, register, and when full.
        self._places: dict[str | BlockUri, _Place] = {}  # str keys only
        self._handlers: dict[str, BlockHandler] = {
            "file": FileHandler(mounts, direct, max_files),
            "shm": ShmHandler(max_segments),
        }

    @classmethod
    def for_instance(cls, client: _Caller, instance_id: str, **options: Any) -> BlockIO:
        """A BlockIO over the storages of ``instance_id``, fetched with ``client`` (a
        :class:`kvcm.Client`, or anything with its ``call``)."""

        def fetch() -> list[StorageSpec]:
            return specs_of_reply(client.call("get_storage_specs", {"instance_id": instance_id}))

        return cls(fetch, **options)

    def __enter__(self) -> BlockIO:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop cached descriptors and mappings (operations still running finish first)."""
        self._places.clear()
        for handler in list(self._handlers.values()):
            if isinstance(handler, ClosingHandler):
                handler.close()

    # -- specs -------------------------------------------------------------------------------

    def register(self, storage_type: str, handler: BlockHandler) -> None:
        """Use ``handler`` for URIs of storages of ``storage_type`` (replacing a built-in one)."""
        self._handlers[storage_type] = handler
        self._places.clear()

    def refresh(self) -> None:
        """Fetch the storage specs again (also done by itself for an unknown storage name)."""
        specs = {spec.name: spec for spec in self._fetch()}
        self._specs = specs
        self._places.clear()  # a spec may have changed (a root path): resolve every URI again

    def spec(self, name: str) -> StorageSpec:
        """The spec of storage ``name``; refreshed once when unknown, then UnknownStorage."""
        specs = self._specs
        found = specs.get(name) if specs is not None else None
        if found is not None:
            return found
        with self._refresh_lock:  # one refresh serves every thread that met the same new name
            if self._specs is specs or self._specs is None:
                self.refresh()
            known = self._specs or {}
        found = known.get(name)
        if found is None:
            raise UnknownStorage(f"storage {name[:200]!r} is not among the instance's storages "
                                 f"({', '.join(sorted(known)) or 'none'})")
        return found

    # -- I/O ---------------------------------------------------------------------------------

    def target(self, uri: str | BlockUri) -> tuple[BlockUri, StorageSpec]:
        """The decoded URI and its storage's spec; InvalidArgument if the URI's scheme is not
        its storage's type (a ``shm://`` URI naming a ``file`` storage)."""
        block = uri if isinstance(uri, BlockUri) else parse_block_uri(uri)
        specs = self._specs  # the hot path: one dict read, no lock
        spec = specs.get(block.storage) if specs is not None else None
        if spec is None:
            spec = self.spec(block.storage)
        if spec.type != block.storage_type:
            raise InvalidArgument(f"uri {block.uri[:200]!r} is a {block.storage_type} uri, "
                                  f"but storage {spec.name!r} is {spec.type}")
        return block, spec

    def resolve(self, uri: str | BlockUri) -> Resolved:
        """Path, offset and size of a ``file`` or ``shm`` block; Unsupported for other types."""
        block, spec = self.target(uri)
        if isinstance(block, FileUri):
            return Resolved(os.path.join(self._file_root(spec), block.path), block.offset, block.size)
        if isinstance(block, ShmUri):
            return Resolved(os.path.join(spec.path_field("shm_dir"), block.segment), block.offset, block.size)
        raise Unsupported(block, spec)

    def write(self, uri: str | BlockUri, data: Any) -> None:
        """Write one whole block: ``data`` is any contiguous buffer of exactly the block's size."""
        place = self._places.get(uri)  # only str keys are stored: a BlockUri never matches
        if place is not None:
            # The hot path, inlined: every step saved is a few percent of a 64 KiB block's I/O
            # (the copy evicts the interpreter's own data from the CPU caches each time).
            mapped = place.map
            if mapped is not None:  # shm, still the cache's
                try:
                    mapped[place.start:place.end] = data  # checks the buffer and its size
                    return
                except (TypeError, ValueError, IndexError, BufferError, NotImplementedError):
                    pass  # a buffer to cast or refuse, or a mapping closed since: the full path
            elif (handle := place.handle) is not None:  # file, still the cache's
                if type(data) is not bytes or len(data) != place.size:
                    data = _view(data, place.size, writable=False)
                else:
                    try:
                        if os.pwrite(handle.fd, data, place.start) == place.size:
                            return
                    except OSError:
                        pass  # _Place.write words it
                place.write(data, handle)  # a cast buffer, or a short or failed write: finish or report it
                return
        block, spec = self.target(uri)
        handler = self._handlers.get(spec.type) or self._handler(block, spec)
        handler.write(block, spec, _view(data, block.size, writable=False))
        self._remember(uri, block, spec, handler)

    def read_into(self, uri: str | BlockUri, out: Any) -> None:
        """Read one whole block into ``out``, a writable contiguous buffer of the block's size."""
        place = self._places.get(uri)
        if place is not None:
            source = place.view
            if source is not None:  # shm, still the cache's
                try:  # a view is used as it is: wrapping a buffer costs as much as the rest
                    dst = out if type(out) is memoryview else memoryview(out)
                    if dst.c_contiguous:  # a strided view would take the copy: refused, as for files
                        dst[:] = source[place.start:place.end]  # checks format, shape and size
                        return
                except (TypeError, ValueError, NotImplementedError):  # NotImplemented: ndim > 1
                    pass  # a buffer to cast or refuse, or a mapping closed since: the full path
            elif (handle := place.handle) is not None:  # file, still the cache's
                # os.preadv takes a bytearray, or a writable C-contiguous view of the block's
                # nbytes (not its length, which counts elements), as it is: no view to make
                view: memoryview | bytearray
                if type(out) is bytearray:
                    view = out if len(out) == place.size else _view(out, place.size, writable=True)
                elif type(out) is memoryview and out.nbytes == place.size and out.c_contiguous \
                        and not out.readonly:
                    view = out
                else:
                    view = _view(out, place.size, writable=True)
                try:
                    if os.preadv(handle.fd, [view], place.start) == place.size:
                        return
                except OSError:
                    pass  # _Place.read_into words it
                place.read_into(view, handle)
                return
        block, spec = self.target(uri)
        handler = self._handlers.get(spec.type) or self._handler(block, spec)
        handler.read_into(block, spec, _view(out, block.size, writable=True))
        self._remember(uri, block, spec, handler)

    def _remember(self, uri: str | BlockUri, block: BlockUri, spec: StorageSpec, handler: BlockHandler) -> None:
        """Keep where a built-in handler put ``uri``'s bytes, for the next I/O of that URI."""
        if type(uri) is not str or not isinstance(handler, (FileHandler, ShmHandler)):
            return
        place = handler.place(block, spec)
        if place is None:
            return
        places = self._places
        if len(places) >= _PLACES_MAX:
            places.clear()
        places[uri] = place

    def read(self, uri: str | BlockUri) -> bytearray:
        """One whole block, in a new bytearray."""
        block, spec = self.target(uri)
        handler = self._handler(block, spec)
        if isinstance(handler, CheckingHandler):
            handler.check(block, spec)  # before allocating: a hostile size must fail, not exhaust memory
        out = bytearray(block.size)
        handler.read_into(block, spec, memoryview(out))
        return out

    def _handler(self, block: BlockUri, spec: StorageSpec) -> BlockHandler:
        handler = self._handlers.get(spec.type)
        if handler is None:
            raise Unsupported(block, spec)
        return handler

    def _file_root(self, spec: StorageSpec) -> str:
        handler = self._handlers.get("file")
        return handler.root(spec) if isinstance(handler, FileHandler) else spec.path_field("root_path")


def _view(data: Any, size: int, writable: bool) -> memoryview:
    """``data`` as a flat byte view of exactly ``size`` bytes (no copy)."""
    if type(data) is bytearray or (type(data) is bytes and not writable):  # flat bytes already: the hot path
        if len(data) != size:
            raise InvalidArgument(f"the block is {size} bytes, the buffer {len(data)}")
        return memoryview(data)
    try:
        view = memoryview(data)
    except TypeError:
        raise InvalidArgument(f"a block needs a buffer (bytes, bytearray, memoryview, array), "
                              f"got {type(data).__name__}") from None
    if writable and view.readonly:
        raise InvalidArgument("read_into needs a writable buffer")
    if not view.c_contiguous:
        raise InvalidArgument("a block buffer must be C-contiguous")
    if view.ndim != 1 or view.format != "B":
        try:
            view = view.cast("B")
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"a block buffer must be viewable as bytes: {exc}") from None
    if view.nbytes != size:
        raise InvalidArgument(f"the block is {size} bytes, the buffer {view.nbytes}")
    return view


def _io_error(what: str, path: str, exc: OSError) -> ServerError | NotFound:
    if isinstance(exc, FileNotFoundError):
        return NotFound(f"{what} {path}: no such file (deleted, or the storage is mounted elsewhere on this host)")
    return ServerError(f"{what} {path}: {exc.strerror or exc}", Code.IO_ERROR)


# --------------------------------------------------------------------------------- the caches


class _Handle(ABC):
    """What the caches keep open (a descriptor, a mapping), and the remembered places that use
    it: each place holds what it needs of the handle itself (one attribute read on the hot
    path), and the handle clears that from all of them when its cache lets it go."""

    __slots__ = ("__weakref__", "live", "places")

    def __init__(self) -> None:
        self.live = True  # false once its cache let it go
        # The places that use this handle, by (offset, size): one per block, so bounded by the
        # blocks it holds however often BlockIO forgets and remembers them.
        self.places: dict[tuple[int, int], _Place] = {}

    def place(self, start: int, size: int, path: str) -> _Place:
        """The remembered place of bytes ``start:start+size``."""
        found = self.places.get((start, size))
        if found is None:
            found = _Place(start, size, path)
            self._fill(found)
            if len(self.places) >= _PLACES_MAX:
                _let_go(list(self.places.values()))
                self.places.clear()
            self.places[(start, size)] = found
            if not self.live:  # retired meanwhile (another thread's eviction): never used
                _let_go([found])
        return found

    @abstractmethod
    def _fill(self, place: _Place) -> None:
        """Give a new place what it needs of this handle."""

    def retire(self) -> None:
        """Its cache let it go: cleared from every place that uses it (``live`` first, so a
        place made meanwhile sees it), so none uses it again, even while a running I/O still
        holds it."""
        self.live = False
        _let_go(list(self.places.values()))
        self.places.clear()


def _let_go(places: list[_Place]) -> None:
    for place in places:
        place.handle = place.map = place.view = None


class _Fd(_Handle):
    """One open descriptor, closed when the last reference goes: an evicted entry is never
    closed under a pwrite still using it (and its number never reused meanwhile)."""

    __slots__ = ("fd", "size")

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd
        self.size = -1

    def _fill(self, place: _Place) -> None:
        place.handle = self  # the handle, never its number: a closed number can be reused

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class _Map(_Handle):
    """One segment mapped whole; unmapped when the last reference (a running copy) goes."""

    __slots__ = ("fd", "map", "view")

    def __init__(self, fd: _Fd) -> None:
        super().__init__()
        self.fd = fd  # kept to tell an unlinked segment (st_nlink 0) from a live one
        self.map = mmap.mmap(fd.fd, fd.size)
        self.view = memoryview(self.map)

    def _fill(self, place: _Place) -> None:
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


class _Cache:
    """Path -> open object, bounded. Hits take no lock (a dict read is atomic); misses and
    evictions take it. On a miss, entries whose file was unlinked (kvcm freed the container) are
    dropped first, so a cached handle never pins freed disk or tmpfs memory for long."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self.items: dict[Any, Any] = {}

    def get(self, key: Any, make: Callable[[Any], Any], nlink: Callable[[Any], int]) -> Any:
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

    def _drop_unlinked(self, nlink: Callable[[Any], int]) -> None:
        for path, item in list(self.items.items()):
            try:
                gone = nlink(item) == 0
            except OSError:
                gone = True
            if gone:
                self.items.pop(path).retire()


def _open_regular(path: str, flags: int, dir_fd: int | None = None) -> _Fd:
    handle = _Fd(os.open(path, flags, dir_fd=dir_fd))  # closes it again if anything below raises
    st = os.fstat(handle.fd)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(f"{path} is not a regular file")
    handle.size = st.st_size
    return handle


# ------------------------------------------------------------------------------ file handler


class FileHandler:
    """``file`` storages: ``os.pwrite`` / ``os.preadv`` at ``blkid * size`` of the container
    file, opened under ``root_path`` without following links and never created or grown."""

    def __init__(self, mounts: Mapping[str, str] | None = None, direct: bool = False, max_files: int = 256) -> None:
        self._mounts = dict(mounts or {})
        for name, root in self._mounts.items():
            if not os.path.isabs(root):
                raise InvalidArgument(f"mounts[{name!r}]: {root!r} is not an absolute path")
        self._direct = direct
        self._flags = _OPEN_FLAGS | (getattr(os, "O_DIRECT", 0) if direct else 0)
        if direct and not hasattr(os, "O_DIRECT"):
            raise InvalidArgument("direct: O_DIRECT is not available on this platform")
        self._fds = _Cache(max_files)
        self._roots: dict[str, tuple[StorageSpec, str]] = {}
        self._bounce = threading.local()

    def root(self, spec: StorageSpec) -> str:
        known = self._roots.get(spec.name)
        if known is not None and known[0] is spec:
            return known[1]
        root = self._mounts.get(spec.name) or spec.path_field("root_path")
        self._roots[spec.name] = (spec, root)  # keyed by the spec object: a refresh checks again
        return root

    def close(self) -> None:
        self._fds.clear()

    def write(self, block: BlockUri, spec: StorageSpec, data: memoryview) -> None:
        file = block if type(block) is FileUri else _expect(block, FileUri)
        handle, root = self._handle(file, spec)
        if self._direct:
            self._check_aligned(file)
            if not _aligned(data):
                data = self._bounced(len(data), data)
        try:
            if os.pwrite(handle.fd, data, file.offset) != len(data):
                _pwrite_rest(handle.fd, data, file.offset)
        except OSError as exc:
            raise _io_error("write", os.path.join(root, file.path), exc) from exc

    def read_into(self, block: BlockUri, spec: StorageSpec, out: memoryview) -> None:
        file = block if type(block) is FileUri else _expect(block, FileUri)
        handle, root = self._handle(file, spec)
        target = out
        if self._direct:
            self._check_aligned(file)
            if not _aligned(out):
                target = self._bounced(len(out))
        try:
            if os.preadv(handle.fd, [target], file.offset) != len(target):
                _pread_rest(handle.fd, target, file.offset, os.path.join(root, file.path))
        except OSError as exc:
            raise _io_error("read", os.path.join(root, file.path), exc) from exc
        if target is not out:
            out[:] = target

    def check(self, block: BlockUri, spec: StorageSpec) -> None:
        """Open the block's file and check the block lies inside it (what every I/O does first)."""
        self._handle(_expect(block, FileUri), spec)

    def place(self, block: BlockUri, spec: StorageSpec) -> _Place | None:
        """Where the (just used) block is, for :class:`BlockIO` to remember; None under
        ``O_DIRECT`` (its alignment checks and bounce buffers stay on the full path)."""
        if self._direct or not isinstance(block, FileUri):
            return None
        handle, root = self._handle(block, spec)
        return handle.place(block.offset, block.size, os.path.join(root, block.path))

    def _handle(self, block: FileUri, spec: StorageSpec) -> tuple[_Fd, str]:
        known = self._roots.get(spec.name)
        root = known[1] if known is not None and known[0] is spec else self.root(spec)
        key = (root, block.path)
        handle: _Fd | None = self._fds.items.get(key)  # the hot path: one dict read, no lock
        if handle is None:
            try:
                handle = self._fds.get(key, self._open, _nlink)
            except OSError as exc:
                raise _io_error("open", os.path.join(root, block.path), exc) from exc
        end = block.offset + block.size
        if end > handle.size:
            handle.size = os.fstat(handle.fd).st_size  # a cached size may predate a recovery
            if end > handle.size:
                raise InvalidArgument(f"uri {block.uri[:200]!r}: bytes {block.offset}..{end} lie past the end of "
                                      f"{os.path.join(root, block.path)} ({handle.size} bytes)")
        return handle, root

    def _open(self, key: tuple[str, str]) -> _Fd:
        """``root/s<size>/<name>``, neither component a symbolic link (the parser already
        refused ``..`` and every other shape kvcm does not generate)."""
        root, rel = key
        directory, name = rel.split("/")
        dir_fd = os.open(os.path.join(root, directory), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            return _open_regular(name, self._flags, dir_fd)
        finally:
            os.close(dir_fd)

    def _check_aligned(self, block: FileUri) -> None:
        if block.offset % DIRECT_ALIGN or block.size % DIRECT_ALIGN:
            raise InvalidArgument(f"uri {block.uri[:200]!r}: O_DIRECT needs offset and size in multiples of {DIRECT_ALIGN}")

    def _bounced(self, size: int, data: memoryview | None = None) -> memoryview:
        """A page-aligned per-thread buffer of ``size`` bytes (holding ``data`` if given)."""
        buf: mmap.mmap | None = getattr(self._bounce, "buf", None)
        if buf is None or len(buf) < size:
            buf = mmap.mmap(-1, max(size, DIRECT_ALIGN))
            self._bounce.buf = buf
        view = memoryview(buf)[:size]
        if data is not None:
            view[:] = data
        return view


def _expect(block: BlockUri, kind: type[U]) -> U:
    if not isinstance(block, kind):
        raise InvalidArgument(f"uri {block.uri[:200]!r} is a {block.storage_type} uri, not {kind.storage_type}")
    return block


def _aligned(view: memoryview) -> bool:
    """Whether the buffer starts on a :data:`DIRECT_ALIGN` boundary (read-only ones are copied)."""
    if view.readonly:
        return False
    import ctypes  # only O_DIRECT users pay for it

    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % DIRECT_ALIGN == 0


def _nlink(item: _Fd | _Map) -> int:
    fd = item.fd if isinstance(item, _Fd) else item.fd.fd
    return os.fstat(fd).st_nlink


def _pwrite_rest(fd: int, data: memoryview, offset: int) -> None:
    """Finish a short write (signals, NFS) by writing the whole block again from its start:
    positional, so rewriting the part already written is harmless."""
    done = os.pwrite(fd, data, offset)
    while done < len(data):
        wrote = os.pwrite(fd, data[done:], offset + done)
        if wrote <= 0:
            raise OSError(5, "short write")
        done += wrote


def _pread_rest(fd: int, out: memoryview, offset: int, path: str) -> None:
    """Finish a short read (see :func:`_pwrite_rest`)."""
    done = os.preadv(fd, [out], offset)
    while done < len(out):
        got = os.preadv(fd, [out[done:]], offset + done)
        if got <= 0:
            raise ServerError(f"read {path}: the file ended {len(out) - done} bytes early", Code.IO_ERROR)
        done += got


# ------------------------------------------------------------------------------- shm handler


class ShmHandler:
    """``shm`` storages: a copy into / out of the segment mapped whole (``shm_dir/<segment>``)."""

    def __init__(self, max_segments: int = 64) -> None:
        self._maps = _Cache(max_segments)
        self._dirs: dict[str, tuple[StorageSpec, str]] = {}

    def close(self) -> None:
        self._maps.clear()

    def write(self, block: BlockUri, spec: StorageSpec, data: memoryview) -> None:
        shm = _expect(block, ShmUri)
        self._map(shm, spec)[shm.offset:shm.offset + shm.size] = data

    def read_into(self, block: BlockUri, spec: StorageSpec, out: memoryview) -> None:
        shm = _expect(block, ShmUri)
        out[:] = self._map(shm, spec)[shm.offset:shm.offset + shm.size]

    def check(self, block: BlockUri, spec: StorageSpec) -> None:
        """Map the block's segment and check the block lies inside it."""
        self._map(_expect(block, ShmUri), spec)

    def place(self, block: BlockUri, spec: StorageSpec) -> _Place | None:
        """Where the (just used) block is, for :class:`BlockIO` to remember."""
        if not isinstance(block, ShmUri):
            return None
        self._map(block, spec)  # checks the bounds
        shm_dir = self._dirs[spec.name][1]
        key = (shm_dir, block.segment)
        mapped: _Map | None = self._maps.items.get(key)
        if mapped is None:
            return None
        return mapped.place(block.offset, block.size, os.path.join(*key))

    def _map(self, block: ShmUri, spec: StorageSpec) -> memoryview:
        shm_dir = self._dirs.get(spec.name)
        if shm_dir is None or shm_dir[0] is not spec:
            shm_dir = self._dirs[spec.name] = (spec, spec.path_field("shm_dir"))
        key = (shm_dir[1], block.segment)
        mapped: _Map | None = self._maps.items.get(key)  # the hot path: one dict read, no lock
        if mapped is None:
            try:
                mapped = self._maps.get(key, _map_segment, _nlink)
            except OSError as exc:
                raise _io_error("map", os.path.join(*key), exc) from exc
        end = block.offset + block.size
        if end > len(mapped.map):
            raise InvalidArgument(f"uri {block.uri[:200]!r}: bytes {block.offset}..{end} lie past the end of "
                                  f"segment {os.path.join(*key)} ({len(mapped.map)} bytes)")
        return mapped.view


def _map_segment(key: tuple[str, str]) -> _Map:
    path = os.path.join(*key)
    handle = _open_regular(path, _OPEN_FLAGS)
    if handle.size == 0:
        raise InvalidArgument(f"segment {path} is empty")
    return _Map(handle)
