"""Engine-index records: one engine block, one source's state, their persisted form.

Persisted layout (sub-databases reserved in ``kvcm.store.base.DATABASES``):

* ``engine_sources``: ``source_id`` (UTF-8) -> msgpack ``{spec, number, last_seq, last_ts, groups}``;
* ``engine_blocks``: ``number (u32) | group (u32) | engine hash (u64)``, big-endian, ->
  msgpack ``[lora, end state, end position, kvcm keys, {medium: holdings}]``.

``number`` is a small per-source integer so a source's blocks form one ordered key range
(cleared with one prefix scan).
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass, field
from itertools import repeat
from operator import and_, or_, rshift
from typing import Any, Literal

import msgspec

from kvcm.engines.hashing import to_signed
from kvcm.engines.sources import SourceSpec
from kvcm.kv_events import DecodedBatch

SOURCES_DB = "engine_sources"
BLOCKS_DB = "engine_blocks"
BLOCK_KEY = struct.Struct(">IIQ")  # source number, group, engine hash
SID = struct.Struct(">I")
TWO64 = 1 << 64
TOP = 1 << 63
M64 = TWO64 - 1
ENC = msgspec.msgpack.Encoder()
DEC = msgspec.msgpack.Decoder()
_BIG: Literal["big"] = "big"


def block_id(group: int, h: int) -> int:
    """A block's key in ``SourceState.blocks``: its group and engine hash in one int (not a
    tuple: ints are not tracked by the garbage collector, and group 0's ids are the hashes)."""
    return group << 64 | h


def normalize_medium(medium: str | None) -> str:
    """``None`` is the GPU block pool; spellings are upper-cased (LMCache sent ``cpu``)."""
    return "GPU" if not medium else medium.upper()


class SourceMatch(msgspec.Struct, gc=False):
    """One ``match_engines`` entry: a source and its matched prefix per medium."""

    source_id: str
    dp_rank: int
    matched_blocks: int
    media: dict[str, int]


class EngineBlock(msgspec.Struct, array_like=True, gc=False):
    """One engine block of one source: its kvcm keys, chain end state, and holdings per medium.

    A Struct without GC tracking (it holds no references that could form a cycle): the index
    keeps one per engine block, and as tracked objects their collection cost more than building
    them. Encoded as the array ``[lora, end, pos, keys, refs]`` (the persisted record).
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
    groups: dict[int, str | None] = field(default_factory=dict)
    dirty: set[int] = field(default_factory=set)  # block ids changed since the last flush
    cleared: bool = False

    def record(self) -> bytes:
        return ENC.encode(
            {
                "spec": self.spec.to_dict(),
                "number": self.number,
                "last_seq": self.last_seq,
                "last_ts": self.last_ts,
                "groups": [[g, k] for g, k in self.groups.items()],
            }
        )


@dataclass
class ApplyStats:
    """What one batch did: events processed per type, errors per kind, block events applied."""

    processed: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    blocks: int = 0


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
        keys: tuple[int, ...] = (last - TWO64 if last >= TOP else last,)
    else:
        keys = tuple(
            to_signed(states[j]) for j in range(first, first + per_block) if (pos + (j + 1) * step) % block_size == 0
        )
    return EngineBlock(lora, last, pos + (i + 1) * size, keys)


def flush_source(txn: Any, state: SourceState) -> int:
    """Write the source's changed blocks and its record. C-level iteration over the dirty
    blocks (key packing, record encoding and the sort run in map/zip/sorted), not a Python
    step each: this is most of the engine tier's persisting."""
    if state.cleared:
        delete_blocks(txn, state.number)
        state.cleared = False
    # In block id order, which is the packed keys' order: B-tree inserts in key order touch each
    # page once, and sorting the ints is cheaper than sorting the packed pairs.
    ids = sorted(state.dirty)
    keys = block_keys(state.number, ids)
    found = list(map(state.blocks.get, ids))
    dels: list[bytes] = []
    if None in found:  # removed blocks: their records go
        dels = [k for k, blk in zip(keys, found) if blk is None]
        kept = [(k, blk) for k, blk in zip(keys, found) if blk is not None]
        keys, found = [k for k, _ in kept], [blk for _, blk in kept]
    txn.put_many(BLOCKS_DB, zip(keys, map(ENC.encode, found)))  # consumed in C, no list of pairs
    if dels:
        txn.delete_many(BLOCKS_DB, dels)
    txn.put(SOURCES_DB, state.spec.source_id.encode(), state.record())
    state.dirty.clear()
    return len(keys) + len(dels) + 1


def block_keys(number: int, ids: list[int]) -> list[bytes]:
    """Persisted keys of the sorted block ``ids``: ``number | id`` as one 16-byte big-endian int
    is exactly ``BLOCK_KEY.pack(number, group, hash)``, and one ``to_bytes`` per block costs a
    third of the three-field pack. Ids outside ``[0, 2**96)`` (a group that does not fit its
    u32) go through the pack, which refuses them as it always did."""
    if not ids or ids[0] < 0 or ids[-1] >> 96:
        return list(map(BLOCK_KEY.pack, repeat(number), map(rshift, ids, repeat(64)), map(and_, ids, repeat(M64))))
    return list(map(int.to_bytes, map(or_, repeat(number << 96), ids), repeat(16), repeat(_BIG)))


def delete_blocks(txn: Any, number: int) -> None:
    keys = [k for k, _ in txn.scan(BLOCKS_DB, prefix=SID.pack(number))]
    if keys:
        txn.delete_many(BLOCKS_DB, keys)
