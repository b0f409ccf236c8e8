"""Storage URIs: Tair's ``scheme://host<path>?k=v`` codec and the typed decoder of every block URI
format kvcm hands out (``file``, ``shm``, ``hf3fs``, ``mooncake``, ``pace``).

The server's backends use it to check that a URI is theirs; client code (:mod:`kvcm.blocks`) to
read and write the bytes at it. It only decodes and checks the form; which storage holds a URI
is the caller's question.

URI invariant (as in Tair KVCM): the URI *host* is the storage's ``global_unique_name``, so a
location can always be traced back to the storage that owns it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from kvcm.errors import InvalidArgument

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
