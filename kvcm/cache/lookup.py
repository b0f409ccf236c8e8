"""Read side of the data plane: ``get_cache_location`` (and ``get_cache_location_len``, its count
alone) and ``get_cache_meta``.

Reads are lock-free: one read transaction per request, values through the index's search cache.
Only ``serving`` copies on usable storages are visible; among several, the group's candidate
order decides (deterministic, unlike Tair's weighted random pick). Replies are assembled from
the pre-packed wire bytes stored in each record (:mod:`kvcm.cache.record_codec`), never decoded and
repacked on the fast path; a ``prefix_match`` first tries *runs* (the pre-concatenated reply
of blocks one session wrote together), which cost one read per run instead of one per block.

Records hold compact location addresses (:mod:`kvcm.cache.locations`); their wire bytes come from a
bounded cache of built wires, and run bodies are inflated once and cached
(``cache.wire_cache_bytes``).

Mask rules (every query type honours the mask, unlike Tair KVCM):

* ``prefix_match`` drops masked keys and walks the rest in order (Tair's compaction);
* ``batch_get`` answers one entry per request key; masked keys are not looked up (empty entry);
* ``reverse_roll_sw_match`` answers one entry per request key; a masked key cannot be part of
  the matched window.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter

import msgpack

from kvcm.backends.metastore.base import ReadTxn
from kvcm.cache.keys import derive_keys
from kvcm.cache.locations import ENTRY_ID, compact_row, reply_entries
from kvcm.cache.locations import wire as wire_of
from kvcm.cache.locations import wires as wire_cache
from kvcm.cache.masks import BlockMask, check_mask, masked_flags, unmasked_indices
from kvcm.cache.meta_index import CachedRead
from kvcm.cache.placement import InstanceView
from kvcm.cache.record_codec import (
    FAST,
    ONE,
    RUNS_DB,
    STATUS_NAMES,
    CompactRun,
    Status,
    decode,
    filter_wire,
    pack_keys,
    run_match,
    run_match_compact,
    unpack_wire,
)
from kvcm.cache.record_codec import (
    Location as RecordLocation,
)
from kvcm.cache.state import CacheState
from kvcm.errors import InvalidArgument
from kvcm.proto.locations import pack_compact
from kvcm.proto.wire import Encodable, EncodableMap, Raw, pack_array_raw

_packer = msgpack.Packer(use_bin_type=True)
_LOCATIONS_MAP = _packer.pack_map_header(1) + _packer.pack("locations")  # {"locations": <spliced array>}
_U64 = struct.Struct(">Q")
_SIGN = 1 << 63
#: Keys of a prefix walk's first read (:func:`_walk`); each next read takes twice as many.
_FIRST_SLICE = 256
#: Record kinds that hold exactly one serving copy in their header (:func:`visible`'s fast case).
_ONE_COPY = frozenset({ONE, FAST})
_KIND = itemgetter(0)
_HEAD = itemgetter(slice(0, 4))
Pick = Callable[[bytes, frozenset[str], Callable[[str], int]], "bytes | None"]
QUERY_TYPES = ("prefix_match", "batch_get", "reverse_roll_sw_match")
DETAIL_LEVELS = (0, 1, 2)


def _best(value: bytes, unusable: frozenset[str], rank: Callable[[str], int]) -> RecordLocation | None:
    best: RecordLocation | None = None
    for loc in decode(value).locs:
        usable = loc.status == Status.SERVING and loc.storage not in unusable
        if usable and (best is None or rank(loc.storage) < rank(best.storage)):
            best = loc
    return best


def visible(value: bytes, unusable: frozenset[str], rank: Callable[[str], int]) -> bytes | None:
    """Wire bytes of the copy a reader should use, or None."""
    addr = visible_addr(value, unusable, rank)
    return None if addr is None else wire_of(addr)


def visible_addr(value: bytes, unusable: frozenset[str], rank: Callable[[str], int]) -> bytes | None:
    """:func:`visible`'s copy as its stored address (compact, or a wire as is): what a compact
    reply carries, with no wire built."""
    if not unusable:
        kind = value[0]
        if kind == ONE:
            return value[2 : 2 + value[1]]
        if kind == FAST:
            return value[3 : 3 + (value[1] << 8 | value[2])]
    best = _best(value, unusable, rank)
    return None if best is None else best.addr


def get_cache_location(
    s: CacheState,
    instance_id: str,
    query_type: str,
    block_keys: Sequence[int] | None,
    token_ids: Sequence[int] | None,
    mask: BlockMask | None,
    sw_size: int,
    spec_names: Sequence[str] | None,
    reply: bool = True,
    compact: bool = False,
) -> tuple[int, Raw]:
    """``get_cache_location``: how many locations it answers, and (with ``reply``, else empty)
    the reply, classic or ``compact`` (:mod:`kvcm.proto.locations`); ``get_cache_location_len``
    takes the count alone, the same lookup and reads."""
    inst = s.instance(instance_id)
    if query_type not in QUERY_TYPES:
        raise InvalidArgument(f"query_type: {query_type!r} is not one of {', '.join(QUERY_TYPES)}")
    keys = derive_keys(block_keys, token_ids, inst.block_size)
    checked = check_mask(mask, len(keys))
    if query_type == "prefix_match" and compact and reply:
        hits, chunks = _prefix_compact(s, inst, keys, checked, spec_names)
        count = len(hits)
    elif query_type == "prefix_match":
        hits, chunks = _prefix(s, inst, keys, checked, spec_names, reply)
        count = len(hits)
    else:
        pick = visible_addr if compact else visible
        if query_type == "batch_get":
            hits, wires = _batch(s, inst, keys, checked, pick)
        else:
            if not 0 < sw_size <= len(keys):
                # sw_size == 0 made Tair loop forever.
                raise InvalidArgument(f"sw_size: must be in 1..{len(keys)} (the number of blocks), got {sw_size}")
            hits, wires = _window(s, inst, keys, checked, sw_size, pick)
        count = len(wires)
        if compact and reply:
            chunks = [compact_reply(wires, spec_names)]
        else:
            if spec_names and reply:
                names = frozenset(spec_names)
                wires = [filter_wire(w, names) for w in wires]
            chunks = [_LOCATIONS_MAP, pack_array_raw(wires).data] if reply else []
    if s.listeners:
        if hits:
            s.listeners.read(instance_id, hits, s.clock())
        s.listeners.lookup(instance_id, query_type, keys, token_ids, mask, sw_size, spec_names)
    return count, Raw(b"".join(chunks) if reply else b"")  # one copy of a reply that may be tens of kB


def _prefix(s: CacheState, inst: InstanceView, keys: list[int], mask: BlockMask | None,
            spec_names: Sequence[str] | None, reply: bool = True) -> tuple[list[int], list[bytes]]:
    """Matched keys and the reply's chunks (``{"locations": [...]}``): runs first, then block
    by block. Without ``reply`` (the length alone) no location's wire bytes are built: the
    chunks are then meaningless."""
    wanted = keys if mask is None else [keys[i] for i in unmasked_indices(mask, len(keys))]
    unusable = s.pool.unusable
    parts: list[bytes] = []
    epoch = s.index.cache.epoch  # before the snapshot begins: see MetaIndex.read
    with s.store.read() as view:
        done = _runs(view, inst.ns, wanted, unusable, parts) if s.runs and not spec_names else 0
        if done < len(wanted):
            rank = s.group_view(inst.group).rank
            if not reply:
                done += _visible_count(s, CachedRead(view, epoch), inst, wanted[done:], unusable, rank)
                return (wanted if done == len(wanted) else wanted[:done]), parts
            wires = _blocks(s, CachedRead(view, epoch), inst, wanted[done:], unusable, rank)
            if spec_names:
                names = frozenset(spec_names)
                wires = [filter_wire(w, names) for w in wires]
            parts += wires
            done += len(wires)
    hits = wanted if done == len(wanted) else wanted[:done]
    return hits, [_LOCATIONS_MAP, _packer.pack_array_header(done), *parts]


def _prefix_compact(s: CacheState, inst: InstanceView, keys: list[int], mask: BlockMask | None,
                    spec_names: Sequence[str] | None) -> tuple[list[int], list[bytes]]:
    """:func:`_prefix` answering in the compact shape: runs first (their compact entries are a
    slice of the run), then block by block, each block's stored address as is."""
    wanted = keys if mask is None else [keys[i] for i in unmasked_indices(mask, len(keys))]
    unusable = s.pool.unusable
    reply = CompactParts()
    epoch = s.index.cache.epoch  # before the snapshot begins: see MetaIndex.read
    with s.store.read() as view:
        if s.runs:
            _runs_compact(view, inst.ns, wanted, unusable, reply)
        if reply.count < len(wanted):
            rank = s.group_view(inst.group).rank
            reply.add(_blocks(s, CachedRead(view, epoch), inst, wanted[reply.count :], unusable, rank,
                              _fast_addrs, visible_addr))
    hits = wanted if reply.count == len(wanted) else wanted[: reply.count]
    return hits, [reply.pack(spec_names)]


def _runs_compact(view: ReadTxn, ns: bytes, wanted: list[int], unusable: frozenset[str], reply: CompactParts) -> None:
    """:func:`_runs` adding each run's compact entries to ``reply``."""
    packed: memoryview | None = None
    while reply.count < len(wanted):
        key = ns + _U64.pack(wanted[reply.count] + _SIGN)
        value = view.get(RUNS_DB, key)
        if value is None:
            return
        if packed is None:
            packed = memoryview(pack_keys(wanted))
        run = run_match_compact(value, packed[8 * reply.count :])
        if run is None or run.storage in unusable:
            return
        reply.add_run(run)
        if run.matched < 2:
            return  # the request left the run after its first key: go block by block


def _fast_addrs(values: list[bytes]) -> list[bytes] | None:
    """Addresses of values that each hold one serving copy in their header, or None."""
    if all(v[0] == ONE for v in values):
        return [v[2 : 2 + v[1]] for v in values]
    return None


class CompactParts:
    """A compact reply being assembled from run slices and single addresses (compact ones, or
    wires as is): a compact address is a 4-byte skeleton id and packed deltas, so the id as a
    msgpack uint32 (``0xce`` + its 4 bytes) followed by the deltas is its entry."""

    def __init__(self) -> None:
        self.count = 0
        self.elements = 0
        self.parts: list[bytes] = []
        self.heads: set[bytes] = set()

    def add_run(self, run: CompactRun) -> None:
        self.count += run.matched
        self.elements += run.elements
        self.parts.append(run.entries)
        self.heads.update(run.heads)

    def add(self, entries: list[bytes]) -> None:
        if not entries:
            return
        self.count += len(entries)
        if max(map(_KIND, entries)) < 0x80:  # every one compact: one join
            self.parts += (ENTRY_ID, ENTRY_ID.join(entries))
            self.elements += 2 * len(entries)
            self.heads.update(map(_HEAD, entries))
            return
        addrs = [e for e in entries if e[0] < 0x80]
        self.parts.append(b"".join(reply_entries(entries)))
        self.elements += len(entries) + len(addrs)
        self.heads.update(map(_HEAD, addrs))

    def pack(self, spec_names: Sequence[str] | None) -> bytes:
        rows = [compact_row(h) for h in sorted(self.heads)]
        return pack_compact(self.count, rows, self.elements, b"".join(self.parts), spec_names)


def compact_reply(entries: list[bytes], spec_names: Sequence[str] | None) -> bytes:
    """A compact reply of the locations whose stored addresses (or wires) are ``entries``."""
    reply = CompactParts()
    reply.add(entries)
    return reply.pack(spec_names)


def _runs(view: ReadTxn, ns: bytes, wanted: list[int], unusable: frozenset[str], parts: list[bytes]) -> int:
    """Match the leading keys against run records; returns how many keys they covered."""
    packed: memoryview | None = None  # the keys packed once a run is found; sliced without a copy
    done = 0
    while done < len(wanted):
        key = ns + _U64.pack(wanted[done] + _SIGN)
        value = view.get(RUNS_DB, key)
        if value is None:
            break
        if packed is None:
            packed = memoryview(pack_keys(wanted))
        storage, matched, body = run_match(value, packed[8 * done :], key)
        if storage in unusable:
            break
        parts.append(body)
        done += matched
        if matched < 2:
            break  # the request left the run after its first key: go block by block
    return done


def _walk(s: CacheState, snap: CachedRead, ns: bytes, wanted: list[int]) -> Iterator[list[bytes]]:
    """The stored values of a prefix walk's keys, a slice at a time (the first of
    :data:`_FIRST_SLICE` keys, each next one twice as long), until a slice ends at a key
    without a record. A long prompt whose prefix ends early (a miss at its fourth block of
    100,000) is read a slice deep, not whole; a walk over every key reads each once."""
    lo, size = 0, _FIRST_SLICE
    while lo < len(wanted):
        part = wanted[lo : lo + size]
        values: list[bytes] = s.index.get_values(snap, ns, part, stop_at_missing=True)  # type: ignore[assignment]
        yield values
        if len(values) < len(part):
            return
        lo += size
        size *= 2


def _blocks(s: CacheState, snap: CachedRead, inst: InstanceView, wanted: list[int], unusable: frozenset[str],
            rank: Callable[[str], int], fast: Callable[[list[bytes]], list[bytes] | None] | None = None,
            pick: Pick = visible) -> list[bytes]:
    """The visible wires (or what ``pick`` gives: :func:`visible_addr`) of the matched prefix;
    ``fast`` answers a slice whose blocks all hold one serving copy in their header."""
    fast = fast or _fast_wires
    out: list[bytes] = []
    for values in _walk(s, snap, inst.ns, wanted):
        found = None if unusable else fast(values)  # the common case: one serving copy each
        if found is not None:
            out += found
            continue
        for value in values:
            one = pick(value, unusable, rank)
            if one is None:
                return out
            out.append(one)
    return out


def _visible_count(s: CacheState, snap: CachedRead, inst: InstanceView, wanted: list[int], unusable: frozenset[str],
                   rank: Callable[[str], int]) -> int:
    """How many leading keys of ``wanted`` have a visible copy (:func:`_blocks`' length,
    without building a location's wire bytes)."""
    count = 0
    for values in _walk(s, snap, inst.ns, wanted):
        if not unusable and _ONE_COPY.issuperset(map(_KIND, values)):
            count += len(values)  # one serving copy each, in its header: all visible
            continue
        for value in values:
            if visible(value, unusable, rank) is None:
                return count
            count += 1
    return count


def _fast_wires(values: list[bytes]) -> list[bytes] | None:
    """Wires of values that each hold one serving copy in their header, or None."""
    young = wire_cache.young()  # hits in the young generation inline; the rest via wire_of
    out: list[bytes] = []
    append = out.append
    for v in values:
        kind = v[0]
        if kind == ONE:
            addr = v[2 : 2 + v[1]]
            entry = young.get(addr)
            append(entry[0] if entry is not None else wire_of(addr))
        elif kind == FAST:
            append(v[3 : 3 + (v[1] << 8 | v[2])])
        else:
            return None
    return out


def _usable(s: CacheState, inst: InstanceView, keys: list[int], mask: BlockMask | None,
            pick: Pick = visible) -> list[bytes | None]:
    """Visible wire (or what ``pick`` gives) per request key (None: missing, invisible or masked)."""
    flags = masked_flags(mask, len(keys))
    look = keys if flags is None else [k for k, masked in zip(keys, flags) if not masked]
    unusable, rank = s.pool.unusable, s.group_view(inst.group).rank
    with s.index.read() as snap:
        values = iter(s.index.get_values(snap, inst.ns, look))
    out: list[bytes | None] = []
    for i in range(len(keys)):
        if flags is not None and flags[i]:
            out.append(None)
            continue
        value = next(values)
        out.append(None if value is None else pick(value, unusable, rank))
    return out


def _batch(s: CacheState, inst: InstanceView, keys: list[int], mask: BlockMask | None,
           pick: Pick = visible) -> tuple[list[int], list[bytes]]:
    found = _usable(s, inst, keys, mask, pick)
    hits = [k for k, w in zip(keys, found) if w is not None]
    return hits, [inst.empty_wire if w is None else w for w in found]


def _window(s: CacheState, inst: InstanceView, keys: list[int], mask: BlockMask | None,
            sw: int, pick: Pick = visible) -> tuple[list[int], list[bytes]]:
    """The right-most window of ``sw`` consecutive keys that all have a visible copy (Tair's
    reverse roll: on a miss at window offset j, the next window ends right before it)."""
    found = _usable(s, inst, keys, mask, pick)
    out = [inst.empty_wire] * len(keys)
    base = len(keys) - sw
    while base >= 0:
        miss = next((j for j in range(sw) if found[base + j] is None), None)
        if miss is None:
            window = range(base, base + sw)
            for i in window:
                out[i] = found[i]  # type: ignore[assignment]  # checked not None above
            return [keys[i] for i in window], out
        base = base + miss - sw
    return [], out


# -- get_cache_meta -------------------------------------------------------------------------------


def get_cache_meta(
    s: CacheState,
    instance_id: str,
    block_keys: Sequence[int] | None,
    token_ids: Sequence[int] | None,
    mask: BlockMask | None,
    detail_level: int,
) -> dict[str, Encodable]:
    """One entry per request key (Tair compacted by the mask): ``locations[i]`` is the
    copy a reader would get (else the first copy, else an empty location) and ``metas[i]`` says
    what kvcm knows, in more detail as ``detail_level`` grows:

    * 0 — ``key``, ``status`` (``serving``/``writing``/``deleting``/``not_found``/``masked``), ``id``;
    * 1 — plus ``storage``, ``type``, ``nbytes``, ``created``, ``written``, ``updated``,
      ``parent``, ``location_count``;
    * 2 — plus ``all``: every location with its own status, storage, size, times and URIs.
    """
    inst = s.instance(instance_id)
    if detail_level not in DETAIL_LEVELS:
        raise InvalidArgument(f"detail_level: must be one of {DETAIL_LEVELS}, got {detail_level}")
    keys = derive_keys(block_keys, token_ids, inst.block_size)
    flags = masked_flags(check_mask(mask, len(keys)), len(keys))
    unusable, rank = s.pool.unusable, s.group_view(inst.group).rank
    with s.index.read() as snap:
        values = s.index.get_values(snap, inst.ns, keys)
    locations: list[EncodableMap] = []
    metas: list[EncodableMap] = []
    for i, (key, value) in enumerate(zip(keys, values)):
        if flags is not None and flags[i]:
            locations.append(_EMPTY)
            metas.append({"key": key, "status": "masked"})
            continue
        location, meta = _describe(key, value, detail_level, unusable, rank)
        locations.append(location)
        metas.append(meta)
    return {"locations": locations, "metas": metas}


_EMPTY: EncodableMap = {"type": "unspecified", "spec_size": 0, "location_specs": []}


def _describe(key: int, value: bytes | None, level: int, unusable: frozenset[str],
              rank: Callable[[str], int]) -> tuple[EncodableMap, EncodableMap]:
    if value is None:
        return _EMPTY, {"key": key, "status": "not_found"}  # no "id" here (Tair leaked one)
    record = decode(value)
    wire = visible(value, unusable, rank)
    loc = next((x for x in record.locs if x.wire == wire), record.locs[0])
    meta: dict[str, Encodable] = {"key": key, "status": STATUS_NAMES[Status(loc.status)], "id": loc.id}
    if level >= 1:
        meta.update(storage=loc.storage, type=loc.type, nbytes=loc.nbytes, created=loc.created,
                    written=loc.written, updated=record.updated, parent=record.parent,
                    location_count=len(record.locs))
    if level >= 2:
        meta["all"] = [_loc_meta(x) for x in record.locs]
    return unpack_wire(loc.wire), meta


def _loc_meta(loc: RecordLocation) -> dict[str, Encodable]:
    return {"id": loc.id, "status": STATUS_NAMES[Status(loc.status)], "storage": loc.storage, "type": loc.type,
            "nbytes": loc.nbytes, "created": loc.created, "written": loc.written,
            "location": unpack_wire(loc.wire)}
