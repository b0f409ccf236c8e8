"""Files in a storage directory others may write, and giving their space back (hole punching).

A storage directory may be writable by other local users (``/dev/shm``, a shared root), who can
plant a symlink, a FIFO or a directory at any name kvcm would use. So every open there refuses
to follow a symlink, never blocks on a FIFO, and checks it got a regular file; every file kvcm
creates there is new (O_EXCL), private (0600), and named unpredictably unless the name itself is
the rendezvous (a container, a marker, a lock).
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
from collections.abc import Callable

log = logging.getLogger("kvcm.backends.storage")

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


def _load_fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's ``fallocate`` (None: not Linux, or no such function)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None
    try:
        # fallocate64 takes a 64-bit off_t on every ABI; plain fallocate only on 64-bit ones.
        fn = libc.fallocate64
    except AttributeError:
        try:
            fn = libc.fallocate
        except AttributeError:
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


class KeptDescriptors:
    """Descriptors of containers kept open for freeing (frees come in streams to the same few
    files: an open and a close per free were most of its cost). Opened once, one stays on the
    file kvcm created even if the path is later replaced: a free never punches a file put
    there by someone else. At most ``limit`` are kept, the least recently used closed first.
    Not thread-safe: the owning storage holds its lock around every call."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._fds: dict[str, int] = {}  # name -> descriptor, the least recent first

    def get(self, name: str, path: str) -> int:
        """The descriptor of container ``name`` (opened at ``path`` if not kept). :raises OSError:"""
        fd = self._fds.pop(name, None)
        if fd is None:
            fd = open_regular(path, os.O_WRONLY)
            while len(self._fds) >= self._limit:
                os.close(self._fds.pop(next(iter(self._fds))))
        self._fds[name] = fd  # the most recent last
        return fd

    def drop(self, name: str) -> None:
        """Close the descriptor of container ``name``, if one is kept."""
        fd = self._fds.pop(name, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
