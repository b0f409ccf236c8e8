"""Ownership a storage can prove: the marker kvcm writes in every directory it manages.

kvcm creates, sweeps and deletes container files. Before it touches a directory it must know
the directory is its own, so each ``file`` root and each ``shm`` prefix carries a *marker*
(``.kvcm-storage``, or ``<prefix>kvcm-storage`` for shm) naming:

* ``storage_id`` — the storage's unique id (8 hex digits, assigned by the registry when the
  storage is added, never reused); it is also part of every container name kvcm generates
  (``s4096/<id>-00000012.kv``, ``<prefix><id>-12``), so a name alone tells whose file it is;
* ``data_dir_id`` — the id of the kvcm data dir whose metadata records the storage's blocks
  (kept in the metadata store; a new store means a new id).

Opening a storage (:func:`claim`) compares the marker with the :class:`Owner` the caller
brings:

* marker names this storage → proceed;
* no marker and the directory holds nothing of interest → write the marker, proceed;
* no marker but files there → refused (:class:`ForeignDirectory`), unless the owner
  says ``adopt`` (the admin asked for it, or a storage from before markers existed): then the
  marker is written; files kvcm did not name are never swept or deleted anyway;
* a marker of another storage or another data dir → refused, unless ``adopt`` (keep the old
  files, untouched, under the new marker) or ``discard`` (the caller may then delete the
  containers named with the old storage id: provably kvcm's).

A marker is plain JSON anyone able to write the directory could forge, and the data dir's id it
names is no secret. So kvcm signs each marker it writes (an HMAC over its fields and its own
path, keyed by a random secret kept in the data dir, ``marker.key``, mode 0600, made once) and
only takes a marker for its own when the signature verifies (``Marker.authentic``). One
exception keeps the markers of earlier kvcm versions (unsigned) and of another HA node (signed
with that node's data dir key) working: a marker naming exactly the storage id and data dir id
the metadata records for the storage being opened (``Owner.recorded``); kvcm signs it again
with its own key. A forged marker therefore proves nothing: its directory is foreign, its ids
are never adopted, and ``discard`` deletes nothing on its word.

The sweep only ever removes names carrying the storage's own id (see the backends).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvcm.backends.migrations import STORAGE_MARKER
from kvcm.backends.storage.safe_files import create_unique, open_regular
from kvcm.errors import InvalidArgument

MARKER_VERSION = STORAGE_MARKER.current
#: The data dir's secret that signs markers (hex text, mode 0600, created once).
KEY_FILE = "marker.key"

#: What ``Owner.on_foreign`` may say: refuse (the default), adopt, discard.
FOREIGN_CHOICES = ("refuse", "adopt", "discard")


class ForeignDirectory(InvalidArgument):
    """A directory (or shm prefix) kvcm cannot prove it owns; nothing in it was touched."""

    def __init__(self, message: str, marker: Marker | None = None, files: int = 0) -> None:
        super().__init__(message)
        self.marker = marker
        self.files = files


@dataclass(frozen=True)
class Marker:
    storage_id: str
    storage: str  # the storage's name when the marker was written
    data_dir_id: str
    data_dir: str  # for messages: where that data dir was
    # Ids of earlier owners whose containers were adopted (kept, unindexed): still provably
    # kvcm's, so a later ``discard`` may delete them.
    adopted: tuple[str, ...] = ()
    # Its signature verified under the reader's data dir key: kvcm of this data dir wrote it.
    authentic: bool = field(default=False, compare=False)

    def ids(self) -> set[str]:
        """Every storage id whose containers this marker vouches for."""
        return {self.storage_id, *self.adopted}

    def describe(self) -> str:
        where = f" at {self.data_dir}" if self.data_dir else ""
        return f"storage {self.storage!r} (id {self.storage_id}) of kvcm data dir {self.data_dir_id}{where}"


@dataclass(frozen=True)
class Owner:
    """Who opens a storage: its id, the data dir's id, and what to do with a foreign directory."""

    storage_id: str
    data_dir_id: str = ""
    data_dir: str = ""
    on_foreign: str = "refuse"
    # Ids of the *other* storages this data dir records. A marker of this data dir naming none of
    # them is stale (a storage since removed, or an open that failed before its id was kept).
    taken: frozenset[str] = frozenset()
    key: bytes = field(default=b"", repr=False)  # the data dir's marker key (b"": none, markers unsigned)
    # The metadata already records this storage with ``storage_id`` (not a storage being added).
    recorded: bool = False

    def marker(self, storage: str, adopted: tuple[str, ...] = ()) -> Marker:
        return Marker(self.storage_id, storage, self.data_dir_id, self.data_dir, adopted)

    def owns(self, marker: Marker) -> bool:
        if marker.data_dir_id != self.data_dir_id:
            return False
        return marker.storage_id == self.storage_id or (bool(self.data_dir_id) and marker.storage_id not in self.taken)

    def vouches(self, marker: Marker) -> bool:
        """Whether ``marker`` is kvcm's word: signed with this data dir's key, or unsigned (an
        earlier kvcm; another HA node's key) but naming exactly the storage and data dir the
        metadata records for this storage, which no one outside kvcm can make it record."""
        return marker.authentic or (self.recorded and marker.storage_id == self.storage_id
                                    and marker.data_dir_id == self.data_dir_id)


def standalone_owner(storage_type: str, name: str) -> Owner:
    """The owner of a backend opened outside a kvcm registry (tools, tests): a stable id derived
    from type and name, no data dir, so no key: its own unsigned marker is what it records."""
    return Owner(hashlib.sha256(f"{storage_type}:{name}".encode()).hexdigest()[:8], recorded=True)


def marker_key(data_dir: str, create: bool = True) -> bytes:
    """The data dir's marker key, made on first use when ``create`` (b"" when there is none).
    Made under a random name and linked into place, so a crash never leaves a half key and two
    makers agree on one."""
    path = os.path.join(data_dir, KEY_FILE)
    key = _read_key(path)
    if key or not create:
        return key
    os.makedirs(data_dir, 0o700, exist_ok=True)
    tmp, fd = create_unique(f"{path}.tmp.")
    try:
        try:
            os.write(fd, secrets.token_hex(32).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # another maker won: its key counts
            os.link(tmp, path)
    finally:
        os.unlink(tmp)
    return _read_key(path)


def _read_key(path: str) -> bytes:
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return b""
    try:
        text = os.read(fd, 256).strip()
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except ValueError:
        key = b""
    if len(key) < 16:
        raise OSError(f"the marker key {path} is not one kvcm wrote; move it away (kvcm makes a new one)")
    return key


def _signature(key: bytes, body: Mapping[str, object], path: str) -> str:
    """The HMAC of a marker's fields and of where it lies, so a signed marker copied elsewhere
    proves nothing there."""
    where = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    signed = json.dumps({**body, "path": where}, sort_keys=True).encode()
    return hmac.new(key, signed, hashlib.sha256).hexdigest()


def read_marker(path: str, key: bytes = b"") -> Marker | None:
    """The marker at ``path``; None if there is none. A marker that cannot be parsed, or a name
    holding a symlink, FIFO or directory, is a foreign one (never silently replaced, never
    blocked on). ``key``: the data dir's marker key, to tell whether kvcm signed it."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ForeignDirectory(f"cannot read the ownership marker {path}: {exc.strerror}; move it away to go on") \
            from None
    try:
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        data: object = json.loads(raw)
        if not isinstance(data, dict):
            raise TypeError("not a map")
        adopted = tuple(str(i) for i in data.get("adopted", ()))
        marker = Marker(str(data["storage_id"]), str(data.get("storage", "")), str(data["data_dir_id"]),
                        str(data.get("data_dir", "")), adopted)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise ForeignDirectory(f"the ownership marker {path} is not one kvcm wrote; move it away to go on") from None
    mac = data.pop("mac", None)
    authentic = bool(key) and isinstance(mac, str) and hmac.compare_digest(
        mac.encode(), _signature(key, data, path).encode())
    return Marker(marker.storage_id, marker.storage, marker.data_dir_id, marker.data_dir, adopted, authentic)


def write_marker(path: str, marker: Marker, key: bytes = b"") -> None:
    """Write ``marker``, signed with ``key`` if there is one, atomically (a crash leaves the old
    one or the new one, never half), private (0600) and through a new file of a random name."""
    body: dict[str, object] = {"kvcm_marker": MARKER_VERSION, "storage_id": marker.storage_id, "storage": marker.storage,
                            "data_dir_id": marker.data_dir_id, "data_dir": marker.data_dir,
                            "adopted": list(marker.adopted)}
    if key:
        body["mac"] = _signature(key, body, path)
    tmp, fd = create_unique(f"{path}.tmp.")
    try:
        os.write(fd, json.dumps(body, sort_keys=True).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


#: What an operator can do about a directory kvcm did not create (one line, both places it meets it).
_REMEDY = ("give the storage another directory, or take this one over with add_storage's adopt_directory: true "
           "(at start-up: kvcm serve --adopt-orphans); its files are kept, and kvcm never deletes files it did not name")


def claim(path: str, owner: Owner, storage: str, where: str, files: int) -> Marker | None:
    """Check (and write if needed) the marker at ``path`` for ``owner``; see the module docstring.

    ``files``: how many entries of interest the directory holds besides kvcm's own control
    files. Returns the *previous* foreign marker when ``owner`` adopts or discards one (the
    caller deletes that id's containers on ``discard``, only if it is ``authentic``), else
    None. Raises ForeignDirectory."""
    found = read_marker(path, owner.key)
    if found is not None and owner.vouches(found) and owner.owns(found):
        if found.storage_id != owner.storage_id:  # a stale marker of this data dir
            write_marker(path, owner.marker(storage, _kept(found)), owner.key)
        elif not found.authentic:  # an earlier kvcm's or another node's: signed with this key now
            write_marker(path, owner.marker(storage), owner.key)
        return None
    if found is None:
        if files and owner.on_foreign == "refuse":
            raise ForeignDirectory(
                f"{where} is not empty ({files} entries) and carries no kvcm ownership marker; "
                f"kvcm refuses to manage a directory it did not create: {_REMEDY}",
                None, files,
            )
    elif owner.on_foreign == "refuse":
        raise ForeignDirectory(_foreign(where, found, owner), found, files)
    # Only a signed marker's ids are provably kvcm's: a forged one's are never kept.
    kept = _kept(found) if found is not None and found.authentic and owner.on_foreign == "adopt" else ()
    write_marker(path, owner.marker(storage, kept), owner.key)
    return found


def _foreign(where: str, found: Marker, owner: Owner) -> str:
    if found.data_dir_id == owner.data_dir_id and not owner.vouches(found):
        return (f"{where} carries an ownership marker naming {found.describe()} that kvcm cannot authenticate "
                f"(it is not signed with this data dir's key); nothing there was touched: {_REMEDY}")
    return f"{where} belongs to {found.describe()}; nothing there was touched: {_REMEDY}"


def _kept(marker: Marker) -> tuple[str, ...]:
    return tuple(sorted(marker.ids()))


@dataclass(frozen=True)
class Leftover:
    """A directory (or shm prefix) holding containers of a data dir whose metadata is gone."""

    where: str
    files: int
    marker: Marker | None


#: Where the default ``file`` storage lives, under the data dir.
DEFAULT_ROOT = "blocks"
FILE_MARKER = ".kvcm-storage"
SHM_MARKER_SUFFIX = "kvcm-storage"


def leftovers(data_dir: str, shm_dir: str = "/dev/shm") -> list[Leftover]:
    """Storages that still hold blocks recorded by the metadata of ``data_dir``: the default
    root (marked or not: it is kvcm's own place), any marked directory up to two levels under
    the data dir, and shm prefixes whose marker names this data dir (signed with its key, once
    it has one: anyone may write a marker in ``/dev/shm``). Reads only."""
    data_dir = os.path.abspath(data_dir)
    found: list[Leftover] = []
    default = os.path.join(data_dir, DEFAULT_ROOT)
    try:
        key = marker_key(data_dir, create=False)
    except OSError:
        key = b""
    for directory in _marked_dirs(data_dir, default):
        files = sum(1 for _ in _data_files(directory))
        marker = _safe_marker(os.path.join(directory, FILE_MARKER), key)
        if files:
            found.append(Leftover(directory, files, marker))
    with contextlib.suppress(OSError):
        for entry in os.scandir(shm_dir):
            if not entry.name.endswith(SHM_MARKER_SUFFIX):
                continue
            marker = _safe_marker(entry.path, key)
            if marker is None or os.path.abspath(marker.data_dir or "/nowhere") != data_dir:
                continue
            if key and not marker.authentic:
                continue
            prefix = entry.name[: -len(SHM_MARKER_SUFFIX)]
            files = sum(1 for e in os.scandir(shm_dir)
                        if e.name.startswith(prefix) and e.name[len(prefix):].split("-")[0] == marker.storage_id)
            if files:
                found.append(Leftover(f"{shm_dir}/{prefix}*", files, marker))
    return found


def _marked_dirs(data_dir: str, default: str) -> list[str]:
    dirs = [default] if os.path.isdir(default) else []
    for depth1 in _subdirs(data_dir):
        for directory in [depth1, *_subdirs(depth1)]:
            if directory != default and os.path.exists(os.path.join(directory, FILE_MARKER)):
                dirs.append(directory)
    return dirs


def _subdirs(directory: str) -> list[str]:
    try:
        return [e.path for e in os.scandir(directory) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _data_files(directory: str) -> list[str]:
    """Block files of a ``file`` root: regular files in its ``s<size>`` subdirectories."""
    out: list[str] = []
    for sub in _subdirs(directory):
        name = os.path.basename(sub)
        if name[:1] == "s" and name[1:].isdigit():
            with contextlib.suppress(OSError):
                out.extend(e.path for e in os.scandir(sub) if e.is_file(follow_symlinks=False))
    return out


def _safe_marker(path: str, key: bytes = b"") -> Marker | None:
    try:
        return read_marker(path, key)
    except ForeignDirectory:
        return None


__all__ = ["FOREIGN_CHOICES", "KEY_FILE", "ForeignDirectory", "Leftover", "Marker", "Owner", "claim", "leftovers",
           "marker_key", "read_marker", "standalone_owner", "write_marker"]
