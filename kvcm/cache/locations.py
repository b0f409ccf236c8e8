"""Location addresses: how a block record names a location without storing its URIs as text.

A client receives a location as its *wire* form, a msgpack map
``{"type", "spec_size", "location_specs": [{"name", "uri"}]}`` (about 170 B for two specs). Two
locations of one storage and spec layout differ only in a few numbers inside their URIs, so
records keep the shared part once, in a *location skeleton*:

    skeleton := [type, storage, nbytes, [spec name], [URI skeleton], [ints per URI], [reference ints]]

(URI skeletons from :mod:`kvcm.cache.uricodec`; the reference ints are those of the first location
that created the skeleton), and per location only an *address*:

    addr := id  msgpack([int - reference int, mod 2**64])   -- compact: 4-byte id, top bit clear
          | wire                                            -- verbatim (a msgpack map: >= 0x80)

Constant numbers (sizes, a storage id) become 0 and cost one byte each. A URI that does not
round-trip exactly through :func:`kvcm.cache.uricodec.split`, a skeleton whose id collides with another
one, and any location once the table holds :data:`MAX_SKELETONS` are stored verbatim.

A skeleton's id is 31 bits of its packed form's BLAKE2b digest: the same skeleton has the same id
in every process and data dir, so the table here is process-wide (tests open many stores in one
process) and any address expands without knowing its store. Each store persists the skeletons its
records use in the ``skeletons`` database (id -> packed skeleton): :func:`persist` writes one in
the transaction of the first record that uses it there (again in every transaction until one of
them commits); :func:`load` reads them when the store is opened.

Rebuilding a wire costs microseconds, so built wires are kept in a bounded cache keyed by the
address (a pure function of it: exact by construction), sized by ``cache.wire_cache_bytes``.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Iterable, Sequence
from functools import lru_cache, partial
from itertools import repeat
from operator import add
from typing import Generic, NamedTuple, TypeVar

import msgpack

from kvcm.backends.metastore.base import MetaStore, ReadTxn, WriteTxn
from kvcm.cache.uricodec import PLACEHOLDER, matcher, split
from kvcm.errors import Code, ServerError

V = TypeVar("V")  # what a BuiltCache holds per compact key

DB = "skeletons"
MAX_SKELETONS = 4096  # past this, new shapes are stored verbatim (a storage with free-form URIs)
_ID = 0x7FFFFFFF  # ids keep the top bit clear: a verbatim wire starts with a map header (>= 0x80)
_MASK = (1 << 64) - 1
_HALF = 1 << 63
_packer = msgpack.Packer(use_bin_type=True)


class Skeleton(NamedTuple):
    type: str
    storage: str
    nbytes: int
    names: tuple[str, ...]
    fmts: tuple[str, ...]  # one URI skeleton per spec
    counts: tuple[int, ...]  # how many ints each URI holds
    ref: tuple[int, ...]  # reference ints, all URIs in order

    def pack(self) -> bytes:
        return bytes(_packer.pack([self.type, self.storage, self.nbytes, list(self.names), list(self.fmts),
                                   list(self.counts), list(self.ref)]))


def unpack_skeleton(packed: bytes) -> Skeleton:
    t, storage, nbytes, names, fmts, counts, ref = msgpack.unpackb(packed, raw=False)
    return Skeleton(t, storage, nbytes, tuple(names), tuple(fmts), tuple(counts), tuple(ref))


def skeleton_id(packed: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(packed, digest_size=4).digest(), "big") & _ID


class BuiltCache(Generic[V]):
    """Bounded, approximately-LRU map of compact bytes -> bytes built from them, sized in bytes.

    Two generations of dicts (as :class:`kvcm.cache.meta_index.SearchCache`): inserts go to ``young``; when
    it holds half the budget, ``old`` is dropped whole. Every operation is a dict call, so it is
    safe under the GIL on any thread."""

    # What one entry costs beyond its key's and value's contents, so the budget bounds real
    # memory: two bytes headers (33 each), the (value, size) tuple (56), the size int (32) and
    # the dict's slot, up to about 100 B just after the dict grew. Measured with tracemalloc
    # (tests/cache/test_memory_bounds.py): a full cache then holds at most its capacity.
    ENTRY = 224

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._young: dict[bytes, tuple[V, int]] = {}
        self._old: dict[bytes, tuple[V, int]] = {}
        self._young_bytes = 0

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def get(self, key: bytes) -> V | None:
        entry = self._young.get(key)
        if entry is None:
            entry = self._old.get(key)
            if entry is None:
                return None
            self.put(key, entry[0], entry[1])
        return entry[0]

    def put(self, key: bytes, value: V, size: int) -> None:
        half = self.capacity // 2
        if size > half:
            return
        if self._young_bytes + size > half:
            self._old, self._young, self._young_bytes = self._young, {}, 0
        self._young[key] = (value, size)
        self._young_bytes += size

    def young(self) -> dict[bytes, tuple[V, int]]:
        """The young generation, for callers that inline :meth:`get`'s common case (values are
        ``(value, size)`` pairs)."""
        return self._young

    def resize(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self.clear()

    def clear(self) -> None:
        self._young, self._old, self._young_bytes = {}, {}, 0


_by_id: dict[int, Skeleton] = {}
_packed: dict[int, bytes] = {}
_by_shape: dict[tuple[str, str, int, tuple[str, ...], tuple[str, ...]], int] = {}
_facts: dict[bytes, tuple[str, str, int]] = {}  # 4-byte id -> (storage, type, nbytes)
_last: dict[tuple[str, str, int, tuple[str, ...]], int] = {}  # (type, storage, nbytes, spec names) -> skeleton last used
_lock = threading.Lock()
_persisted: weakref.WeakKeyDictionary[MetaStore, set[int]] = weakref.WeakKeyDictionary()
wires: BuiltCache[bytes] = BuiltCache(8 << 20)  # a quarter of cache.wire_cache_bytes' default, until the app sets it


# -- wire form ------------------------------------------------------------------------------------


def pack_wire(storage_type: str, specs: Sequence[tuple[str, str]]) -> bytes:
    """The client-facing location map."""
    return bytes(_packer.pack(
        {
            "type": storage_type,
            "spec_size": len(specs),
            "location_specs": [{"name": name, "uri": uri} for name, uri in specs],
        }
    ))


# -- addresses ------------------------------------------------------------------------------------


def address(storage_type: str, storage: str, nbytes: int, specs: Sequence[tuple[str, str]]) -> bytes:
    """The address of a location (compact when its URIs allow, else its wire)."""
    names = tuple(name for name, _ in specs)
    context = (storage_type, storage, nbytes, names)
    last = _last.get(context)
    ints = None if last is None else _match(_by_id[last], specs)
    if last is not None and ints is not None:
        sid = last
    else:
        found = _split(storage_type, storage, nbytes, names, specs)
        if found is None:
            return pack_wire(storage_type, specs)
        sid, ints = found
        _last[context] = sid
    deltas = [v - r for v, r in zip(ints, _by_id[sid].ref)]
    if deltas and min(deltas) < -_HALF:
        # msgpack holds no int below -2**63: rare enough to store the wire itself, which keeps
        # every compact address's sums in range (so building a wire needs no range check).
        return pack_wire(storage_type, specs)
    return sid.to_bytes(4, "big") + bytes(_packer.pack(deltas))


def addresses(storage_type: str, storage: str, nbytes: int, names: Sequence[str],
              uri_lists: Sequence[Sequence[str]]) -> list[bytes]:
    """:func:`address` of many locations with the same spec names and size, as a write
    allocates them: when they all have the skeleton the last one of this kind had, a few C
    calls for the whole batch (one translate, one slice per integer column, one format to check
    every URI comes back, one subtraction)."""
    sid = _last.get((storage_type, storage, nbytes, tuple(names)))
    ints = None
    if sid is not None and len(uri_lists) > 1:
        skeleton = _by_id[sid]
        plan = _columns(sid)
        ints = None if plan is None else _batch_ints(skeleton, plan, uri_lists)
    if sid is None or ints is None:
        return [address(storage_type, storage, nbytes, list(zip(names, u))) for u in uri_lists]
    per = len(skeleton.ref)
    deltas = list(map(int.__sub__, ints, skeleton.ref * len(uri_lists)))
    if min(deltas) < -_HALF:  # some location needs its wire stored as is (see address)
        return [address(storage_type, storage, nbytes, list(zip(names, u))) for u in uri_lists]
    head, pack = sid.to_bytes(4, "big"), _packer.pack
    return [head + bytes(pack(deltas[i : i + per])) for i in range(0, len(deltas), per)]


# every byte that cannot be part of a number (a run of lower-case hex digits) -> space
_HEX_ONLY = bytes(c if 0x30 <= c <= 0x39 or 0x61 <= c <= 0x66 else 0x20 for c in range(256))


class _Columns(NamedTuple):
    """Where a skeleton's integers sit among the hex-digit runs of its URIs (joined by newlines,
    as :func:`_batch_ints` joins them): ``tokens`` runs per location, and per integer the index
    of its run and the base it is written in. Literal text adds runs too ("file" holds ``f`` and
    ``e``), always the same ones, so the integers sit at fixed places in every location."""

    tokens: int
    where: tuple[tuple[int, int], ...]


@lru_cache(maxsize=MAX_SKELETONS)
def _columns(sid: int) -> _Columns | None:
    skeleton = _by_id[sid]
    where: list[tuple[int, int]] = []
    count = 0
    for fmt in skeleton.fmts:
        pieces = PLACEHOLDER.split(fmt)  # literal, placeholder, literal, ...
        for i, piece in enumerate(pieces):
            if i % 2 == 0 or piece == "%%":
                count += len(piece.replace("%%", "%").encode().translate(_HEX_ONLY).split())
                continue
            before, after = pieces[i - 1], pieces[i + 1]
            if (not before and i > 1) or (not after and i + 2 < len(pieces)) or \
                    before[-1:] in _HEX_DIGITS or after[:1] in _HEX_DIGITS:
                return None  # a run touches another (a long number cut into chunks): no fixed places
            where.append((count, 16 if piece.endswith("x") else 10))
            count += 1
    return _Columns(count, tuple(where)) if len(where) == len(skeleton.ref) else None


_HEX_DIGITS = frozenset("0123456789abcdef")


def _batch_ints(skeleton: Skeleton, plan: _Columns, uri_lists: Sequence[Sequence[str]]) -> list[int] | None:
    """Every integer of every URI, if each URI has this skeleton's shape. The runs come out of
    one ``bytes.translate`` + ``split`` (regexes cost far more per character), each integer's
    column out of one slice; one format of the whole batch then proves each URI comes back
    exactly."""
    flat = "\n".join(u for uris in uri_lists for u in uris)
    runs = flat.encode().translate(_HEX_ONLY).split()
    if len(runs) != plan.tokens * len(uri_lists):
        return None
    try:
        columns = [list(map(int, runs[at :: plan.tokens], repeat(base))) for at, base in plan.where]
    except ValueError:  # a hex run where the skeleton has a decimal number
        return None
    ints = [v for row in zip(*columns) for v in row]
    if "\n".join(["\n".join(skeleton.fmts)] * len(uri_lists)) % tuple(ints) != flat:
        return None  # another shape somewhere in the batch (or a newline in a URI)
    return ints


def _match(skeleton: Skeleton, specs: Sequence[tuple[str, str]]) -> list[int] | None:
    """The ints of ``specs`` if their URIs have this skeleton's shape (the common case: a
    storage hands out URIs of one shape)."""
    ints: list[int] = []
    for (_, uri), fmt in zip(specs, skeleton.fmts):
        got = matcher(fmt)(uri)
        if got is None:
            return None
        ints += got
    return ints


def _split(storage_type: str, storage: str, nbytes: int, names: tuple[str, ...],
           specs: Sequence[tuple[str, str]]) -> tuple[int, list[int]] | None:
    fmts: list[str] = []
    counts: list[int] = []
    ints: list[int] = []
    for _, uri in specs:
        got = split(uri)
        if got is None:
            return None
        fmts.append(got[0])
        counts.append(len(got[1]))
        ints += got[1]
    sid = _by_shape.get((storage_type, storage, nbytes, names, tuple(fmts)))
    if sid is None:
        sid = _intern(Skeleton(storage_type, storage, nbytes, names, tuple(fmts), tuple(counts), tuple(ints)))
    return None if sid is None else (sid, ints)


def _intern(skeleton: Skeleton) -> int | None:
    packed = skeleton.pack()
    sid = skeleton_id(packed)
    with _lock:
        known = _packed.get(sid)
        if known is not None and known != packed:
            return None  # an id collision: this shape stays verbatim
        if known is None and len(_by_id) >= MAX_SKELETONS:
            return None
        _register(sid, packed, skeleton)
    return sid


def _register(sid: int, packed: bytes, skeleton: Skeleton) -> None:
    _by_id[sid] = skeleton
    _packed[sid] = packed
    _by_shape.setdefault(skeleton[:5], sid)
    _facts[sid.to_bytes(4, "big")] = (skeleton.storage, skeleton.type, skeleton.nbytes)


def is_compact(addr: bytes) -> bool:
    return addr[0] < 0x80


class UnknownSkeleton(ServerError):
    """A record names a skeleton this process has not loaded (on a follower: one the leader
    stored after the follower last loaded them)."""


def skeleton_of(addr: bytes) -> Skeleton:
    sid = int.from_bytes(addr[:4], "big")
    skeleton = _by_id.get(sid)
    if skeleton is None:
        raise UnknownSkeleton(f"block record names location skeleton {sid:08x}, which this data dir does not hold",
                          Code.INTERNAL_ERROR)
    return skeleton


def facts(addr: bytes) -> tuple[str, str, int]:
    """``(storage, type, nbytes)`` of a compact address."""
    found = _facts.get(addr[:4])
    if found is None:
        skeleton = skeleton_of(addr)  # raises: not in the table
        return skeleton.storage, skeleton.type, skeleton.nbytes
    return found


def uris(addr: bytes) -> list[str]:
    """The URIs of a location, one per spec."""
    if not is_compact(addr):
        return [spec["uri"] for spec in msgpack.unpackb(addr, raw=False)["location_specs"]]
    return _uris(skeleton_of(addr), addr)


def wire_uris(addr: bytes) -> list[str]:
    """:func:`uris`, read back from the location's wire (:func:`wire`): a wire built before
    costs one unpack, less than formatting the URIs again."""
    return [spec["uri"] for spec in msgpack.unpackb(wire(addr), raw=False)["location_specs"]]


def _uris(skeleton: Skeleton, addr: bytes) -> list[str]:
    ints = list(map(int.__add__, skeleton.ref, msgpack.unpackb(addr[4:])))
    if ints and (min(ints) < 0 or max(ints) > _MASK):
        ints = [i & _MASK for i in ints]  # a delta that wrapped around 2**64
    out, pos = [], 0
    for fmt, n in zip(skeleton.fmts, skeleton.counts):
        out.append(fmt % tuple(ints[pos : pos + n]))
        pos += n
    return out


#: msgpack's uint32 marker: a compact address's 4-byte skeleton id read as a number, so the id
#: then the packed deltas are a compact reply's entry (kvcm.proto.locations).
ENTRY_ID = b"\xce"


def reply_entries(addrs: Sequence[bytes]) -> list[bytes]:
    """Each address as a compact reply's entry: a compact one behind :data:`ENTRY_ID`, a wire
    (a verbatim address) as it is."""
    return [ENTRY_ID + a if a[0] < 0x80 else a for a in addrs]


@lru_cache(maxsize=MAX_SKELETONS)
def compact_row(head: bytes) -> bytes:
    """A skeleton's packed row in a compact location reply (:mod:`kvcm.proto.locations`):
    ``[id, type, names, fmts, counts, ref]``, from the 4-byte id a compact address starts with."""
    s = skeleton_of(head)
    return bytes(_packer.pack([int.from_bytes(head, "big"), s.type, list(s.names), list(s.fmts), list(s.counts),
                               list(s.ref)]))


def _str_header(n: int) -> bytes:
    """msgpack's header of an ``n``-byte string (as :func:`pack_wire`'s packer writes it)."""
    if n < 32:
        return bytes((0xA0 | n,))
    if n < 256:
        return bytes((0xD9, n))
    return (b"\xda" + n.to_bytes(2, "big")) if n < 65536 else (b"\xdb" + n.to_bytes(4, "big"))


@lru_cache(maxsize=MAX_SKELETONS)
def _wire_pieces(skeleton: Skeleton) -> tuple[bytes, ...]:
    """The constant bytes of a skeleton's wire, around its URIs: ``pieces[0] uri0 pieces[1]
    uri1 ...`` (each URI with its string header), the same bytes :func:`pack_wire` writes."""
    marker = "\x00kvcm-uri\x00"
    packed = pack_wire(skeleton.type, [(name, marker) for name in skeleton.names])
    pieces = tuple(packed.split(_str_header(len(marker)) + marker.encode()))
    return pieces if len(pieces) == len(skeleton.names) + 1 else ()  # (): a name holds the marker


class _Builder(NamedTuple):
    """What building one skeleton's wire needs, prepared once: the constant pieces around the
    URIs, each URI's skeleton as a *bytes* format with the slice of ints it takes, and the
    reference ints. Building is then one unpack, one add, and one ``%`` per URI, at C speed."""

    pieces: tuple[bytes, ...]
    fmts: tuple[tuple[bytes, int, int], ...]
    ref: tuple[int, ...]


_builders: dict[bytes, _Builder | None] = {}  # addr[:4] -> builder (None: build the slow way)
_HEADERS = [_str_header(n) for n in range(256)]


def _builder(head: bytes) -> _Builder | None:
    found = _builders.get(head, False)
    if found is not False:
        return found  # type: ignore[return-value]
    skeleton = skeleton_of(head)
    pieces = _wire_pieces(skeleton)
    built: _Builder | None = None
    if pieces and all(fmt.isascii() for fmt in skeleton.fmts):
        fmts, pos = [], 0
        for fmt, n in zip(skeleton.fmts, skeleton.counts):
            fmts.append((fmt.encode(), pos, pos + n))
            pos += n
        built = _Builder(pieces, tuple(fmts), skeleton.ref)
    _builders[head] = built
    return built


def _build(addr: bytes) -> bytes:
    head = addr[:4]
    builder = _builder(head)
    if builder is None:
        skeleton = skeleton_of(head)
        return pack_wire(skeleton.type, list(zip(skeleton.names, _uris(skeleton, addr))))
    ints = list(map(add, builder.ref, msgpack.unpackb(addr[4:])))  # in range: see address()
    pieces = builder.pieces
    parts = [pieces[0]]
    for i, (fmt, lo, hi) in enumerate(builder.fmts):
        raw = fmt % tuple(ints[lo:hi])
        n = len(raw)
        parts += (_HEADERS[n] if n < 256 else _str_header(n), raw, pieces[i + 1])
    return b"".join(parts)


def wire(addr: bytes) -> bytes:
    """The wire form of a location, from the cache when it was built before."""
    if addr[0] >= 0x80:
        return addr
    built: bytes | None = wires.get(addr)
    if built is None:
        built = _build(addr)
        wires.put(addr, built, len(addr) + len(built) + BuiltCache.ENTRY)
    return built


def set_wire_cache_bytes(capacity: int) -> None:
    wires.resize(capacity)


def remember(addr: bytes, built: bytes) -> None:
    """Seed the cache with a wire the caller packed anyway (the reply of a write)."""
    if addr[0] < 0x80:
        wires.put(addr, built, len(addr) + len(built) + BuiltCache.ENTRY)


# -- persistence ----------------------------------------------------------------------------------


def _done(store: MetaStore) -> set[int]:
    done = _persisted.get(store)
    if done is None:
        done = _persisted[store] = set()
    return done


def persist(txn: WriteTxn, store: MetaStore, addrs: Iterable[bytes]) -> None:
    """Make sure ``store`` holds the skeletons ``addrs`` use, in ``txn`` (the transaction that
    writes the records naming them)."""
    done = _done(store)
    for raw in {a[:4] for a in addrs if a[0] < 0x80}:
        sid = int.from_bytes(raw, "big")
        if sid not in done:
            txn.put(DB, raw, _packed[sid])
            txn.on_commit(partial(done.add, sid))


def load(store: MetaStore) -> int:
    """Read the skeletons a store holds into the process-wide table; returns how many."""
    with store.read() as view:
        items = list(view.scan(DB))
    done = _done(store)
    with _lock:
        for key, packed in items:
            sid = int.from_bytes(key, "big")
            if skeleton_id(packed) != sid:
                raise ServerError(f"location skeleton {sid:08x} does not match its id", Code.INTERNAL_ERROR)
            known = _packed.get(sid)
            if known is not None and known != packed:
                raise ServerError(f"location skeleton {sid:08x} differs from one another data dir in this "
                                  "process holds", Code.INTERNAL_ERROR)
            if known is None:
                _register(sid, packed, unpack_skeleton(packed))
            done.add(sid)
    return len(items)


def check(view: ReadTxn, addrs: Iterable[bytes]) -> None:
    """Every compact address names a skeleton the store holds (``MetaIndex.check``)."""
    ids = {a[:4] for a in addrs if a[0] < 0x80}
    for raw in ids:
        assert view.get(DB, raw) is not None, f"skeleton {raw.hex()} used by a record but not stored"
