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
* a marker of a data dir provably gone from this host (:func:`owner_gone`, proven through the
  host key of :mod:`~kvcm.backends.storage.host`) → taken over whatever the owner says: logged,
  counted, the old ids kept as ``adopted`` (or, on ``discard`` or ``Owner.takeover_orphans``
  "delete", their containers deleted).

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
import dataclasses
import hashlib
import hmac
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvcm.backends.migrations import STORAGE_MARKER
from kvcm.backends.storage.host import TAKEOVERS, host_key, load_key, machine_id
from kvcm.backends.storage.safe_files import create_unique, open_regular
from kvcm.errors import InvalidArgument

log = logging.getLogger("kvcm.backends.storage")

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
    host: str = ""  # the machine id of the host whose kvcm wrote it ("": before hosts were recorded)
    # Its signature verified under the reader's data dir key: kvcm of this data dir wrote it.
    authentic: bool = field(default=False, compare=False)
    # Its host signature verified under this host's key: a kvcm on this host wrote it, so its
    # host and data dir are kvcm's word (the data dir's own key may be gone with it).
    host_signed: bool = field(default=False, compare=False)
    mac: str = field(default="", compare=False, repr=False)  # the data dir signature as read
    signed: bytes = field(default=b"", compare=False, repr=False)  # what both signatures cover
    # Why its owner is proven gone, when this open took the root over from it.
    takeover: str = field(default="", compare=False)

    def ids(self) -> set[str]:
        """Every storage id whose containers this marker vouches for."""
        return {self.storage_id, *self.adopted}

    def describe(self) -> str:
        where = f" at {self.data_dir}" if self.data_dir else ""
        host = f" on host {self.host}" if self.host else ""
        return f"storage {self.storage!r} (id {self.storage_id}) of kvcm data dir {self.data_dir_id}{where}{host}"

    def signed_with(self, key: bytes) -> bool:
        """Whether the data dir signature verifies under ``key`` (another data dir's key)."""
        return bool(key and self.mac and hmac.compare_digest(
            self.mac.encode(), hmac.new(key, self.signed, hashlib.sha256).hexdigest().encode()))


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
    # On a takeover (owner proven gone): "keep" its containers unindexed, or "delete" them
    # (``storage.orphans``). A live or unprovable owner is never affected: ``on_foreign`` rules;
    # an explicit ``adopt`` keeps them and ``discard`` deletes them whatever this says.
    takeover_orphans: str = "keep"

    def marker(self, storage: str, adopted: tuple[str, ...] = ()) -> Marker:
        return Marker(self.storage_id, storage, self.data_dir_id, self.data_dir, adopted)

    def owns(self, marker: Marker) -> bool:
        if marker.data_dir_id != self.data_dir_id:
            return False
        return marker.storage_id == self.storage_id or (bool(self.data_dir_id) and marker.storage_id not in self.taken)

    def discards(self, previous: Marker) -> bool:
        """Whether the containers ``previous`` vouches for are to be deleted: asked for
        (``discard``), or a takeover under ``takeover_orphans == "delete"`` unless ``adopt`` was asked."""
        if self.on_foreign != "refuse":
            return self.on_foreign == "discard"
        return bool(previous.takeover) and self.takeover_orphans == "delete"

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
    """The data dir's marker key, made on first use when ``create`` (b"" when there is none)."""
    return load_key(data_dir, KEY_FILE, create)


def _signed(body: Mapping[str, object], path: str) -> bytes:
    """What a marker's signatures cover: its fields and where it lies, so a signed marker copied
    elsewhere proves nothing there."""
    where = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    return json.dumps({**body, "path": where}, sort_keys=True).encode()


def _signature(key: bytes, signed: bytes) -> str:
    return hmac.new(key, signed, hashlib.sha256).hexdigest()


def _verifies(key: bytes, mac: object, signed: bytes) -> bool:
    return bool(key) and isinstance(mac, str) and hmac.compare_digest(mac.encode(), _signature(key, signed).encode())


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
                        str(data.get("data_dir", "")), adopted, str(data.get("host", "")))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise ForeignDirectory(f"the ownership marker {path} is not one kvcm wrote; move it away to go on") from None
    mac, host_mac = data.pop("mac", None), data.pop("host_mac", None)
    signed = _signed(data, path)
    return dataclasses.replace(marker, authentic=_verifies(key, mac, signed),
                               host_signed=_verifies(host_key(create=False), host_mac, signed),
                               mac=mac if isinstance(mac, str) else "", signed=signed)


def write_marker(path: str, marker: Marker, key: bytes = b"") -> None:
    """Write ``marker``, signed with ``key`` if there is one, atomically (a crash leaves the old
    one or the new one, never half), private (0600) and through a new file of a random name."""
    body: dict[str, object] = {"kvcm_marker": MARKER_VERSION, "storage_id": marker.storage_id, "storage": marker.storage,
                            "data_dir_id": marker.data_dir_id, "data_dir": marker.data_dir,
                            "adopted": list(marker.adopted), "host": marker.host or machine_id()}
    signed, host = _signed(body, path), host_key()
    if key:
        body["mac"] = _signature(key, signed)
    if host:
        body["host_mac"] = _signature(host, signed)
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
MARKER_SUFFIX = "kvcm-storage"  # a shm marker is ``<prefix>kvcm-storage``; a file root's ``.kvcm-storage``


def claim(path: str, owner: Owner, storage: str, where: str, files: int) -> Marker | None:
    """Check (and write if needed) the marker at ``path`` for ``owner``; see the module docstring.

    ``files``: how many entries of interest the directory holds besides kvcm's own control
    files. Returns the *previous* foreign marker when ``owner`` adopts, discards or takes over
    one (the caller deletes that id's containers when ``owner.discards`` it, only if it is
    ``authentic`` or a ``takeover``), else None. Raises ForeignDirectory."""
    found = read_marker(path, owner.key)
    if found is not None and owner.vouches(found) and owner.owns(found):
        if found.storage_id != owner.storage_id:  # a stale marker of this data dir
            write_marker(path, owner.marker(storage, _kept(found)), owner.key)
        elif not found.authentic or (not found.host_signed and host_key()):  # re-signed with this data dir's keys
            write_marker(path, owner.marker(storage), owner.key)
        return None
    if found is None:
        if files and owner.on_foreign == "refuse":
            raise ForeignDirectory(
                f"{where} is not empty ({files} entries) and carries no kvcm ownership marker; "
                f"kvcm refuses to manage a directory it did not create: {_REMEDY}",
                None, files,
            )
    else:
        gone = owner_gone(found, owner)
        if gone:
            found = dataclasses.replace(found, takeover=gone)
            TAKEOVERS.add()
            log.warning("%s: taking the root over from %s: %s; its containers are %s", where, found.describe(), gone,
                        "deleted" if owner.discards(found) else "kept, unindexed")
        elif owner.on_foreign == "refuse":
            raise ForeignDirectory(_foreign(where, found, owner, path), found, files)
    # Only a signed marker's ids are provably kvcm's: a forged one's are never kept.
    proven = found is not None and (found.authentic or bool(found.takeover))
    kept = _kept(found) if found is not None and proven and not owner.discards(found) else ()
    write_marker(path, owner.marker(storage, kept), owner.key)
    return found


def owner_gone(found: Marker, owner: Owner) -> str:
    """Why the data dir that wrote ``found`` provably no longer lives ("" unless proven). Proof
    needs this host's signature on the marker (so its host and data dir path are kvcm's word),
    this host named, and at that path either nothing, or this very data dir under another id,
    or a data dir whose key does not verify the marker (another data dir lives there now)."""
    if not found.host_signed or found.host != machine_id() or found.data_dir_id == owner.data_dir_id:
        return ""
    where = found.data_dir
    if not where or not os.path.isabs(where):
        return ""
    if not os.path.lexists(where):
        return f"its data dir {where} no longer exists on this host"
    if owner.data_dir and owner.data_dir_id and os.path.realpath(where) == os.path.realpath(owner.data_dir):
        return f"its data dir {where} now holds data dir {owner.data_dir_id}"
    try:
        key = marker_key(where, create=False)
    except OSError:  # unreadable (another user's) or not kvcm's: nothing proven
        return ""
    if key and not found.signed_with(key):
        return f"its data dir {where} now holds another data dir (its key does not sign the marker)"
    return ""


def release_target(path: str) -> str:
    """What ``kvcm storage release`` takes for the marker at ``path``: a file root's directory,
    or a shm prefix as a path (``/dev/shm/<prefix>``)."""
    if os.path.basename(path) == FILE_MARKER:
        return os.path.dirname(path)
    return path[: -len(MARKER_SUFFIX)] if path.endswith(MARKER_SUFFIX) else path


def _foreign(where: str, found: Marker, owner: Owner, path: str) -> str:
    release = (f"; if that data dir is gone for good, release the root with `kvcm storage release "
               f"{release_target(path)}` (run as kvcm's user on the host that wrote the marker)")
    if found.data_dir_id == owner.data_dir_id and not owner.vouches(found):
        return (f"{where} carries an ownership marker naming {found.describe()} that kvcm cannot authenticate "
                f"(it is not signed with this data dir's key); nothing there was touched: {_REMEDY}{release}")
    return f"{where} belongs to {found.describe()}; nothing there was touched: {_REMEDY}{release}"


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
SHM_MARKER_SUFFIX = MARKER_SUFFIX


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
