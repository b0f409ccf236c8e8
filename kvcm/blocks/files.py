"""``file`` storages: ``os.pwrite`` / ``os.preadv`` at ``blkid * size`` of a container file,
on a cache of open descriptors (``O_DIRECT`` optional)."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Mapping

from kvcm.blocks.places import (
    OPEN_FLAGS,
    Fd,
    HandleCache,
    Place,
    io_error,
    nlink,
    open_regular,
    pread_rest,
    pwrite_rest,
)
from kvcm.blocks.specs import StorageSpec, expect
from kvcm.errors import InvalidArgument
from kvcm.proto.uris import BlockUri, FileUri

#: ``O_DIRECT`` needs offsets, sizes and buffer addresses aligned to the device's logical block;
#: 4096 covers every common one.
DIRECT_ALIGN = 4096


class _Bounce(threading.local):
    """A thread's bounce buffer for unaligned ``O_DIRECT`` I/O (None until it needs one)."""

    buf: mmap.mmap | None = None


class FileHandler:
    """``file`` storages: ``os.pwrite`` / ``os.preadv`` at ``blkid * size`` of the container
    file, opened under ``root_path`` without following links and never created or grown."""

    def __init__(self, mounts: Mapping[str, str] | None = None, direct: bool = False, max_files: int = 256) -> None:
        self._mounts = dict(mounts or {})
        for name, root in self._mounts.items():
            if not os.path.isabs(root):
                raise InvalidArgument(f"mounts[{name!r}]: {root!r} is not an absolute path")
        self._direct = direct
        self._flags = OPEN_FLAGS | (getattr(os, "O_DIRECT", 0) if direct else 0)
        if direct and not hasattr(os, "O_DIRECT"):
            raise InvalidArgument("direct: O_DIRECT is not available on this platform")
        self._fds: HandleCache[tuple[str, str], Fd] = HandleCache(max_files)
        self._roots: dict[str, tuple[StorageSpec, str]] = {}
        self._bounce = _Bounce()

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
        file = block if type(block) is FileUri else expect(block, FileUri)
        handle, root = self._handle(file, spec)
        if self._direct:
            self._check_aligned(file)
            if not _aligned(data):
                data = self._bounced(len(data), data)
        try:
            if os.pwrite(handle.fd, data, file.offset) != len(data):
                pwrite_rest(handle.fd, data, file.offset)
        except OSError as exc:
            raise io_error("write", os.path.join(root, file.path), exc) from exc

    def read_into(self, block: BlockUri, spec: StorageSpec, out: memoryview) -> None:
        file = block if type(block) is FileUri else expect(block, FileUri)
        handle, root = self._handle(file, spec)
        target = out
        if self._direct:
            self._check_aligned(file)
            if not _aligned(out):
                target = self._bounced(len(out))
        try:
            if os.preadv(handle.fd, [target], file.offset) != len(target):
                pread_rest(handle.fd, target, file.offset, os.path.join(root, file.path))
        except OSError as exc:
            raise io_error("read", os.path.join(root, file.path), exc) from exc
        if target is not out:
            out[:] = target

    def check(self, block: BlockUri, spec: StorageSpec) -> None:
        """Open the block's file and check the block lies inside it (what every I/O does first)."""
        self._handle(expect(block, FileUri), spec)

    def place(self, block: BlockUri, spec: StorageSpec) -> Place | None:
        """Where the (just used) block is, for :class:`BlockIO` to remember; None under
        ``O_DIRECT`` (its alignment checks and bounce buffers stay on the full path)."""
        if self._direct or not isinstance(block, FileUri):
            return None
        handle, root = self._handle(block, spec)
        return handle.place(block.offset, block.size, os.path.join(root, block.path))

    def _handle(self, block: FileUri, spec: StorageSpec) -> tuple[Fd, str]:
        known = self._roots.get(spec.name)
        root = known[1] if known is not None and known[0] is spec else self.root(spec)
        key = (root, block.path)
        handle: Fd | None = self._fds.items.get(key)  # the hot path: one dict read, no lock
        if handle is None:
            try:
                handle = self._fds.get(key, self._open, nlink)
            except OSError as exc:
                raise io_error("open", os.path.join(root, block.path), exc) from exc
        end = block.offset + block.size
        if end > handle.size:
            handle.size = os.fstat(handle.fd).st_size  # a cached size may predate a recovery
            if end > handle.size:
                raise InvalidArgument(f"uri {block.uri[:200]!r}: bytes {block.offset}..{end} lie past the end of "
                                      f"{os.path.join(root, block.path)} ({handle.size} bytes)")
        return handle, root

    def _open(self, key: tuple[str, str]) -> Fd:
        """``root/s<size>/<name>``, neither component a symbolic link (the parser already
        refused ``..`` and every other shape kvcm does not generate)."""
        root, rel = key
        directory, name = rel.split("/")
        dir_fd = os.open(os.path.join(root, directory), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            return open_regular(name, self._flags, dir_fd)
        finally:
            os.close(dir_fd)

    def _check_aligned(self, block: FileUri) -> None:
        if block.offset % DIRECT_ALIGN or block.size % DIRECT_ALIGN:
            raise InvalidArgument(f"uri {block.uri[:200]!r}: O_DIRECT needs offset and size in multiples of {DIRECT_ALIGN}")

    def _bounced(self, size: int, data: memoryview | None = None) -> memoryview:
        """A page-aligned per-thread buffer of ``size`` bytes (holding ``data`` if given)."""
        buf = self._bounce.buf
        if buf is None or len(buf) < size:
            buf = mmap.mmap(-1, max(size, DIRECT_ALIGN))
            self._bounce.buf = buf
        view = memoryview(buf)[:size]
        if data is not None:
            view[:] = data
        return view



def _aligned(view: memoryview) -> bool:
    """Whether the buffer starts on a :data:`DIRECT_ALIGN` boundary (read-only ones are copied)."""
    if view.readonly:
        return False
    import ctypes  # only O_DIRECT users pay for it

    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % DIRECT_ALIGN == 0


