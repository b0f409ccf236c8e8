"""Lock files that prove one owner and leave nothing behind.

A storage directory, an shm prefix and a data dir each belong to one kvcm at a time: an
exclusive ``flock`` on a lock file says so, and a clean stop unlinks the file while still holding
the lock, so no lock file outlives its owner and none can be taken over half-released. The file
names the holder's pid, for the messages of whoever finds it taken (a node following the leader
holds it only once it leads: :mod:`kvcm.ha.filelease`).

A lock file may sit in a directory other local users write (an shm prefix's lock in
``/dev/shm``): it is created private (0600), never opened through a symlink, never blocked on
(a FIFO planted at its name), and only a regular file counts. Whatever else sits at the name
makes the lock :class:`LockBusy`, like a lock another process holds: whoever waits for it tries
again, and gets it once that thing is gone.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading

from kvcm.errors import Conflict

log = logging.getLogger("kvcm.lockfile")


class LockBusy(Conflict):
    """Another owner (in this process or another) holds the lock, or something other than a lock
    file sits at its name: a state that passes, so worth trying again."""


# Flags of every open of a lock file: no symlink followed, no FIFO blocked on, no child inherits it.
_SAFE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# What opening a lock file's name fails with when someone planted a symlink, directory or FIFO there.
_PLANTED = {errno.ELOOP, errno.EISDIR, errno.ENXIO}


# lock file -> (fd, owner, holders, pid). A child of fork() inherits the table but not the
# ownership: only the process that took a lock may remove its file.
_held: dict[str, tuple[int, str, int, int]] = {}
_held_guard = threading.Lock()


def hold_lock_file(path: str, owner: str, what: str) -> None:
    """Take an exclusive ``flock`` on ``path`` for ``owner`` (a storage, a data dir), so no two
    of them (in this process or another) manage the same directory or shm prefix: each would
    sweep the other's live files as orphans.

    Re-entrant for the same owner only (a spec update opens the new backend before closing the
    old one); freed by :func:`drop_lock_file` or when the process dies. Where the filesystem
    has no locks (some NFS setups), kvcm goes on without one and says so.

    :func:`drop_lock_file` unlinks the file while still holding the lock, so a process that
    opened it just before may lock an unlinked inode: a lock only counts once the path still
    names the locked file, else it is taken again on the new one."""
    with _held_guard:
        if path in _held and _held[path][3] == os.getpid():
            fd, holder, count, pid = _held[path]
            if holder != owner:
                raise LockBusy(f"{what} is already used by {holder} in this process")
            _held[path] = (fd, holder, count + 1, pid)
            return
        for _ in range(100):  # each retry means another process just dropped its lock
            locked = _lock_once(path, what)
            if locked is not None:
                _held[path] = (locked, owner, 1, os.getpid())
                return
        raise Conflict(f"{what}: lock file {path} keeps being replaced; is another kvcm starting and stopping?")


def _lock_once(path: str, what: str) -> int | None:
    """A descriptor holding the lock on the file ``path`` names now; None if it was replaced."""
    import fcntl  # POSIX only, like the storages that use it

    fd = _open_lock(path, what)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LockBusy(f"{what} is in use by another process (lock file {path})") from None
    except OSError as exc:
        log.warning("%s: cannot lock %s (%s); make sure no other kvcm uses it", what, path, exc)
    try:
        st, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
            _write_pid(fd)
            return fd
    except FileNotFoundError:
        pass
    os.close(fd)
    return None


def _open_lock(path: str, what: str) -> int:
    """The lock file ``path`` names, created private if missing; LockBusy if the name holds
    anything but a regular file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _SAFE, 0o600)
    except OSError as exc:
        if exc.errno in _PLANTED:
            raise LockBusy(f"{what}: its lock file {path} cannot be opened ({exc.strerror}); "
                           "remove whatever is there") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LockBusy(f"{what}: its lock file {path} is not a regular file; remove whatever is there")
    return fd


def _write_pid(fd: int) -> None:
    """Say who holds the lock, for whoever finds it taken; the lock, not this text, is what counts."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # a read-only or full file system: the lock still holds


def lock_holder(path: str) -> int | None:
    """The pid the holder of ``path`` wrote into it, if the file says one."""
    try:
        fd = os.open(path, os.O_RDONLY | _SAFE)
    except OSError:
        return None
    try:
        text = os.read(fd, 32) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        return None
    finally:
        os.close(fd)
    return int(text) if text.strip().isdigit() else None


def still_held(path: str) -> bool:
    """Whether this process holds the lock on the file ``path`` names now: a lock file someone
    removed or replaced since it was taken is no lock any more."""
    with _held_guard:
        entry = _held.get(path)
    if entry is None or entry[3] != os.getpid():
        return False
    try:
        return os.path.samestat(os.fstat(entry[0]), os.stat(path, follow_symlinks=False))
    except OSError:
        return False


def drop_lock_file(path: str) -> None:
    with _held_guard:
        entry = _held.get(path)
        if entry is None:
            return
        fd, owner, count, pid = entry
        if pid != os.getpid():  # inherited across fork(): the parent's lock, not ours to drop
            del _held[path]
            os.close(fd)  # the parent's descriptor stays open: its lock holds
            return
        if count > 1:
            _held[path] = (fd, owner, count - 1, pid)
            return
        del _held[path]
        # Unlinked before the lock is released, so no other process can lock this file after
        # it is gone (see hold_lock_file); a clean stop leaves no lock file behind.
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                os.unlink(path)
        except OSError:
            pass  # already gone or replaced: not ours to remove
        os.close(fd)  # closing the last descriptor releases the flock
