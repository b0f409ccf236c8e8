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
from typing import Any

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


def normalize_medium(medium: str | None) -> str:
    """``None`` is the GPU block pool; spellings are upper-cased (LMCache sent ``cpu``)."""
    return "GPU" if not medium else medium.upper()


class SourceMatch(msgspec.Struct, gc=False):
    """One ``match_engines`` entry: a source and its matched prefix per medium."""

    source_id: str
    dp_rank: int
    matched_blocks: int
    media: dict[str, int]


class EngineBlock:
    """One engine block of one source: its kvcm keys, chain end state, and holdings per medium."""

    __slots__ = ("end", "keys", "lora", "pos", "refs")

    def __init__(self, lora: str, end: int, pos: int, keys: tuple[int, ...]) -> None:
        self.lora = lora
        self.end = end
        self.pos = pos
        self.keys = keys
        self.refs: dict[str, int] = {}

    def pack(self) -> bytes:
        return ENC.encode((self.lora, self.end, self.pos, self.keys, self.refs))

    @classmethod
    def unpack(cls, raw: bytes) -> EngineBlock:
        lora, end, pos, keys, refs = DEC.decode(raw)
        blk = cls(lora, end, pos, tuple(keys))
        blk.refs = dict(refs)
        return blk


@dataclass
class SourceState:
    """Index-side state of one source (its connection state lives in the subscriber)."""

    spec: SourceSpec
    number: int  # fixed-width id used in persisted keys
    generation: int
    last_seq: int = -1
    last_ts: float = 0.0
    last_event_time: float = 0.0
    blocks: dict[tuple[int, int], EngineBlock] = field(default_factory=dict)
    groups: dict[int, str | None] = field(default_factory=dict)
    dirty: set[tuple[int, int]] = field(default_factory=set)
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
    if state.cleared:
        delete_blocks(txn, state.number)
        state.cleared = False
    puts, dels = [], []
    pack_key, encode, number, blocks = BLOCK_KEY.pack, ENC.encode, state.number, state.blocks
    for dirty in state.dirty:
        key = pack_key(number, *dirty)
        blk = blocks.get(dirty)
        if blk is None:
            dels.append(key)
        else:
            puts.append((key, encode((blk.lora, blk.end, blk.pos, blk.keys, blk.refs))))
    puts.sort()  # B-tree inserts in key order touch each page once
    txn.put_many(BLOCKS_DB, puts)
    if dels:
        txn.delete_many(BLOCKS_DB, dels)
    txn.put(SOURCES_DB, state.spec.source_id.encode(), state.record())
    state.dirty.clear()
    return len(puts) + len(dels) + 1


def delete_blocks(txn: Any, number: int) -> None:
    keys = [k for k, _ in txn.scan(BLOCKS_DB, prefix=SID.pack(number))]
    if keys:
        txn.delete_many(BLOCKS_DB, keys)
