"""The storage backend contract: where kvcm hands out space for KV blocks, and how URIs look.

kvcm never moves KV bytes. A storage backend only *allocates* URIs (and the space behind them
when kvcm owns that space, as for ``file`` and ``shm``), accounts usage, frees space on delete
and probes health; its ``inventory`` lets ``CacheManager.check`` compare what it holds with the
metadata. Clients read and write the block bytes at the URIs themselves.

Every backend implements :class:`StorageBackend`; :mod:`kvcm.storage.backends` keeps the
registry keyed by type name. This module also holds what several backends share: the URI
codec (Tair's ``proto://host<path>?k=v`` with params sorted by key and no escaping) and the typed
decoder of every URI format (:func:`parse_block_uri`, also :mod:`kvcm.blocks`'s), a strict
spec reader, safe opening of files in directories others may write, hole punching, and the slot
pool of ``file``/``shm``.

URI invariant (as in Tair KVCM): the URI *host* is the storage's ``global_unique_name``, so a
location can always be traced back to the storage that owns it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import re
import secrets
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import msgspec

from kvcm.errors import InvalidArgument
from kvcm.schema import suggest

log = logging.getLogger("kvcm.storage")

T = TypeVar("T")


@runtime_checkable
class StorageBackend(Protocol):
    """One opened storage. Thread-safe: the RPC thread allocates and releases while the deleter
    thread deletes and the health thread probes, so every implementation guards its state with
    its own lock (``health`` never takes it: a slow probe must not stall allocation)."""

    type_name: str  # "file", "shm", "3fs", "mooncake", "tairmempool"
    name: str  # the storage's global_unique_name; the host part of every URI it hands out

    def open(self) -> None:
        """Prepare the storage (create the root, discover existing containers)."""

    def close(self) -> None:
        """Stop handing out space. Never destroys data: a restarted kvcm finds it again."""

    def allocate(self, count: int, size: int) -> list[str]:
        """``count`` URIs for blocks of ``size`` bytes, reserved until released or deleted.

        All or nothing. Raises ``CapacityError`` (NO_STORAGE_AVAILABLE when closed,
        CAPACITY_EXHAUSTED when full) so the caller can fall over to the next storage."""

    def release(self, uris: Iterable[str]) -> None:
        """Give back URIs whose metadata never committed (nothing for an owner to delete)."""

    def reserve(self, uris: Iterable[str]) -> None:
        """Start-up recovery: mark URIs found in the metadata as used (idempotent). Every valid
        URI is reserved; then InvalidArgument reports any bad ones (skip ``sweep`` then)."""

    def delete(self, uris: Iterable[str]) -> list[str]:
        """Free data and slots. Returns deletion tasks for an external owner ([] when freed here)."""

    def exists(self, uri: str) -> bool:
        """Whether ``uri`` is currently reserved here (and its container is present)."""

    def usage(self) -> dict[str, int]:
        """``bytes_used``, ``bytes_capacity`` (0 = unknown/unlimited), ``slots_used``, ..."""

    def health(self) -> bool:
        """A real probe (write/read/remove a probe object); never raises."""

    def sweep(self) -> int:
        """After recovery (``reserve``): remove containers no reserved URI points at; count removed."""

    def inventory(self) -> Inventory:
        """Everything this storage holds reserved, and what lies on disk: what
        ``CacheManager.check`` compares with the metadata. Costs a pass over every reserved slot."""

    # Optional (``file``, ``shm``): ``damaged() -> bool``, ``lost(uris) -> set[str]`` (the URIs
    # whose bytes are gone) and ``rescan() -> int`` (look again; count newly damaged containers).
    # Storages kvcm cannot look into (external ones) only learn of lost blocks from clients.
    # Optional (``file``, ``shm``): ``reusable(uris, sizes) -> list[bool]``, whether a reserved
    # slot can take a new block as it is (in-line eviction hands it from victim to writer), and
    # ``intact() -> bool``, whether it would say yes to every slot a record names.


# ---------------------------------------------------------------------------------- inventory


@dataclass(frozen=True)
class Slot:
    """Where one reserved URI's bytes live: ``container`` ("" for a store kvcm does not own),
    the byte range ``[offset, offset + size)`` in it."""

    container: str
    offset: int
    size: int


@dataclass(frozen=True)
class Inventory:
    """One storage's own view of what it holds, for comparing it with the metadata.

    ``reserved`` lists every reserved URI; ``containers`` the containers it accounts, with the
    number of slots used in each; ``on_disk`` the containers present with the names kvcm gives
    them, and their sizes in bytes (None where the space belongs to another system, so there
    is nothing to list); ``orphans`` the containers found at open that no reserved URI
    claimed and no sweep removed yet."""

    reserved: Mapping[str, Slot]
    containers: Mapping[str, int]
    on_disk: Mapping[str, int] | None
    orphans: frozenset[str]
    slots_used: int
    bytes_used: int


# --------------------------------------------------------------------------------------- URIs


@dataclass(frozen=True)
class ParsedUri:
    """``scheme://host<path>?params``; ``path`` keeps its leading "/" (or is empty)."""

    scheme: str
    host: str
    path: str
    params: Mapping[str, str] = field(default_factory=dict)

    def int_param(self, key: str) -> int:
        """A required non-negative integer query parameter (``size``, ``blkid``, ``offset``)."""
        raw = self.params.get(key)
        if raw is None or not (raw.isascii() and raw.isdigit()):
            raise InvalidArgument(f"uri {self}: parameter {key!r} must be a non-negative integer")
        return int(raw)

    def __str__(self) -> str:
        return format_uri(self.scheme, self.host, self.path, self.params)


def format_uri(scheme: str, host: str, path: str, params: Mapping[str, Any] | None = None) -> str:
    """Tair's serialization: params sorted by key, no escaping (values must not contain & = ?)."""
    query = "&".join(f"{k}={params[k]}" for k in sorted(params)) if params else ""
    return f"{scheme}://{host}{path}" + (f"?{query}" if query else "")


def parse_uri(uri: str) -> ParsedUri:
    """Inverse of :func:`format_uri`. Raises InvalidArgument on anything malformed."""
    scheme, sep, rest = uri.partition("://")
    if not sep or not scheme or not rest:
        raise InvalidArgument(f"malformed storage uri {uri!r}: expected scheme://host/path?k=v")
    base, _, query = rest.partition("?")
    slash = base.find("/")
    host, path = (base, "") if slash < 0 else (base[:slash], base[slash:])
    if not host:
        raise InvalidArgument(f"malformed storage uri {uri!r}: empty host (storage name)")
    return ParsedUri(scheme, host, path, _parse_query(uri, query))


def _parse_query(uri: str, query: str) -> dict[str, str]:
    params: dict[str, str] = {}
    for part in filter(None, query.split("&")):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise InvalidArgument(f"malformed storage uri {uri!r}: bad query part {part!r}")
        params[key] = value
    return params


# ---------------------------------------------------------------------------- block URIs, typed
#
# The one decoder of every URI format kvcm hands out, shared by the backends (which check that a
# URI is theirs) and by client code (:mod:`kvcm.blocks`, which reads and writes the bytes). It
# only decodes and checks the form; which storage holds the URI is the caller's question.

#: A ``file`` container path: ``s<size>/<storage id>-<index>.kv`` (older files lack ``<id>-``).
FILE_PATH = re.compile(r"s([1-9][0-9]*)/(?:([0-9a-f]{8})-)?([0-9]{8,})\.kv")
#: Query values are at most int64: nothing kvcm hands out is larger, and a 4 KiB run of digits
#: must not turn into an int a bounds check then multiplies.
MAX_URI_INT = (1 << 63) - 1
_MAX_DIGITS = len(str(MAX_URI_INT))


def _q(uri: str) -> str:
    """A URI quoted in an error, cut short: a hostile one may be megabytes long."""
    return repr(uri if len(uri) <= 200 else uri[:200] + "...")


class BlockUri(msgspec.Struct, frozen=True):
    """A decoded storage URI: the storage name (the URI host) and the block's ``size`` in bytes.

    ``uri`` keeps the text it was decoded from. Subclasses add the type's own parts. A msgspec
    Struct rather than a dataclass: built once per block I/O, and several times cheaper."""

    uri: str
    storage: str
    size: int

    storage_type: ClassVar[str] = ""


class FileUri(BlockUri, frozen=True):
    """``file://<storage>/<path>?blkid=N&size=S``: ``size`` bytes at ``blkid * size`` of the file
    ``path`` (relative to the storage's ``root_path``, always ``s<size>/...kv``)."""

    path: str
    blkid: int

    storage_type: ClassVar[str] = "file"

    @property
    def offset(self) -> int:
        return self.blkid * self.size


class ShmUri(BlockUri, frozen=True):
    """``shm://<storage>/<segment>?offset=O&size=S``: ``size`` bytes at ``offset`` of the segment
    (one file name in the storage's ``shm_dir``); ``offset`` is a multiple of ``size``."""

    segment: str
    offset: int

    storage_type: ClassVar[str] = "shm"


class ThreeFsUri(BlockUri, frozen=True):
    """``hf3fs://<storage><path>?[blkid=N&]size=S``: a file at the absolute 3FS ``path``; with
    ``blkid`` the block is at ``blkid * size`` of a shared file. A bare file URI (no query, a
    deletion task meaning "remove the whole file") decodes with ``blkid`` None and ``size`` 0."""

    path: str
    blkid: int | None

    storage_type: ClassVar[str] = "3fs"

    @property
    def offset(self) -> int:
        return (self.blkid or 0) * self.size


class MooncakeUri(BlockUri, frozen=True):
    """``mooncake://<storage>/?key=K&size=S``: one Mooncake object named ``key``."""

    key: str

    storage_type: ClassVar[str] = "mooncake"


class PaceUri(BlockUri, frozen=True):
    """``pace://<storage>/<offset>?media_type=M&node_id=N&range_id=R&size=S``: ``size`` bytes at
    ``offset`` of a Tair memory pool range."""

    offset: int
    media_type: str
    node_id: int
    range_id: int

    storage_type: ClassVar[str] = "tairmempool"


def parse_block_uri(uri: str) -> BlockUri:
    """Decode any URI kvcm hands out into its typed form. InvalidArgument on a malformed URI, an
    unknown scheme, a missing, unknown or non-numeric parameter, or a path that is not what
    that type's storage generates (so no ``..``, no absolute path, no empty segment)."""
    if not isinstance(uri, str):
        raise InvalidArgument(f"a storage uri must be a string, got {type(uri).__name__}")
    fast = _fast(uri)
    if fast is not None:
        return fast
    parsed = parse_uri(uri)
    decode = _DECODERS.get(parsed.scheme)
    if decode is None:
        raise InvalidArgument(f"uri {_q(uri)}: unknown scheme {parsed.scheme!r} (valid: {', '.join(sorted(_DECODERS))})")
    return decode(uri, parsed)


def _ints(uri: str, parsed: ParsedUri, required: tuple[str, ...], optional: tuple[str, ...] = (),
          texts: tuple[str, ...] = ()) -> list[int]:
    """The integer parameters ``required`` (then ``optional``, -1 when absent); any parameter
    neither these nor one of the text parameters ``texts`` is refused."""
    unknown = sorted(set(parsed.params) - {*required, *optional, *texts})
    if unknown:
        raise InvalidArgument(f"uri {_q(uri)}: unknown parameter {unknown[0]!r}")
    out = [_uint(uri, parsed, key) for key in required]
    return out + [_uint(uri, parsed, key) if key in parsed.params else -1 for key in optional]


def _uint(uri: str, parsed: ParsedUri, key: str) -> int:
    # The length first: int() of a few thousand digits raises ValueError (and costs time).
    if len(parsed.params.get(key, "")) > _MAX_DIGITS or (value := parsed.int_param(key)) > MAX_URI_INT:
        raise InvalidArgument(f"uri {_q(uri)}: parameter {key!r} is out of range")
    return value


def _file(uri: str, parsed: ParsedUri) -> BlockUri:
    blkid, size = _ints(uri, parsed, ("blkid", "size"))
    match = FILE_PATH.fullmatch(parsed.path[1:])
    if match is None:
        raise InvalidArgument(f"uri {_q(uri)}: a file storage path is s<size>/<id>-<n>.kv")
    if size != int(match.group(1)):
        raise InvalidArgument(f"uri {_q(uri)}: size does not match the file's size class")
    return FileUri(uri, parsed.host, size, match.group(0), blkid)


def _shm(uri: str, parsed: ParsedUri) -> BlockUri:
    offset, size = _ints(uri, parsed, ("offset", "size"))
    segment = parsed.path[1:]
    if not segment or "/" in segment or "\0" in segment or segment in (".", ".."):
        raise InvalidArgument(f"uri {_q(uri)}: a shm path is one segment name")
    if size == 0 or offset % size:
        raise InvalidArgument(f"uri {_q(uri)}: offset must be a multiple of a non-zero size")
    return ShmUri(uri, parsed.host, size, segment, offset)


def _hf3fs(uri: str, parsed: ParsedUri) -> BlockUri:
    path = parsed.path
    if not path.startswith("/") or "\0" in path or any(p in ("", ".", "..") for p in path[1:].split("/")):
        raise InvalidArgument(f"uri {_q(uri)}: a 3fs path is an absolute, normalized file path")
    if not parsed.params:
        return ThreeFsUri(uri, parsed.host, 0, path, None)
    size, blkid = _ints(uri, parsed, ("size",), ("blkid",))
    return ThreeFsUri(uri, parsed.host, size, path, None if blkid < 0 else blkid)


def _mooncake(uri: str, parsed: ParsedUri) -> BlockUri:
    (size,) = _ints(uri, parsed, ("size",), texts=("key",))
    key = parsed.params.get("key", "")
    if parsed.path != "/" or not key:
        raise InvalidArgument(f"uri {_q(uri)}: a mooncake uri is mooncake://<storage>/?key=<key>&size=<size>")
    return MooncakeUri(uri, parsed.host, size, key)


def _pace(uri: str, parsed: ParsedUri) -> BlockUri:
    node_id, range_id, size = _ints(uri, parsed, ("node_id", "range_id", "size"), texts=("media_type",))
    media, offset = parsed.params.get("media_type", ""), parsed.path[1:]
    if not media or not (offset.isascii() and offset.isdigit()) or len(offset) > _MAX_DIGITS \
            or int(offset) > MAX_URI_INT:
        raise InvalidArgument(f"uri {_q(uri)}: a pace uri is pace://<storage>/<offset>?media_type=M&node_id=N&range_id=R&size=S")
    return PaceUri(uri, parsed.host, size, int(offset), media, node_id, range_id)


# The exact forms the file and shm backends generate (params sorted, so always in this order),
# decoded by one regex match: block I/O decodes a URI per block, and the general path costs
# several times the match. Anything else takes the general path, which accepts a superset and
# words the errors; both give the same result for what both accept.
_FAST_FILE = re.compile(r"file://([A-Za-z0-9._~-]+)/(s([1-9][0-9]{0,18})/(?:[0-9a-f]{8}-)?[0-9]{8,}\.kv)"
                        r"\?blkid=([0-9]{1,18})&size=([0-9]{1,18})")
_FAST_SHM = re.compile(r"shm://([A-Za-z0-9._~-]+)/([A-Za-z0-9._~-]+)\?offset=([0-9]{1,18})&size=([1-9][0-9]{0,17})")


def _fast(uri: str) -> BlockUri | None:
    m = _FAST_FILE.fullmatch(uri)
    if m is not None:
        host, path, size_class, blkid, size = m.groups()
        return FileUri(uri, host, int(size), path, int(blkid)) if size_class == size else None
    m = _FAST_SHM.fullmatch(uri)
    if m is not None:
        host, segment, offset, size = m.groups()
        block = ShmUri(uri, host, int(size), segment, int(offset))
        return block if block.offset % block.size == 0 and segment not in (".", "..") else None
    return None


_DECODERS: dict[str, Callable[[str, ParsedUri], BlockUri]] = {
    "file": _file, "shm": _shm, "hf3fs": _hf3fs, "mooncake": _mooncake, "pace": _pace,
}


# --------------------------------------------------------------------------------------- specs


class SpecReader:
    """Reads one storage spec strictly: every error names the field, unknown fields are refused
    (a typo such as ``key_count_perfile`` must fail at add_storage, not silently use a default).

    It also records what it read, defaults filled in: :meth:`finish` returns that complete,
    normalized spec as plain builtins (the form the registry stores and ``list_storage`` shows).
    An unset optional text reads as ``None`` and is recorded as ``""`` (Tair's "unset"), so
    reading a normalized spec again gives the same spec."""

    def __init__(self, type_name: str, name: str, spec: Mapping[str, Any] | None) -> None:
        if spec is not None and not isinstance(spec, Mapping):
            raise InvalidArgument(f"storage {name!r}: storage_spec must be a map, got {type(spec).__name__}")
        self._where = f"storage {name!r} ({type_name})"
        self._spec = dict(spec or {})
        self._seen: set[str] = set()
        self._values: dict[str, Any] = {}

    def integer(self, key: str, default: int | None = None, minimum: int = 0) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self._bad(key, f"must be >= {minimum}, got {value}")
        return self._keep(key, value)

    def text(self, key: str, default: str | None = None) -> str:
        value = self._get(key, default)
        if not isinstance(value, str) or not value:
            raise self._bad(key, f"must be a non-empty string, got {value!r}")
        return self._keep(key, value)

    def optional_text(self, key: str) -> str | None:
        if self._spec.get(key) in (None, ""):
            self._seen.add(key)
            self._keep(key, "")
            return None
        return self.text(key)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self._bad(key, f"must be true or false, got {value!r}")
        return self._keep(key, value)

    def fail(self, key: str, why: str) -> InvalidArgument:
        """An error naming ``storage_spec.<key>``, for checks beyond the type (raise it)."""
        return self._bad(key, why)

    def finish(self) -> dict[str, Any]:
        """Refuse fields nobody read; return the normalized spec (every field read, in order)."""
        unknown = sorted(set(self._spec) - self._seen)
        if unknown:
            guess = suggest(unknown[0], sorted(self._seen))
            hint = f"did you mean storage_spec.{guess}? " if guess else ""
            raise self._bad(unknown[0], f"unknown field ({hint}valid: {', '.join(sorted(self._seen))})")
        return dict(self._values)

    def _get(self, key: str, default: Any) -> Any:
        self._seen.add(key)
        # None and "" both mean unset, as in Tair's protos (the registry stores "" defaults).
        if self._spec.get(key) not in (None, ""):
            return self._spec[key]
        if default is None:
            raise self._bad(key, "is required")
        return default

    def _keep(self, key: str, value: T) -> T:
        self._values[key] = value
        return value

    def _bad(self, key: str, why: str) -> InvalidArgument:
        return InvalidArgument(f"{self._where}: storage_spec.{key} {why}")


def check_component(where: str, value: str) -> str:
    """A single path component safe to join under a directory (no "/", "..", NUL)."""
    if not value or "/" in value or "\0" in value or value in (".", ".."):
        raise InvalidArgument(f"{where}: {value!r} is not a valid file name")
    return value


# ---------------------------------------------------------------------------------- safe files
#
# A storage directory may be writable by other local users (``/dev/shm``, a shared root), who can
# plant a symlink, a FIFO or a directory at any name kvcm would use. So every open there refuses
# to follow a symlink, never blocks on a FIFO, and checks it got a regular file; every file kvcm
# creates there is new (O_EXCL), private (0600), and named unpredictably unless the name itself is
# the rendezvous (a container, a marker, a lock).

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


def _load_fallocate() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        # fallocate64 takes a 64-bit off_t on every ABI; plain fallocate only on 64-bit ones.
        fn = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):
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


def slot_runs(slots: Iterable[int]) -> list[tuple[int, int]]:
    """Coalesce slot ids into ``(first, count)`` runs so adjacent frees cost one syscall."""
    runs: list[tuple[int, int]] = []
    for slot in sorted(set(slots)):
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


# --------------------------------------------------------------------------------------- slots


class Container:
    """One file or segment cut into ``slots`` blocks of ``size`` bytes.

    Slot state is a bytearray (1 = used): one byte per slot keeps a 1 GiB segment of 4 KiB
    blocks at 256 KiB, and ``find`` scans it at C speed. Invariant: no free slot lies below
    ``hint``, so the lowest free slot is ``bits.find(0, hint)``.

    ``lost`` marks a container the metadata references but that is gone from disk: its slots
    are accounted (so deletes balance) but never handed out again."""

    __slots__ = ("bits", "free", "hint", "lost", "name", "size", "slots")

    def __init__(self, name: str, size: int, slots: int, lost: bool = False) -> None:
        self.name = name
        self.size = size
        self.slots = slots
        self.bits = bytearray(slots)
        self.free = slots  # number of free slots
        self.hint = 0
        self.lost = lost

    @property
    def used(self) -> int:
        return self.slots - self.free

    def holds(self, slot: int) -> bool:
        """Whether ``slot`` is reserved."""
        return 0 <= slot < self.slots and self.bits[slot] == 1

    def pop_free(self) -> int:
        """The lowest free slot, now used (callers check ``free`` first)."""
        slot = self.bits.find(0, self.hint)
        self.bits[slot] = 1
        self.free -= 1
        self.hint = slot + 1
        return slot

    def mark(self, slot: int, used: bool) -> bool:
        """Set one slot's state; False if it already had it (or is out of range)."""
        if not 0 <= slot < self.slots or self.bits[slot] == used:
            return False
        self.bits[slot] = used
        self.free += -1 if used else 1
        if not used:
            self.hint = min(self.hint, slot)
        return True


class SlotPool:
    """Slot accounting for containers, grouped by block-size class (instances with different
    block sizes never share a container, so a slot offset is always ``slot * size``).

    Purely in memory: it is rebuilt at start-up from the metadata via ``reserve``. Not
    thread-safe by itself; the owning backend holds its lock around every call."""

    def __init__(self) -> None:
        self._containers: dict[str, Container] = {}
        # size -> containers having a free slot (a dict as an insertion-ordered set)
        self._with_free: dict[int, dict[str, Container]] = {}
        self.slots_used = 0
        self.bytes_used = 0
        self.bytes_allocated = 0  # logical size of all containers (sparse: not all on disk)

    def __len__(self) -> int:
        return len(self._containers)

    def __iter__(self) -> Iterator[Container]:
        return iter(list(self._containers.values()))

    def get(self, name: str) -> Container | None:
        return self._containers.get(name)

    def add(self, container: Container) -> None:
        self._containers[container.name] = container
        self.bytes_allocated += container.slots * container.size
        used = container.used
        self.slots_used += used
        self.bytes_used += used * container.size
        self._offer(container)

    def remove(self, container: Container) -> None:
        del self._containers[container.name]
        self._with_free.get(container.size, {}).pop(container.name, None)
        self.bytes_allocated -= container.slots * container.size
        self.slots_used -= container.used
        self.bytes_used -= container.used * container.size

    def take(self, size: int, count: int) -> list[tuple[Container, int]]:
        """Up to ``count`` free slots of existing containers, fullest container first: packing
        freed slots back into busy containers lets the emptiest ones drain and be unlinked."""
        taken: list[tuple[Container, int]] = []
        candidates = self._with_free.get(size, {})
        for container in sorted(candidates.values(), key=lambda c: c.free):
            n = min(count - len(taken), container.free)
            taken.extend((container, container.pop_free()) for _ in range(n))
            self._count(container, n)
            if not container.free:
                del candidates[container.name]
            if len(taken) == count:
                break
        return taken

    def claim(self, container: Container, slot: int) -> bool:
        """Mark one given slot used (recovery); False if it already was."""
        if not container.mark(slot, True):
            return False
        self._count(container, 1)
        if not container.free:
            self._with_free.get(container.size, {}).pop(container.name, None)
        return True

    def put_back(self, container: Container, slot: int) -> bool:
        """Mark one slot free again; False if it was free already or out of range."""
        if not container.mark(slot, False):
            return False
        self._count(container, -1)
        self._offer(container)
        return True

    def grow(self, container: Container, slots: int) -> None:
        """Give ``container`` ``slots`` slots (recovery: the metadata knows of more slots than
        a truncated file still holds)."""
        extra = slots - container.slots
        if extra <= 0:
            return
        container.bits.extend(bytes(extra))
        container.slots = slots
        container.free += extra
        self.bytes_allocated += extra * container.size
        self._offer(container)

    def withdraw(self, container: Container) -> None:
        """Hand out no more slots of ``container`` (it lost its bytes); accounting stays."""
        self._with_free.get(container.size, {}).pop(container.name, None)

    def _offer(self, container: Container) -> None:
        if container.free and not container.lost:
            self._with_free.setdefault(container.size, {})[container.name] = container

    def _count(self, container: Container, delta: int) -> None:
        self.slots_used += delta
        self.bytes_used += delta * container.size
