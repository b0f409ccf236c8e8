"""Block records: the value stored per (instance, block key) in the ``blocks`` database.

A record's locations are stored as *addresses* (:mod:`kvcm.cache.locations`): a skeleton id plus the
integers of its URIs, never the URIs as text. Times are integer milliseconds, stored as one
absolute value and small deltas. The value (format 2)::

    value := ONE  u8(len(addr)) addr  body     -- exactly one SERVING location, addr < 256 B
           | ANY  body                         -- anything else
    body  := msgpack [parent, created_ms, updated_ms - created_ms, [loc], run]
    loc   := [id, status, created_ms - record created_ms, written_ms - created_ms | nil,
              session, addr]                                      -- compact address
           | [..., addr, storage, type, nbytes]                   -- verbatim address (a wire)

``storage``, ``type`` and ``nbytes`` of a compact address live in its skeleton. In a ONE value
the serving location's ``addr`` in ``body`` is nil and :func:`decode` puts the header's back:
a lookup finds the address without decoding anything and turns it into wire bytes through a
cache (:func:`kvcm.cache.locations.wire`). With two specs a serving record takes about 60 B
(format 1 took about 300 B: the whole wire, float times, storage name and type per location).

Format 1 (``FAST``/``SLOW``: the pre-packed wire in a header, float seconds) is still read;
every write stores format 2, so a data dir converts record by record as blocks change.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from enum import IntEnum
from typing import Any, NamedTuple

import msgpack
import msgspec

from kvcm.cache.locations import ENTRY_ID, BuiltCache, address, facts, pack_wire, reply_entries, set_wire_cache_bytes
from kvcm.cache.locations import uris as location_uris
from kvcm.cache.locations import wire as location_wire

SLOW = 0  # format 1, any record
FAST = 1  # format 1, one serving location (its wire in a header)
ANY = 3  # format 2, any record
ONE = 2  # format 2, one serving location (its address in a header)
_U16 = struct.Struct(">H")
_packer = msgpack.Packer(use_bin_type=True)


class Status(IntEnum):
    """Location status (Tair ``CacheLocationStatus`` numbers)."""

    NOT_FOUND = 0
    WRITING = 2
    SERVING = 3
    DELETING = 4


STATUS_NAMES = {Status.NOT_FOUND: "not_found", Status.WRITING: "writing",
                Status.SERVING: "serving", Status.DELETING: "deleting"}


class Location(msgspec.Struct):
    """One copy of a block on one storage."""

    id: str  # 8 chars, unique within the block
    status: int
    storage: str  # storage name (URI host)
    type: str  # storage type, e.g. "file"
    nbytes: int  # sum of the spec sizes actually allocated
    created: float  # wall clock, seconds (stored in ms)
    written: float  # wall clock when it became serving (0 while writing)
    session: str  # write session that created it ("" once finished)
    addr: bytes  # compact address or verbatim wire (kvcm.cache.locations)

    @property
    def wire(self) -> bytes:
        """The client-facing location map."""
        return location_wire(self.addr)

    def uris(self) -> list[str]:
        return location_uris(self.addr)


class Record(msgspec.Struct):
    """Everything kvcm knows about one block key of one instance."""

    parent: int | None  # previous key of the request that first created the block
    created: float
    updated: float  # last modification (Tair ``__lru_time__``)
    locs: list[Location]
    run: int | None = None  # first key of the run record that includes this block (see below)


def new_location(loc_id: str, status: int, storage: str, storage_type: str, specs: Sequence[tuple[str, str]],
                 nbytes: int, created: float) -> Location:
    """A location whose URIs are ``specs`` (``(spec name, uri)``), addressed compactly."""
    addr = address(storage_type, storage, nbytes, specs)
    return Location(loc_id, status, storage, storage_type, nbytes, created, 0.0, "", addr)


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def encode(record: Record) -> bytes:
    """Format 2 bytes of a record."""
    base = round(record.created * 1000)
    head = None
    serving = 0
    for loc in record.locs:
        if loc.status == Status.SERVING:
            serving += 1
            head = loc
    if serving != 1 or len(head.addr) > 255:  # type: ignore[union-attr]
        head = None
    items: list[list[object]] = []
    for loc in record.locs:
        created = round(loc.created * 1000)
        item = [loc.id, loc.status, created - base, round(loc.written * 1000) - created if loc.written else None,
                loc.session, None if loc is head else loc.addr]
        if loc.addr[0] >= 0x80:
            item += (loc.storage, loc.type, loc.nbytes)
        items.append(item)
    body = _encode([record.parent, base, round(record.updated * 1000) - base, items, record.run])
    if head is None:
        return b"\x03" + body
    return b"".join((bytes((ONE, len(head.addr))), head.addr, body))


def decode(value: bytes) -> Record:
    kind = value[0]
    if kind == ONE:
        end = 2 + value[1]
        return _from_body(_decode(value[end:]), value[2:end])
    if kind == ANY:
        return _from_body(_decode(value[1:]), b"")
    return _decode_v1(value)


def _sole(value: bytes) -> tuple[list[Any], bytes, list[Any]] | None:
    """``(body, address, item)`` of a format 2 record whose only location is serving with a
    compact address (the common eviction victim), decoded no further; None for any other."""
    if value[0] != ONE:
        return None
    end = 2 + value[1]
    addr = value[2:end]
    body = _decode(value[end:])
    items = body[3]
    if len(items) != 1 or addr[0] >= 0x80:
        return None
    return body, addr, items[0]


def _sole_location(body: list[Any], addr: bytes, item: list[Any], status: int) -> Location:
    storage, storage_type, nbytes = facts(addr)
    created, written = body[1] + item[2], item[3]
    return Location(item[0], status, storage, storage_type, nbytes, created / 1000,
                    0.0 if written is None else (created + written) / 1000, item[4], addr)


def sole_serving(value: bytes) -> tuple[Location, int | None] | None:
    """``(the location, the record's run)`` of a record :func:`mark_sole` would mark, read
    without building the record (an eviction that frees at once drops such records whole)."""
    hit = _sole(value)
    if hit is None:
        return None
    body, addr, item = hit
    return _sole_location(body, addr, item, Status.SERVING), body[4]


def mark_sole(value: bytes, now: float) -> tuple[bytes, Location, int | None] | None:
    """``(new value, the location, its run)`` for a format 2 record whose only location is
    serving with a compact address, made ``deleting`` at ``now``: the same bytes as
    ``encode`` of the decoded, marked record, without building one (eviction marks many of
    them, and the location and record objects were most of its cost). None for any other record.

    The location returned is as marked (``deleting``); its times are those :func:`decode`
    would give."""
    hit = _sole(value)
    if hit is None:
        return None
    body, addr, item = hit
    loc = _sole_location(body, addr, item, Status.DELETING)
    item[1], item[5] = Status.DELETING, addr
    body[2] = round(now * 1000) - body[1]
    return b"\x03" + _encode(body), loc, body[4]


def _from_body(body: list[Any], head: bytes) -> Record:
    parent, base, updated, items, run = body
    locs = []
    for item in items:
        addr = item[5] or head
        if len(item) > 6:
            storage, storage_type, nbytes = item[6:9]
        else:
            storage, storage_type, nbytes = facts(addr)
        created = base + item[2]
        written = item[3]
        locs.append(Location(item[0], item[1], storage, storage_type, nbytes, created / 1000,
                             0.0 if written is None else (created + written) / 1000, item[4], addr))
    return Record(parent, base / 1000, (base + updated) / 1000, locs, run)


def _decode_v1(value: bytes) -> Record:
    """Format 1: ``FAST u16(len(wire)) wire body | SLOW body``, ``body`` a msgpack array
    ``[parent, created, updated, [[id, status, storage, type, nbytes, created, written, session,
    wire]], run?]`` with float seconds; in a FAST value the serving location's wire is the
    header's (its own is empty, or a copy in the oldest values)."""
    head = None
    if value[0] == FAST:
        end = 3 + _U16.unpack_from(value, 1)[0]
        head, body = value[3:end], _decode(value[end:])
    else:
        body = _decode(value[1:])
    locs = []
    for lid, status, storage, storage_type, nbytes, created, written, session, wire in body[3]:
        if head is not None and status == Status.SERVING:
            wire = head
        locs.append(Location(lid, status, storage, storage_type, nbytes, float(created), float(written), session, wire))
    return Record(body[0], float(body[1]), float(body[2]), locs, body[4] if len(body) > 4 else None)


def fast_wire(value: bytes) -> bytes | None:
    """The wire bytes of the single serving location, or None (decode the record instead)."""
    kind = value[0]
    if kind == ONE:
        return location_wire(value[2 : 2 + value[1]])
    if kind == FAST:
        return value[3 : 3 + (value[1] << 8 | value[2])]
    return None


def unpack_wire(wire: bytes) -> dict[str, Any]:
    out: dict[str, Any] = msgpack.unpackb(wire, raw=False)
    return out


def filter_wire(wire: bytes, names: frozenset[str]) -> bytes:
    """Keep only the specs named in ``names``; ``spec_size`` follows (Tair forgets it)."""
    loc = unpack_wire(wire)
    specs = [s for s in loc["location_specs"] if s["name"] in names]
    return bytes(_packer.pack({"type": loc["type"], "spec_size": len(specs), "location_specs": specs}))


def empty_wire(spec_names: Sequence[str]) -> bytes:
    """Tair's filler for a key without a usable location in batch_get / sw match."""
    return pack_wire("unspecified", [(name, "") for name in spec_names])


def is_current(value: bytes) -> bool:
    """Written in the current format (older ones are read, never written)."""
    return value[0] in (ONE, ANY)


def check_value(value: bytes) -> None:
    """A stored block value's own invariants (``MetaIndex.check``)."""
    record = decode(value)
    if is_current(value):
        assert encode(record) == value, "value does not round-trip"
    assert record.locs, "record without locations"
    ids = [loc.id for loc in record.locs]
    assert len(ids) == len(set(ids)), f"duplicate location ids {ids}"
    for loc in record.locs:
        assert loc.status in (Status.WRITING, Status.SERVING, Status.DELETING), f"bad status {loc.status}"
        assert loc.nbytes >= 0, "negative size"
        assert (loc.status == Status.WRITING) == bool(loc.session) or loc.status == Status.DELETING, \
            f"session field out of step with status {loc.status}"


# -- runs -----------------------------------------------------------------------------------------
#
# A *run* caches the reply of a prefix lookup: the keys one write session made serving, in order,
# with the wire bytes of each. It lives in the ``access`` database under
# ``namespace + i64(first key)``; every member's record names it (``Record.run``), and any change
# to a member deletes the run in the same transaction, so a run that exists is always exact.
# A prefix_match then costs one get per run instead of one per block.
#
#   value := 0xFF u16 len(storage) storage u32 n  n x int64 key (big-endian)
#            deflate((n+1) x u32 offset  body)
#
# ``body`` is the members' wires concatenated; raw-deflated with the offsets it takes a few bytes
# per member (the wires differ in a few digits). ``body[:offset[m]]`` is the msgpack array body
# of the first ``m`` locations.
# Inflated bodies are cached (keyed by the run's db key, checked against the stored value, so
# never stale). Keys are plain big-endian int64 (:func:`pack_keys`, one C call for a whole
# request), so a request compares bytewise with a run. Format 1 (no 0xFF, the body not
# deflated) is still read.
#
# Format 3 (0xFE, what writes store) adds, between the keys and the deflated part, the members'
# entries of a compact location reply (:mod:`kvcm.proto.locations`), so that reply is a slice
# of the run too, built without a wire:
#
#   value := 0xFE u16 len(storage) storage u32 n  n x int64 key  u32 len(compact)  compact
#            deflate((n+1) x u32 offset  body)
#   compact := u8 h  h x 4-byte skeleton id  n x u8 skeleton index (0xFF: a wire as is)
#              (n+1) x u32 offset  entries
#
# ``entries[:offset[m]]`` are the first ``m`` members' entries: ``0xce`` + a compact address
# (its skeleton id read as a msgpack uint32, then its deltas), or the wire itself. Runs whose
# members use more than 254 skeletons are stored in format 2.

RUNS_DB = "runs"
_RUN2 = 0xFF
_RUN3 = 0xFE
_VERBATIM = 0xFF  # the skeleton index of a member stored as its wire
_U32 = struct.Struct(">I")
_WBITS = -12  # raw deflate, 4 KiB window: a small state to set up per run
# Runs shorter than this are stored as format 1 (not deflated): setting up the compressor cost
# about a third of the extra CPU a 4-key write paid, for a few hundred bytes per run saved.
_DEFLATE_FROM = 8
bodies: BuiltCache[tuple[bytes, bytes]] = BuiltCache(192 << 20)


def set_cache_bytes(total: int) -> None:
    """``cache.wire_cache_bytes``: a quarter for single wires, the rest for run bodies."""
    set_wire_cache_bytes(total // 4)
    bodies.resize(total - total // 4)


def pack_keys(keys: Sequence[int]) -> bytes:
    return struct.pack(f">{len(keys)}q", *keys)


def _offsets(parts: Sequence[bytes]) -> bytes:
    offsets, total = [0], 0
    for part in parts:
        total += len(part)
        offsets.append(total)
    return struct.pack(f">{len(offsets)}I", *offsets)


def encode_run(storage: str, keys: Sequence[int], wires: Sequence[bytes],
               addrs: Sequence[bytes] | None = None) -> bytes:
    """A run of ``keys`` with their ``wires`` (format 1 or 2), and with their stored ``addrs``
    the compact entries too (format 3)."""
    name = storage.encode()
    packed = _offsets(wires) + b"".join(wires)
    head = b"".join((_U16.pack(len(name)), name, _U32.pack(len(wires)), pack_keys(keys)))
    compact = None if addrs is None else _compact_section(addrs)
    if compact is None and len(wires) < _DEFLATE_FROM:  # format 1: a short run is not worth a compressor's set-up
        return head + packed
    deflate = zlib.compressobj(1, zlib.DEFLATED, _WBITS, 4)
    deflated = deflate.compress(packed) + deflate.flush()
    if compact is None:
        return bytes((_RUN2,)) + head + deflated
    return b"".join((bytes((_RUN3,)), head, _U32.pack(len(compact)), compact, deflated))


def _compact_section(addrs: Sequence[bytes]) -> bytes | None:
    heads: dict[bytes, int] = {}
    index = bytearray()
    for addr in addrs:
        if addr[0] >= 0x80:
            index.append(_VERBATIM)
            continue
        at = heads.setdefault(addr[:4], len(heads))
        if at >= _VERBATIM:
            return None
        index.append(at)
    entries = reply_entries(addrs)
    return b"".join((bytes((len(heads),)), *heads, bytes(index), _offsets(entries), *entries))


def _layout(value: bytes) -> tuple[str, int, int]:
    """``(storage, n, position of the keys)`` of a run value of any format."""
    start = 1 if value[0] in (_RUN2, _RUN3) else 0
    name_len = _U16.unpack_from(value, start)[0]
    pos = start + 2 + name_len
    return value[start + 2 : pos].decode(), _U32.unpack_from(value, pos)[0], pos + 4


def _inflated(value: bytes, pos: int, key: bytes | None) -> bytes:
    """Offsets + body of a format 2 run (``pos``: where its deflated part starts); cached under
    ``key`` when one is given."""
    if key is None:
        return zlib.decompress(value[pos:], _WBITS)
    hit = bodies.get(key)
    if hit is not None and hit[0] == value:  # the same run, not an older one under that key
        body: bytes = hit[1]
        return body
    body = zlib.decompress(value[pos:], _WBITS)
    bodies.put(key, (value, body), len(value) + len(body) + BuiltCache.ENTRY)
    return body


def _offsets_and_body(value: bytes, n: int, pos: int, key: bytes | None) -> tuple[bytes, int]:
    """``(bytes holding the offsets then the body, where the body starts)``; ``pos``: the end
    of the keys."""
    if value[0] == _RUN3:
        pos += 4 + _U32.unpack_from(value, pos)[0]  # past the compact section
    elif value[0] != _RUN2:
        return value, pos + 4 * (n + 1)  # format 1: offsets and body stored as they are
    return _inflated(value, pos, key), 4 * (n + 1)


def _matched(value: bytes, n: int, pos: int, request: bytes | memoryview) -> int:
    """How many leading 8-byte keys ``request`` shares with the run's keys (at ``pos``)."""
    m = min(n, len(request) // 8)
    # Compared in place: slicing the run's keys and the request cost two copies per lookup.
    if not value.startswith(request if 8 * m == len(request) else request[: 8 * m], pos):
        m = next(i for i in range(m) if not value.startswith(request[8 * i : 8 * i + 8], pos + 8 * i))
    return m


def run_match(value: bytes, request: bytes | memoryview, key: bytes | None = None) -> tuple[str, int, bytes]:
    """``(storage, m, body of the first m locations)`` where ``m`` is the number of leading
    8-byte keys ``request`` shares with the run. ``key``: the run's db key (its cache slot)."""
    storage, n, pos = _layout(value)
    m = _matched(value, n, pos, request)
    data, body = _offsets_and_body(value, n, pos + 8 * n, key)
    end = _U32.unpack_from(data, body - 4 * (n + 1) + 4 * m)[0]
    return storage, m, data[body : body + end]


class CompactRun(NamedTuple):
    """The first ``matched`` members of a run as compact reply entries: ``entries`` holds
    ``elements`` msgpack values; ``heads`` are the skeleton ids they use."""

    storage: str
    matched: int
    entries: bytes
    elements: int
    heads: list[bytes]


def run_match_compact(value: bytes, request: bytes | memoryview) -> CompactRun | None:
    """:func:`run_match` for a compact reply; None for a run stored without compact entries
    (formats 1 and 2: the caller reads its blocks one by one)."""
    if value[0] != _RUN3:
        return None
    storage, n, pos = _layout(value)
    m = _matched(value, n, pos, request)
    at = pos + 8 * n + 4  # the compact section
    h = value[at]
    index_at = at + 1 + 4 * h
    offsets_at = index_at + n
    entries_at = offsets_at + 4 * (n + 1)
    end = _U32.unpack_from(value, offsets_at + 4 * m)[0]
    index = value[index_at : index_at + m]
    verbatim = index.count(_VERBATIM)
    used = set(index)
    used.discard(_VERBATIM)
    heads = [value[at + 1 + 4 * i : at + 5 + 4 * i] for i in sorted(used)]
    return CompactRun(storage, m, value[entries_at : entries_at + end], 2 * m - verbatim, heads)


def run_entries(value: bytes) -> list[bytes] | None:
    """The stored addresses of a format 3 run's members (checks and tools), else None."""
    if value[0] != _RUN3:
        return None
    _, n, pos = _layout(value)
    found = run_match_compact(value, value[pos : pos + 8 * n])
    assert found is not None
    offsets = struct.unpack_from(f">{n + 1}I", value, pos + 8 * n + 4 + 1 + 4 * value[pos + 8 * n + 4] + n)
    raw = [found.entries[offsets[i] : offsets[i + 1]] for i in range(n)]
    return [e[1:] if e[:1] == ENTRY_ID else e for e in raw]


def run_members(value: bytes) -> tuple[str, list[int], list[bytes]]:
    """``(storage, keys, wires)`` of a run (checks and tools; not the hot path)."""
    storage, n, pos = _layout(value)
    keys = list(struct.unpack_from(f">{n}q", value, pos))
    data, body = _offsets_and_body(value, n, pos + 8 * n, None)
    offsets = struct.unpack_from(f">{n + 1}I", data, body - 4 * (n + 1))
    return storage, keys, [data[body + offsets[i] : body + offsets[i + 1]] for i in range(n)]
