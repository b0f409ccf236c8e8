"""The leader lease on one host without Redis: a lock file in a directory the nodes share
(``ha.coordination = "file:///dir"``), over the LMDB store of a data dir they share too.

Files in the directory:

* ``leader.lock`` — the leader holds an exclusive ``flock`` on it for its whole term
  (:mod:`kvcm.lockfile`: created private, never opened through a symlink, unlinked by a clean
  release while still locked). The kernel drops a dead process's flock, so ``kill -9`` of the
  leader frees it at once; followers try it every ``renew_ms``.
* ``leader.json`` — the record of the current term ``{"node_id", "endpoint", "epoch", "pid"}``,
  written as a new private file renamed over the old one when a term begins; followers read it
  to name the leader. A record whose process is gone, or that its holder marked released,
  names nobody.

Epochs: a term's epoch is one above both the last record's and the node's floor
(:class:`~kvcm.ha.floor.EpochFloor`), so no two terms share one.

What a flock does not do is expire: a leader that is paused (SIGSTOP, swap) keeps the lock, and
nobody takes over until it resumes or dies. It writes nothing meanwhile, so nothing is lost, and
followers keep answering reads. Should someone remove ``leader.lock`` by hand, a second node
could win a term, but not the store: the leader's LMDB store holds the data dir's own lock
(``kvcm.lock``) for as long as it is open, and the second node waits for it.

* ``members/`` — one announcement per node, ``{"node_id", "endpoint", "at"}``, rewritten every
  round (a new private file renamed over the old one), named by the hex of the node id; what
  ``get_manager_cluster_info`` lists. The leader removes those of nodes silent for ten leases.

The directory must belong to kvcm's user and be writable by nobody else: another local user who
could write there could hold the lock or replace the record. A directory that is not is refused.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Callable

from kvcm.backends.storage.safe_files import create_unique, open_regular
from kvcm.errors import Conflict, StartRefused
from kvcm.ha.campaign import MAX_MEMBERS, Campaign, Holder, parse_holder
from kvcm.ha.floor import EpochFloor
from kvcm.lockfile import LockBusy, drop_lock_file, hold_lock_file, still_held

log = logging.getLogger("kvcm.ha")

LOCK_FILE = "leader.lock"
RECORD_FILE = "leader.json"
MEMBERS_DIR = "members"
_MAX_RECORD = 4096  # a record kvcm writes is far smaller: a bigger file is not one of ours


def coordination_dir(uri: str) -> str:
    """The directory of a ``file:///dir`` coordination URI (absolute, no host part)."""
    if not uri.startswith("file:///"):
        raise ValueError(f"not a file:/// URI: {uri!r}")
    return os.path.normpath(uri[len("file://"):])


def check_private_dir(path: str) -> None:
    """Create ``path`` (0700) if missing; StartRefused unless it is a directory of this user
    that no other user may write."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        raise StartRefused(f"ha.coordination directory {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StartRefused(f"ha.coordination directory {path} is not a directory")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise StartRefused(f"ha.coordination directory {path} must belong to this user (uid {os.geteuid()}) and be "
                           f"writable by nobody else (it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): "
                           "another user could hold the leader lock or rewrite the leader's record there")


class FileLease(Campaign):
    """The leader lease of one node as a lock file in ``directory`` (see the module's text)."""

    coordination = "file"
    errors = (OSError, Conflict)

    def __init__(self, directory: str, node_id: str, endpoint: str, lease_ms: int = 3000, renew_ms: int = 1000,
                 on_change: Callable[[bool], None] | None = None, campaign_delay_ms: int = 5000,
                 floor: EpochFloor | None = None) -> None:
        super().__init__(node_id, endpoint, lease_ms, renew_ms, on_change, campaign_delay_ms, floor)
        check_private_dir(directory)
        self.directory = directory
        self.lock_path = os.path.join(directory, LOCK_FILE)
        self.record_path = os.path.join(directory, RECORD_FILE)
        self.members_dir = os.path.join(directory, MEMBERS_DIR)
        check_private_dir(self.members_dir)
        self._owner = f"the leader lease of node {node_id} ({id(self):x})"

    def try_acquire(self) -> bool:
        sent = time.monotonic()
        wall = time.time()
        try:
            hold_lock_file(self.lock_path, self._owner, f"the leader lock in {self.directory}")
        except LockBusy:
            self._saw(self._read_holder(), sent)
            return False
        try:
            epoch = self._next_epoch()
            record = json.dumps({"node_id": self.node_id, "endpoint": self.endpoint, "epoch": epoch,
                                 "pid": os.getpid()}).encode()
            self._write_record(record)
        except BaseException:
            drop_lock_file(self.lock_path)
            raise
        self._saw(Holder(self.node_id, self.endpoint, epoch), sent)
        self._won(record, epoch, sent, wall)
        return True

    def _next_epoch(self) -> int:
        last = self._read_holder(alive_only=False)
        floor = self._floor.get() if self._floor is not None else 0
        epoch = max(last.epoch if last is not None else 0, floor) + 1
        if self._floor is not None:
            self._floor.raise_to(epoch)  # written through before the term acts
        return epoch

    def renew(self) -> bool:
        if self._record is None:
            return False
        sent = time.monotonic()
        if still_held(self.lock_path):
            self._extend(sent, time.time())
            return True
        self._lose(f"{self.lock_path} was removed or replaced")
        return False

    def _lose(self, why: str) -> None:
        super()._lose(why)
        drop_lock_file(self.lock_path)  # a term that ended holds no lock: the next one takes it anew

    def _give_up(self, record: bytes) -> None:
        try:
            self._write_record(json.dumps({**json.loads(record), "released": True}).encode())
        finally:
            drop_lock_file(self.lock_path)

    def _read_holder(self, alive_only: bool = True) -> Holder | None:
        raw = self._read_record()
        if raw is None:
            return None
        holder = parse_holder(raw)
        if holder is None or not alive_only:
            return holder
        try:
            obj = json.loads(raw)
            gone = bool(obj.get("released")) or not _alive(int(obj.get("pid", 0)))
        except (ValueError, TypeError, AttributeError):
            return None
        return None if gone else holder

    def _announce(self, record: bytes) -> None:
        self._write_file(self.members_dir, self._member_name(self.node_id), record)

    def _read_members(self) -> list[bytes]:
        found: list[bytes] = []
        with os.scandir(self.members_dir) as entries:
            for entry in entries:
                if not _is_member_name(entry.name):
                    continue  # a temporary file being renamed, or nothing of ours
                raw = self._read_file(entry.path)
                if raw is not None:
                    found.append(raw)
                if len(found) >= MAX_MEMBERS:
                    break
        return found

    def _forget_members(self, node_ids: list[str]) -> None:
        for node_id in node_ids:
            _unlink_quietly(os.path.join(self.members_dir, self._member_name(node_id)))

    @staticmethod
    def _member_name(node_id: str) -> str:
        return node_id.encode().hex() + ".json"

    def _read_record(self) -> bytes | None:
        return self._read_file(self.record_path)

    def _read_file(self, path: str) -> bytes | None:
        try:
            fd = open_regular(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as exc:  # a symlink or a FIFO at its name: not a record (replaced when next written)
            log.warning("coordination file %s unreadable: %s", path, exc)
            return None
        try:
            raw = os.read(fd, _MAX_RECORD + 1)
        finally:
            os.close(fd)
        return raw if len(raw) <= _MAX_RECORD else None

    def _write_record(self, record: bytes) -> None:
        self._write_file(self.directory, RECORD_FILE, record, sync=True)

    @staticmethod
    def _write_file(directory: str, name: str, record: bytes, sync: bool = False) -> None:
        """``record`` as ``directory/name``: a new private file renamed over the old one
        (``sync``: on disk first; an announcement is rewritten every round and need not be)."""
        tmp, fd = create_unique(os.path.join(directory, f".{name}."))
        try:
            os.write(fd, record)
            if sync:
                os.fsync(fd)
            os.replace(tmp, os.path.join(directory, name))
        except BaseException:
            _unlink_quietly(tmp)
            raise
        finally:
            os.close(fd)


def _is_member_name(name: str) -> bool:
    stem, dot, ext = name.partition(".")
    if dot != "." or ext != "json" or not stem:
        return False
    try:
        bytes.fromhex(stem)
    except ValueError:
        return False
    return True


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (the record's holder; pid 0 names nobody)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: it exists
    return True


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


__all__ = ["LOCK_FILE", "MEMBERS_DIR", "RECORD_FILE", "FileLease", "check_private_dir", "coordination_dir"]
