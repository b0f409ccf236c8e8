"""Lock files that prove one owner and leave nothing behind.

A storage directory, an shm prefix and a data dir each belong to one kvcm at a time: an
exclusive ``flock`` on a lock file says so, and a clean stop unlinks the file while still holding
the lock, so no lock file outlives its owner and none can be taken over half-released.
"""

from __future__ import annotations

import logging
import os
import threading

from kvcm.errors import Conflict

log = logging.getLogger("kvcm.lockfile")


class LockBusy(Conflict):
    """Another owner (in this process or another) holds the lock."""


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

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
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
            return fd
    except FileNotFoundError:
        pass
    os.close(fd)
    return None


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
