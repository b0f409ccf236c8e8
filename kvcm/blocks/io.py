"""BlockIO: reads and writes whole blocks at kvcm URIs, through the handler of each URI's storage
type, remembering where a URI met before has its bytes (the hot path: no parsing, no lookups)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from kvcm.blocks.files import FileHandler
from kvcm.blocks.places import Place
from kvcm.blocks.shm import ShmHandler
from kvcm.blocks.specs import (
    BlockHandler,
    CheckingHandler,
    ClosingHandler,
    Resolved,
    StorageSpec,
    UnknownStorage,
    Unsupported,
    specs_of_reply,
)
from kvcm.errors import InvalidArgument
from kvcm.proto.uris import BlockUri, FileUri, ShmUri, parse_block_uri
from kvcm.proto.wire import Decoded, Encodable

_URIS_MAX = 16384  # URIs whose place BlockIO remembers (a few MB at most)


class _Caller(Protocol):
    def call(self, method: str, params: dict[str, Encodable] | None = None) -> Decoded: ...



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
        # URI -> where its bytes are, for URIs met before (see Place): a repeated block's I/O
        # skips parsing and lookups. Cleared by refresh, close, register, and when full.
        self._places: dict[str | BlockUri, Place] = {}  # str keys only
        self._handlers: dict[str, BlockHandler] = {
            "file": FileHandler(mounts, direct, max_files),
            "shm": ShmHandler(max_segments),
        }

    @classmethod
    def for_instance(cls, client: _Caller, instance_id: str, *, mounts: Mapping[str, str] | None = None,
                     direct: bool = False, max_files: int = 256, max_segments: int = 64) -> BlockIO:
        """A BlockIO over the storages of ``instance_id``, fetched with ``client`` (a
        :class:`kvcm.Client`, or anything with its ``call``); the options are the constructor's."""

        def fetch() -> list[StorageSpec]:
            return specs_of_reply(client.call("get_storage_specs", {"instance_id": instance_id}))

        return cls(fetch, mounts=mounts, direct=direct, max_files=max_files, max_segments=max_segments)

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
                        pass  # Place.write words it
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
                    pass  # Place.read_into words it
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
        if len(places) >= _URIS_MAX:
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
