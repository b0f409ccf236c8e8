"""Engine-index records: one engine block, one source's state, their persisted form.

Persisted layout (sub-databases reserved in ``kvcm.backends.metastore.base.DATABASES``):

* ``engine_sources``: ``source_id`` (UTF-8) -> msgpack ``{spec, number, last_seq, last_ts, groups}``,
  ``groups`` being ``[group, kind, window, engine block size]`` per KV-cache group the source
  named (``[group, kind]`` in records written before the window and block size were kept);
* ``engine_log``: ``number (u32) | serial (u64)``, big-endian, -> msgpack ``[hashes, groups,
  blocks]``: the blocks one flush changed, block *i* being engine hash ``hashes[i]`` of group
  ``groups[i]`` (``groups`` is empty when every group is 0, the usual case) and ``blocks[i]``
  its record ``[lora, end state, end position, kvcm keys, {medium: holdings}]``, or nil when the
  block is gone (a tombstone). A source's records replayed in serial order give its blocks.
* ``engine_blocks`` (the format before the log, still read): ``number (u32) | group (u32) |
  engine hash (u64)`` -> one block record. Loaded first, the log replayed over it; deleted with
  the source's next rewrite.

Log-structured because one record per flush instead of one per block is what keeps persisting
cheap next to re-hashing and indexing (an LMDB put and a key each per block cost about as much
as both). A source whose records hold more than twice its live blocks (plus
:data:`COMPACT_SLACK`: superseded versions and tombstones) is rewritten as its live blocks at
its next flush, in the same transaction, so the log stays within about twice the index and each
logged entry is rewritten at most once on average. A cleared source is rewritten the same way.

``number`` is a small per-source integer so a source's records form one ordered key range
(cleared with one prefix scan).
"""

from __future__ import annotations

import struct
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import repeat
from operator import and_, rshift
from typing import Any

import msgspec

from kvcm.backends.metastore.base import WriteTxn
from kvcm.engines.hybrid import GroupDetail, GroupInfo, group_record
from kvcm.engines.sources import SourceSpec
from kvcm.proto.kv_events import DecodedBatch

SOURCES_DB = "engine_sources"
BLOCKS_DB = "engine_blocks"  # the per-block records before the log: read, never written
LOG_DB = "engine_log"
BLOCK_KEY = struct.Struct(">IIQ")  # source number, group, engine hash
LOG_KEY = struct.Struct(">IQ")  # source number, serial
SID = struct.Struct(">I")
#: Entries per log record at most (a rewrite of a large source is split into several).
CHUNK = 8192
#: Superseded entries and tombstones a source's log may hold beyond its live blocks before it is
#: rewritten (a small source is not rewritten for every few changes).
COMPACT_SLACK = 4096
TWO64 = 1 << 64
TOP = 1 << 63
M64 = TWO64 - 1
ENC = msgspec.msgpack.Encoder()
DEC = msgspec.msgpack.Decoder()


def block_id(group: int, h: int) -> int:
    """A block's key in ``SourceState.blocks``: its group and engine hash in one int (not a
    tuple: ints are not tracked by the garbage collector, and group 0's ids are the hashes)."""
    return group << 64 | h


def weight(blk: EngineBlock) -> int:
    """What one block counts against the index's bounds: its kvcm keys, at least 1 (a block
    that closes no key still takes a record). A block covering many keys (an engine block of
    ``k`` instance blocks) costs about ``k`` times the memory, so it counts ``k`` times."""
    return len(blk.keys) or 1


def normalize_medium(medium: str | None) -> str:
    """``None`` is the GPU block pool; spellings are upper-cased (LMCache sent ``cpu``)."""
    return "GPU" if not medium else medium.upper()


class SourceMatch(msgspec.Struct, gc=False):
    """One ``match_engines`` entry: a source and its matched prefix per medium. A hybrid
    source's (:mod:`kvcm.engines.hybrid`) also has its groups' detail, and why it holds nothing
    when kvcm cannot reason about one of its groups."""

    source_id: str
    dp_rank: int
    matched_blocks: int
    media: dict[str, int]
    groups: list[GroupDetail] | None = None
    unsupported: str | None = None


class EngineBlock(msgspec.Struct, array_like=True, gc=False):
    """One engine block of one source: its kvcm keys, chain end state, and holdings per medium.

    A Struct without GC tracking (it holds no references that could form a cycle): the index
    keeps one per engine block, and as tracked objects their collection cost more than building
    them. Encoded as the array ``[lora, end, pos, keys, refs]`` (the persisted record).
    ``end`` is the chain state after the block, used mod 2**64: the signed form, which is also
    its last kvcm key (one int for both), or unsigned in records written before that.
    ``refs`` (holdings per medium) is replaced, never changed in place: blocks share it."""

    lora: str
    end: int
    pos: int
    keys: tuple[int, ...]
    refs: dict[str, int] = msgspec.field(default_factory=dict)

    def pack(self) -> bytes:
        return ENC.encode(self)

    @classmethod
    def unpack(cls, raw: bytes) -> EngineBlock:
        return _BLOCK_DEC.decode(raw)


_BLOCK_DEC = msgspec.msgpack.Decoder(EngineBlock)


class LogRecord(msgspec.Struct, array_like=True, gc=False):
    """One ``engine_log`` record: the blocks a flush wrote (module docstring)."""

    hashes: list[int]
    groups: list[int]
    blocks: list[EngineBlock | None]

    def ids(self) -> list[int]:
        """The blocks' ids (:func:`block_id`)."""
        if not self.groups:
            return self.hashes
        if len(self.groups) != len(self.hashes):
            raise ValueError("engine_log record: groups and hashes differ in length")
        return list(map(block_id, self.groups, self.hashes))


_LOG_DEC = msgspec.msgpack.Decoder(LogRecord)


def decode_log(raw: bytes) -> LogRecord:
    record = _LOG_DEC.decode(raw)
    if len(record.blocks) != len(record.hashes):
        raise ValueError("engine_log record: blocks and hashes differ in length")
    return record


class Ids(dict[int, None]):
    """Block ids in the order they were first added (a set that keeps order): a flush logs its
    changed blocks in this order, so a restart replays the blocks in the order they were stored,
    which is the order the index's bounds drop them in (oldest first)."""

    __slots__ = ()

    def add(self, bid: int) -> None:
        self[bid] = None

    def extend(self, bids: Iterable[int]) -> None:
        self.update(dict.fromkeys(bids))


#: Stores of blocks new to a source, as made: ``(ids, blocks)`` (:attr:`SourceState.fresh`).
Fresh = list[tuple[list[int], list[EngineBlock]]]
#: What a flush persisted, which may migrate (kvcm.engines.compacted): changed ids, fresh stores.
Candidates = tuple[list[int], Fresh]


@dataclass
class SourceState:
    """Index-side state of one source (its connection state lives in the subscriber)."""

    spec: SourceSpec
    number: int  # fixed-width id used in persisted keys
    generation: int
    last_seq: int = -1
    last_ts: float = 0.0
    last_event_time: float = 0.0
    blocks: dict[int, EngineBlock] = field(default_factory=dict)  # by block_id(group, engine hash)
    groups: dict[int, GroupInfo] = field(default_factory=dict)  # what its stores said of each group
    dirty: Ids = field(default_factory=Ids)  # block ids changed since the last flush, in order
    #: stores of blocks new to the source since the last flush, as made: ``(ids, blocks)``,
    #: persisted without a lookup each. They stay the blocks' current records until a block
    #: is removed, so every other change first moves their ids into ``dirty`` (:meth:`spill`).
    fresh: Fresh = field(default_factory=list)
    cleared: bool = False
    serial: int = 0  # of the source's next engine_log record
    logged: int = 0  # entries its persisted records hold (live, superseded and tombstones)
    #: its blocks, each weighing its kvcm keys (at least 1): what the index's bounds count
    #: (:func:`weight`), kept as blocks come and go
    size: int = 0
    evicted: int = 0  # blocks dropped to keep the index within its bounds, since start-up
    #: its common blocks moved out of ``blocks`` at a flush (kvcm.engines.compacted), or None
    compact: Any = None

    def spill(self) -> None:
        """Move the fresh stores' ids into ``dirty`` (before a change that may drop a block)."""
        for ids, _ in self.fresh:
            self.dirty.extend(ids)
        self.fresh.clear()

    def record(self) -> bytes:
        return ENC.encode(
            {
                "spec": self.spec.to_dict(),
                "number": self.number,
                "last_seq": self.last_seq,
                "last_ts": self.last_ts,
                "groups": [group_record(g, info) for g, info in self.groups.items()],
            }
        )


#: Counts by name (events per type, errors per kind).
Tally = defaultdict[str, int]


class ApplyStats:
    """What one batch did: events processed per type, errors per kind, block events applied.
    A plain class of two ``defaultdict`` rather than a dataclass of two ``Counter``: one is
    made for every applied batch, and a ``Counter``'s Python-level constructor cost more than
    applying a small batch's bookkeeping."""

    __slots__ = ("blocks", "errors", "processed")

    def __init__(self) -> None:
        self.processed: Tally = defaultdict(int)
        self.errors: Tally = defaultdict(int)
        self.blocks = 0


Item = tuple[str, int, int, DecodedBatch]  # source_id, generation, seq, batch


class NullTxn:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def new_block(lora: str, states: list[int], i: int, size: int, pos: int, step: int, block_size: int) -> EngineBlock:
    """Engine block ``i`` of a store event: its end state, end position and the kvcm keys whose
    blocks end inside it (one when sizes are equal, ``size/step`` or 0-1 when re-chunked)."""
    per_block = size // step
    first = i * per_block
    last = states[first + per_block - 1]
    if per_block == 1 and step == block_size:
        keys: tuple[int, ...] = (last,)
    else:
        keys = tuple(states[j] for j in range(first, first + per_block) if (pos + (j + 1) * step) % block_size == 0)
    return EngineBlock(lora, last, pos + (i + 1) * size, keys)


def flush_source(
    txn: WriteTxn,
    state: SourceState,
    migrated: Callable[[], list[tuple[int, EngineBlock]]] | None = None,
    migrated_n: int = 0,
) -> int:
    """Persist the source's changed blocks and its record; returns the records written.

    Appends one log record (per :data:`CHUNK` entries) of the changed blocks, or rewrites the
    source as its live blocks when it was cleared or its log outgrew them (module docstring).
    C-level iteration over the blocks (map, one encode call per record), no Python step each."""
    written = 0
    changed = len(state.dirty) + sum(len(ids) for ids, _ in state.fresh)
    if state.cleared or state.logged + changed > 2 * (len(state.blocks) + migrated_n) + COMPACT_SLACK:
        written += delete_blocks(txn, state.number)
        state.cleared = False
        state.serial = state.logged = 0
        ids: list[int] = []
        found: list[EngineBlock | None] = []
        for bid, blk in migrated() if migrated is not None else ():  # the oldest: replayed first
            ids.append(bid)
            found.append(blk)
        ids += list(state.blocks)
        found += list(state.blocks.values())
    else:  # the changed blocks as they are now (tombstones for the gone), then the fresh stores
        ids = list(state.dirty)
        found = list(map(state.blocks.get, ids))
        for fresh_ids, made in state.fresh:
            ids += fresh_ids
            found += made
    for lo in range(0, len(ids), CHUNK):
        txn.put(
            LOG_DB, LOG_KEY.pack(state.number, state.serial), encode_log(ids[lo : lo + CHUNK], found[lo : lo + CHUNK])
        )
        state.serial += 1
        written += 1
    state.logged += len(ids)
    txn.put(SOURCES_DB, state.spec.source_id.encode(), state.record())
    state.dirty.clear()
    state.fresh.clear()
    return written + 1


def encode_log(ids: list[int], blocks: list[EngineBlock | None]) -> bytes:
    """One ``engine_log`` record: ids below 2**64 (group 0) go as they are, others split."""
    if not ids or max(ids) <= M64:
        return ENC.encode((ids, (), blocks))
    return ENC.encode((list(map(and_, ids, repeat(M64))), list(map(rshift, ids, repeat(64))), blocks))


def delete_blocks(txn: WriteTxn, number: int) -> int:
    """Delete every persisted record of the source's blocks (log and older per-block ones)."""
    deleted = 0
    for db in (BLOCKS_DB, LOG_DB):
        keys = [k for k, _ in txn.scan(db, prefix=SID.pack(number))]
        if keys:
            deleted += txn.delete_many(db, keys)
    return deleted
