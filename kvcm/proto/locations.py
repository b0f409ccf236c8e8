"""Location replies of ``get_cache_location``: the classic shape and the compact one.

Classic (the default of ``call()``, the HTTP routes and Tair's surface)::

    {"locations": [{"type": "file", "spec_size": 2,
                    "location_specs": [{"name": "k", "uri": "file://..."}, ...]}, ...]}

Compact (``reply_format: "compact"``; the typed clients and ``Connector`` ask for it), version
:data:`COMPACT_VERSION`::

    {"compact": [version, count, skeletons, entries, spec_names]}

* ``count`` — how many locations the reply holds (the classic list's length);
* ``skeletons`` — one row per URI shape the entries use:
  ``[id, type, names, fmts, counts, ref]``: the storage type, the spec names, one ``%``-format
  per spec (``%d``, ``%0<w>d``, ``%x``, ``%0<w>x`` and ``%%``, nothing else), how many integers
  each format takes, and the reference integers of all formats in order;
* ``entries`` — one msgpack array holding, per location in order, either a skeleton ``id``
  followed by an array of *deltas* (the location's integers are ``(ref[i] + delta[i]) mod 2**64``
  and its URI for spec ``j`` is ``fmts[j] % ints[...]`` over that spec's slice), or a location
  map in the classic shape (a URI with no skeleton, a filler entry of ``batch_get``);
* ``spec_names`` — nil, or the request's ``location_spec_names``: a location keeps only the
  specs of those names (``spec_size`` follows), applied by the reader.

Two neighbouring blocks of one storage differ in a few integers inside their URIs, so an entry
costs about ten bytes where the classic map repeats a hundred per spec. docs/rpc.md has a worked
example. :class:`LazyLocations` reads a compact reply without building a URI before one is asked
for.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate, chain, cycle, repeat
from operator import add
from typing import overload

import msgpack
import msgspec

COMPACT_VERSION = 1
_PLACEHOLDER = re.compile(r"(%%|%0[0-9]+[dx]|%[dx])")  # what a skeleton's formats may hold
REPLY_FORMATS = ("classic", "compact")
_MASK = (1 << 64) - 1
_SEP = "\x00"  # joins many URIs into one format call; a format holding it is filled one URI at a time
_packer = msgpack.Packer(use_bin_type=True)
_COMPACT_KEY = _packer.pack_map_header(1) + _packer.pack("compact")


class LocationSpec(msgspec.Struct, gc=False):
    name: str
    uri: str


class Location(msgspec.Struct, gc=False):
    """One copy of a block: its storage type and one URI per spec (``type`` ``"unspecified"``
    and empty URIs for a filler entry)."""

    type: str
    spec_size: int
    location_specs: list[LocationSpec]


class SkeletonRow(msgspec.Struct, array_like=True, gc=False):
    """``[id, type, names, fmts, counts, ref]``: one URI shape of a compact reply."""

    id: int
    type: str
    names: list[str]
    fmts: list[str]
    counts: list[int]
    ref: list[int]


class CompactLocations(msgspec.Struct, array_like=True, gc=False):
    """The value of a compact reply's ``"compact"`` key (module docstring); ``entries`` stays
    raw bytes until a location is read."""

    version: int
    count: int
    skeletons: list[SkeletonRow]
    entries: msgspec.Raw
    spec_names: list[str] | None = None


class CompactFormatError(ValueError):
    """A compact reply this client cannot read (another version, or inconsistent counts)."""


_ENTRIES = msgspec.msgpack.Decoder(list[int | list[int] | Location])


def pack_compact(count: int, rows: Sequence[bytes], elements: int, body: bytes,
                 spec_names: Sequence[str] | None) -> bytes:
    """A whole compact reply from its parts: ``rows`` packed skeleton rows, ``body`` the
    ``elements`` packed entry values back to back (the server builds them from stored bytes)."""
    names = _packer.pack(list(spec_names) if spec_names else None)
    return b"".join([_COMPACT_KEY, _packer.pack_array_header(5), _packer.pack(COMPACT_VERSION), _packer.pack(count),
                     _packer.pack_array_header(len(rows)), *rows, _packer.pack_array_header(elements), body, names])


class LazyLocations(Sequence[Location]):
    """The locations of a compact reply, read on demand: ``len()`` costs nothing; :meth:`uri`
    formats the one URI asked for; the first iteration or index builds every location at once
    (one add and one ``%`` per URI shape for all their URIs, the structs through ``map``)."""

    __slots__ = ("_built", "_compact", "_entries")

    def __init__(self, compact: CompactLocations) -> None:
        if compact.version != COMPACT_VERSION:
            raise CompactFormatError(f"compact location reply version {compact.version}; this client reads "
                                     f"version {COMPACT_VERSION} (ask for reply_format='classic')")
        self._compact = compact
        self._built: list[Location] | None = None
        self._entries: list[tuple[SkeletonRow, list[int]] | Location] | None = None

    def __len__(self) -> int:
        return self._compact.count

    @overload
    def __getitem__(self, index: int) -> Location: ...
    @overload
    def __getitem__(self, index: slice) -> list[Location]: ...
    def __getitem__(self, index: int | slice) -> Location | list[Location]:
        return self._locations()[index]

    def __iter__(self) -> Iterator[Location]:
        return iter(self._locations())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compares by content, like a list

    def __repr__(self) -> str:
        return f"LazyLocations({len(self)} locations)"

    def uri(self, block: int, spec: str) -> str:
        """The URI of ``block``'s spec ``spec`` (KeyError when the location has no such spec):
        that one URI formatted, no location built (a router reading a few of a long reply)."""
        if self._built is not None:
            return _spec_uri(self._built[block], spec)
        entry = self._index()[block]
        if isinstance(entry, Location):
            return _spec_uri(_filtered(entry, self._compact.spec_names), spec)
        row, deltas = entry
        keep = self._compact.spec_names
        if spec not in row.names or (keep and spec not in keep):
            raise KeyError(spec)
        j = row.names.index(spec)
        lo = sum(row.counts[:j])
        hi = lo + row.counts[j]
        return row.fmts[j] % tuple((r + d) & _MASK for r, d in zip(row.ref[lo:hi], deltas[lo:hi]))

    def _index(self) -> list[tuple[SkeletonRow, list[int]] | Location]:
        """Per location its row and deltas (or its map), checked as :func:`expand` checks them."""
        if self._entries is None:
            self._entries = _entries(self._compact)
        return self._entries

    def _locations(self) -> list[Location]:
        if self._built is None:
            self._built = expand(self._compact)
        return self._built


def expand(compact: CompactLocations) -> list[Location]:
    """Every location of a compact reply, in order. Entries of one skeleton are built together;
    the per-entry work left in Python is finding the maps among them."""
    elements = _ENTRIES.decode(compact.entries)
    keep = compact.spec_names
    kinds = list(map(type, elements))
    maps = _positions(kinds, Location)
    ids: list[int] = []
    deltas: list[list[int]] = []
    inserts: list[tuple[int, Location]] = []  # (position in the reply, a map entry)
    prev = 0
    for at in [*maps, len(elements)]:
        part = elements[prev:at]
        if len(part) % 2:
            raise CompactFormatError(f"compact entries near element {at}: a skeleton id without its deltas")
        ids += part[0::2]  # type: ignore[arg-type]  # checked below
        deltas += part[1::2]  # type: ignore[arg-type]
        if at < len(elements):
            inserts.append((len(ids) + len(inserts), _filtered(elements[at], keep)))  # type: ignore[arg-type]
        prev = at + 1
    if not set(map(type, ids)) <= {int} or not set(map(type, deltas)) <= {list}:
        raise CompactFormatError("compact entries: a skeleton id and its deltas out of order")
    if len(ids) + len(inserts) != compact.count:
        raise CompactFormatError(f"compact reply says {compact.count} locations and holds {len(ids) + len(inserts)}")
    rows = {row.id: row for row in compact.skeletons}
    built = _by_skeleton(rows, ids, deltas, keep)
    if not inserts:
        return built
    out: list[Location] = []
    taken = 0
    for pos, loc in inserts:
        before = pos - len(out)  # skeleton entries between the previous map and this one
        out += built[taken : taken + before]
        taken += before
        out.append(loc)
    out += built[taken:]
    return out


def _spec_uri(loc: Location, spec: str) -> str:
    for s in loc.location_specs:
        if s.name == spec:
            return s.uri
    raise KeyError(spec)


def _entries(compact: CompactLocations) -> list[tuple[SkeletonRow, list[int]] | Location]:
    elements = _ENTRIES.decode(compact.entries)
    rows = {row.id: row for row in compact.skeletons}
    out: list[tuple[SkeletonRow, list[int]] | Location] = []
    i = 0
    while i < len(elements):
        element = elements[i]
        if isinstance(element, Location):
            out.append(element)
            i += 1
            continue
        deltas = elements[i + 1] if i + 1 < len(elements) else None
        if not isinstance(element, int) or not isinstance(deltas, list):
            raise CompactFormatError(f"compact entry {len(out)}: not a skeleton id and its deltas")
        row = _row(rows, element)
        if len(deltas) != len(row.ref) or sum(row.counts) != len(row.ref):
            raise CompactFormatError(f"compact entry {len(out)}: {len(deltas)} deltas for skeleton {row.id}")
        out.append((row, deltas))
        i += 2
    if len(out) != compact.count:
        raise CompactFormatError(f"compact reply says {compact.count} locations and holds {len(out)}")
    return out


def _positions(kinds: list[type], kind: type) -> list[int]:
    """Where ``kind`` occurs in ``kinds`` (C-speed scans: maps are rare among the entries)."""
    out: list[int] = []
    at = -1
    while True:
        try:
            at = kinds.index(kind, at + 1)
        except ValueError:
            return out
        out.append(at)


def _by_skeleton(rows: dict[int, SkeletonRow], ids: list[int], deltas: list[list[int]],
                 keep: list[str] | None) -> list[Location]:
    if not ids:
        return []
    if len(set(ids)) == 1:
        return _build(_row(rows, ids[0]), deltas, keep)
    groups: dict[int, list[int]] = {}
    for k, sid in enumerate(ids):
        groups.setdefault(sid, []).append(k)
    out: list[Location | None] = [None] * len(ids)
    for sid, members in groups.items():
        for k, loc in zip(members, _build(_row(rows, sid), [deltas[k] for k in members], keep)):
            out[k] = loc
    return out  # type: ignore[return-value]  # every position filled above


def _row(rows: dict[int, SkeletonRow], sid: int) -> SkeletonRow:
    row = rows.get(sid)
    if row is None:
        raise CompactFormatError(f"compact entry names skeleton {sid}, which the reply does not hold")
    return row


def _filtered(loc: Location, keep: list[str] | None) -> Location:
    if not keep:
        return loc
    specs = [s for s in loc.location_specs if s.name in keep]
    return Location(loc.type, len(specs), specs)


def _build(row: SkeletonRow, deltas: list[list[int]], keep: list[str] | None) -> list[Location]:
    """The locations of entries of one skeleton: every URI formatted in one call, the structs
    built through ``map`` (no Python frame per location)."""
    n = len(deltas)
    kept = [j for j, name in enumerate(row.names) if not keep or name in keep]
    uris = _format(row, deltas, kept)
    per, names = len(kept), [row.names[j] for j in kept]
    specs = list(map(LocationSpec, cycle(names), uris)) if per else []
    lists: Iterable[list[LocationSpec]] = map(list, zip(*[iter(specs)] * per)) if per else ([] for _ in range(n))
    return list(map(Location, repeat(row.type, n), repeat(per, n), lists))


def _format(row: SkeletonRow, deltas: list[list[int]], kept: list[int]) -> list[str]:
    """The URIs of the ``kept`` specs of many entries of one skeleton, spec by spec, entry
    after entry. An integer that is the same in every entry (a size, a storage id, often the
    container) is written into the format once, so only the integers that differ are
    converted per entry."""
    width, n = len(row.ref), len(deltas)
    flat = list(chain.from_iterable(deltas))
    if len(flat) != width * n or sum(row.counts) != width or len(row.counts) != len(row.fmts):
        raise CompactFormatError(f"compact skeleton {row.id}: entries or counts disagree with its reference")
    starts = list(accumulate(row.counts, initial=0))
    wanted = {c for j in kept for c in range(starts[j], starts[j + 1])}  # the integers of kept specs
    columns = [flat[c::width] for c in range(width)]
    varying = [c for c in range(width) if c in wanted and len(set(columns[c])) > 1]
    try:
        baked = _bake(row, [None if c in varying else _int(row.ref[c] + columns[c][0]) for c in range(width)])
        fmts = [baked[j] for j in kept]
        ints = list(map(add, [row.ref[c] for c in varying] * n, chain.from_iterable(zip(*[columns[c] for c in varying]))))
        if ints and (min(ints) < 0 or max(ints) > _MASK):
            ints = list(map(_MASK.__and__, ints))  # a delta that wrapped around 2**64
        if not fmts:
            return []
        if not any(_SEP in f for f in fmts):
            return (_SEP.join([_SEP.join(fmts)] * n) % tuple(ints)).split(_SEP)
        per = [len([p for p in _PLACEHOLDER.findall(f) if p != "%%"]) for f in fmts]
        out, pos = [], 0
        for _ in range(n):
            for fmt, count in zip(fmts, per):
                out.append(fmt % tuple(ints[pos : pos + count]))
                pos += count
        return out
    except (TypeError, ValueError) as exc:
        raise CompactFormatError(f"compact skeleton {row.id}: {exc}") from None


def _int(value: int) -> int:
    return value & _MASK


def _bake(row: SkeletonRow, fixed: list[int | None]) -> list[str]:
    """The skeleton's formats with the ``fixed`` integers written in (None: left a placeholder)."""
    out, at = [], 0
    for fmt in row.fmts:
        pieces = _PLACEHOLDER.split(fmt)  # literal, placeholder, literal, ...
        for i in range(1, len(pieces), 2):
            if pieces[i] == "%%":
                continue
            value = fixed[at]
            if value is not None:
                pieces[i] = (pieces[i] % value).replace("%", "%%")
            at += 1
        out.append("".join(pieces))
    if at != len(fixed):
        raise CompactFormatError(f"compact skeleton {row.id}: its formats take {at} integers, not {len(fixed)}")
    return out


def builtins(obj: object) -> object:
    """``enc_hook`` for ``msgspec.to_builtins`` (and encoders) of a typed reply holding
    :class:`LazyLocations`: the locations as a list."""
    if isinstance(obj, LazyLocations):
        return list(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


__all__ = [
    "COMPACT_VERSION", "REPLY_FORMATS", "CompactFormatError", "CompactLocations", "LazyLocations", "Location",
    "LocationSpec", "SkeletonRow", "builtins", "expand", "pack_compact",
]
