"""Block records: the value stored per (instance, block key) in the ``blocks`` database.

A record is a compact msgpack *array* (decoded by msgspec into :class:`Record`), preceded by a
read-path header so that ``get_cache_location`` can splice the wire bytes of the one serving
location without decoding anything (splicing pre-packed bytes measured 2-5x cheaper than
decoding and repacking them)::

    value := FAST  u16(len(wire)) wire  record      -- exactly one SERVING location
           | SLOW  record                          -- anything else

``wire`` is the pre-packed msgpack map a client receives for that location:
``{"type", "spec_size", "location_specs": [{"name", "uri"}]}``. In a FAST value that location's
``wire`` field in ``record`` is left empty and :func:`decode` puts the header's bytes back: the
wire is most of a record, and storing it twice made records 1.7x bigger (more LMDB leaf and
branch pages per commit, a bigger file).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import msgpack
import msgspec

from kvcm.backends.base import i64

FAST = 1
SLOW = 0
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


class Location(msgspec.Struct, array_like=True):
    """One copy of a block on one storage."""

    id: str  # 8 chars, unique within the block
    status: int
    storage: str  # storage name (URI host)
    type: str  # storage type, e.g. "file"
    nbytes: int  # sum of the spec sizes actually allocated
    created: float  # wall clock, seconds
    written: float  # wall clock when it became serving (0 while writing)
    session: str  # write session that created it ("" once finished)
    wire: bytes  # pre-packed wire form (see module docstring)


class Record(msgspec.Struct, array_like=True):
    """Everything kvcm knows about one block key of one instance."""

    parent: int | None  # previous key of the request that first created the block
    created: float
    updated: float  # last modification (Tair ``__lru_time__``)
    locs: list[Location]
    run: int | None = None  # first key of the run record that includes this block (see below)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def encode(record: Record) -> bytes:
    """Header + record bytes (the header is derived, never stored twice by callers)."""
    serving = [loc for loc in record.locs if loc.status == Status.SERVING]
    if len(serving) != 1:
        return bytes((SLOW,)) + _encoder.encode(record)
    loc = serving[0]
    wire = loc.wire
    loc.wire = b""  # stored once, in the header
    try:
        body = _encoder.encode(record)
    finally:
        loc.wire = wire
    return b"".join((bytes((FAST,)), _U16.pack(len(wire)), wire, body))


def decode(value: bytes) -> Record:
    if value[0] != FAST:
        return _decoder.decode(value[1:])
    end = 3 + _U16.unpack_from(value, 1)[0]
    record = _decoder.decode(value[end:])
    for loc in record.locs:
        if loc.status == Status.SERVING:
            loc.wire = value[3:end]
    return record


def fast_wire(value: bytes) -> bytes | None:
    """The wire bytes of the single serving location, or None (decode the record instead)."""
    if value[0] != FAST:
        return None
    return value[3 : 3 + (value[1] << 8 | value[2])]


def pack_wire(storage_type: str, specs: Sequence[tuple[str, str]]) -> bytes:
    """The client-facing location map, packed once when the location is created."""
    return bytes(_packer.pack(
        {
            "type": storage_type,
            "spec_size": len(specs),
            "location_specs": [{"name": name, "uri": uri} for name, uri in specs],
        }
    ))


def unpack_wire(wire: bytes) -> dict[str, Any]:
    out: dict[str, Any] = msgpack.unpackb(wire, raw=False)
    return out


def wire_uris(wire: bytes) -> list[str]:
    return [spec["uri"] for spec in unpack_wire(wire)["location_specs"]]


def filter_wire(wire: bytes, names: frozenset[str]) -> bytes:
    """Keep only the specs named in ``names``; ``spec_size`` follows (Tair forgets it)."""
    loc = unpack_wire(wire)
    specs = [s for s in loc["location_specs"] if s["name"] in names]
    return bytes(_packer.pack({"type": loc["type"], "spec_size": len(specs), "location_specs": specs}))


def empty_wire(spec_names: Sequence[str]) -> bytes:
    """Tair's filler for a key without a usable location in batch_get / sw match."""
    return pack_wire("unspecified", [(name, "") for name in spec_names])


def block_db_key(namespace: bytes, key: int) -> bytes:
    """Fixed-width key of a block: 8-byte instance namespace + order-preserving int64."""
    return namespace + i64(key)


def check_value(value: bytes) -> None:
    """A stored block value's own invariants (``MetaIndex.check``)."""
    record = decode(value)
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
# with the wire bytes of each, pre-concatenated. It lives in the ``access`` database under
# ``namespace + i64(first key)``; every member's record names it (``Record.run``), and any change
# to a member deletes the run in the same transaction, so a run that exists is always exact.
# A prefix_match then costs one get per run instead of one per block (one aggregated
# record per prefix).
#
#   value := u16 len(storage) storage u32 n  n x int64 key (big-endian)  (n+1) x u32 offset  body
#
# Keys are plain big-endian int64 (:func:`pack_keys`, one C call for a whole request), so a
# request compares bytewise with a run; ``body[:offset[m]]`` is the msgpack array body of the
# first ``m`` locations.

RUNS_DB = "access"
_U32 = struct.Struct(">I")


def pack_keys(keys: Sequence[int]) -> bytes:
    return struct.pack(f">{len(keys)}q", *keys)


def encode_run(storage: str, keys: Sequence[int], wires: Sequence[bytes]) -> bytes:
    name = storage.encode()
    offsets, total = [0], 0
    for wire in wires:
        total += len(wire)
        offsets.append(total)
    return b"".join((_U16.pack(len(name)), name, _U32.pack(len(wires)), pack_keys(keys),
                     struct.pack(f">{len(offsets)}I", *offsets), *wires))


def run_match(value: bytes, request: bytes) -> tuple[str, int, bytes]:
    """``(storage, m, body of the first m locations)`` where ``m`` is the number of leading
    8-byte keys ``request`` shares with the run."""
    name_len = _U16.unpack_from(value, 0)[0]
    storage = value[2 : 2 + name_len].decode()
    pos = 2 + name_len
    n = _U32.unpack_from(value, pos)[0]
    keys = value[pos + 4 : pos + 4 + 8 * n]
    m = min(n, len(request) // 8)
    if keys[: 8 * m] != request[: 8 * m]:
        m = next(i for i in range(m) if keys[8 * i : 8 * i + 8] != request[8 * i : 8 * i + 8])
    offsets = pos + 4 + 8 * n
    body = offsets + 4 * (n + 1)
    end = _U32.unpack_from(value, offsets + 4 * m)[0]
    return storage, m, value[body : body + end]


def run_members(value: bytes) -> tuple[str, list[int], list[bytes]]:
    """``(storage, keys, wires)`` of a run (checks and tools; not the hot path)."""
    name_len = _U16.unpack_from(value, 0)[0]
    pos = 2 + name_len
    n = _U32.unpack_from(value, pos)[0]
    keys = list(struct.unpack_from(f">{n}q", value, pos + 4))
    offsets = struct.unpack_from(f">{n + 1}I", value, pos + 4 + 8 * n)
    body = pos + 4 + 8 * n + 4 * (n + 1)
    wires = [value[body + offsets[i] : body + offsets[i + 1]] for i in range(n)]
    return value[2:pos].decode(), keys, wires
