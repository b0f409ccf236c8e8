"""The vLLM / SGLang KV-cache event codec: ``KVEventBatch`` payloads in every shape seen on the wire.

A PUB message is ``[topic, seq (8 bytes big-endian), payload]``; this module handles the payload.
Three shapes exist:

* ``map``    — batch ``{ts, events, data_parallel_rank}``, each event a map tagged by ``"type"``,
  fields at their default omitted (current vLLM main);
* ``array``  — batch ``[ts, events, dp_rank?]``, each event an array whose element 0 is the tag,
  every field positional (vLLM before PR #42892, SGLang, AIBrix's encoder);
* ``mixed``  — an array batch carrying map-tagged events (vLLM v0.26).

A well-formed batch decodes in one typed pass. Otherwise each event is decoded on its own (the
batch is split into ``msgspec.Raw`` pieces): one unknown tag or malformed event is reported in
:attr:`DecodedBatch.errors` and skipped, never the whole batch. Unknown map keys and extra
trailing array elements are ignored, missing optional fields default to ``None``, so older
(5-element) and newer engines both decode.

Block hashes are kept as sent (``int`` up to 2**64-1, negative SGLang int64, or ``bytes``);
:func:`hash_to_u64` is the one normalisation consumers use (vLLM's own int mode: the last 8 bytes).

With ``packed_tokens=True`` (the compiled block hash is loaded) a store's ``token_ids`` stay their
msgpack bytes (:class:`PackedTokens`), which the kernel reads directly: making and freeing a
thousand Python ints per 64-block store cost as much as the rest of its decoding.

Payloads are untrusted (any pod can publish): msgspec is used with typed schemas and every error,
including ``RecursionError``, surfaces as :class:`EventDecodeError` or as a per-event error kind.
A batch whose ``ts`` is not a finite number is not a batch (consumers compare and persist it).
:func:`count_events` reads how many events a payload holds from its array header, skipping the
events at C speed without making an object of any, so a payload's work can be costed before it
is decoded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeAlias

import msgspec

ExternalBlockHash: TypeAlias = int | bytes
Encoding = Literal["map", "array", "mixed"]
ENCODINGS: tuple[str, ...] = ("map", "array", "mixed")

_M64 = (1 << 64) - 1

#: Error kinds reported per event in :attr:`DecodedBatch.errors`.
UNKNOWN_EVENT = "unknown_event"
BAD_EVENT = "bad_event"


class EventDecodeError(ValueError):
    """The payload is not a KVEventBatch at all (the whole message is skipped and counted); or,
    read from :class:`PackedTokens`, a store's token ids are not ids (the store is refused)."""


class PackedTokens(Sequence[int]):
    """A store's ``token_ids`` as the msgpack arrays they came in (``raws``, each the bytes of
    one array), decoded to Python ints only if read as a sequence. The compiled hash
    (:mod:`kvcm.cache.hash_kernel`) reads ``raws`` instead. ``len`` comes from the array headers.
    Their elements are checked when read: reading ids that are not ints raises
    :class:`EventDecodeError` (the engine index refuses that store: ``bad_token_ids``)."""

    __slots__ = ("_ids", "_n", "raws")

    def __init__(self, raws: tuple[Any, ...], n: int) -> None:
        self.raws = raws
        self._n = n
        self._ids: list[int] | None = None

    @classmethod
    def of(cls, raw: Any) -> PackedTokens:
        """The tokens of one msgpack array; ValueError if ``raw`` is not an array."""
        data = memoryview(raw)
        first = data[0] if len(data) else -1
        if 0x90 <= first <= 0x9F:
            return cls((raw,), first & 0x0F)
        width = 2 if first == 0xDC else 4 if first == 0xDD else 0
        if not width or len(data) < 1 + width:
            raise ValueError("token_ids is not an array")
        return cls((raw,), int.from_bytes(data[1 : 1 + width], "big"))

    def joined(self, other: PackedTokens) -> PackedTokens:
        """These tokens followed by ``other``'s (their arrays are shared, not copied)."""
        return PackedTokens(self.raws + other.raws, self._n + other._n)

    @property
    def ids(self) -> list[int]:
        if self._ids is None:
            try:
                ids = [t for raw in self.raws for t in _TOKEN_IDS(raw)] if len(self.raws) > 1 else _TOKEN_IDS(self.raws[0])
            except (msgspec.DecodeError, RecursionError) as exc:
                raise EventDecodeError(f"token_ids: {exc}") from None
            self._ids = ids
        return self._ids

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        return self.ids[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedTokens):
            return self.ids == other.ids
        return self.ids == other if isinstance(other, list) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a sequence that compares equal to a list

    def __repr__(self) -> str:
        return f"PackedTokens({self._n} ids in {sum(len(memoryview(r)) for r in self.raws)} bytes)"


# --- decoded events (what consumers see) ------------------------------------------------------


#: A KV-cache group index: an engine's groups are few, and the engine index keys blocks by it in
#: 32 bits. One out of range is a broken event (dropped and counted like any other), never a
#: value that would make every later persist of the index fail.
GroupIdx = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class BlockStored(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Consecutive full blocks of one request; block *i*'s parent is block *i-1*."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None = None
    token_ids: Sequence[int] = []  # a list, or PackedTokens (decode_batch(..., packed_tokens=True))
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    #: per block, None or what vLLM mixed into its hash (kept as decoded; kvcm.proto.extra_keys
    #: canonicalises, bounds and digests it when the store is applied)
    extra_keys: list[Any] | None = None
    group_idx: GroupIdx | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Blocks evicted from one medium of the publishing engine."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: GroupIdx | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The engine dropped its whole prefix cache (every medium, every group)."""


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


# The map-shaped twins share field names with the array-shaped classes above; msgspec needs one
# Struct per layout, so decoding goes through these and is converted (cheaply, field by field).
class _BlockStoredMap(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: GroupIdx | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _BlockRemovedMap(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: GroupIdx | None = None


class _AllBlocksClearedMap(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


# The well-formed batch of one shape, decoded in one pass (no split into pieces, no skipping
# over each event to find where it ends); any failure falls back to the per-event path.
class _ArrayEvents(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _MixedEvents(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_BlockStoredMap | _BlockRemovedMap | _AllBlocksClearedMap]
    data_parallel_rank: int | None = None


class _MapEvents(msgspec.Struct, gc=False):
    ts: float
    events: list[_BlockStoredMap | _BlockRemovedMap | _AllBlocksClearedMap]
    data_parallel_rank: int | None = None


def _twin(base: type[msgspec.Struct], changed: dict[str, tuple[Any, Any]], **options: Any) -> Any:
    """``base`` with some fields ``changed`` (name -> type, default), for ``packed_tokens``."""
    fields = [(f.name, *changed.get(f.name, (f.type, f.default))) for f in msgspec.structs.fields(base)]
    return msgspec.defstruct(f"_Packed{base.__name__.lstrip('_')}", fields, gc=False, **options)


# The packed twins of the one-pass batches: a store's token_ids stay raw (an empty array if absent).
_RAW_TOKENS = {"token_ids": (msgspec.Raw, msgspec.Raw(b"\x90"))}
_PackedStored = _twin(BlockStored, _RAW_TOKENS, tag="BlockStored", array_like=True)
_PackedStoredMap = _twin(_BlockStoredMap, _RAW_TOKENS, tag="BlockStored", tag_field="type")
_PACKED_STORED = (_PackedStored, _PackedStoredMap)
_PackedArrayEvent: TypeAlias = _PackedStored | BlockRemoved | AllBlocksCleared  # type: ignore[valid-type]
_PackedMapEvent: TypeAlias = _PackedStoredMap | _BlockRemovedMap | _AllBlocksClearedMap  # type: ignore[valid-type]
_PACKED_ARRAY_EVENTS = {"events": (list[_PackedArrayEvent], msgspec.NODEFAULT)}
_PACKED_MAP_EVENTS = {"events": (list[_PackedMapEvent], msgspec.NODEFAULT)}

_WHOLE_MIXED = msgspec.msgpack.Decoder(_MixedEvents).decode
_WHOLE_ARRAY = msgspec.msgpack.Decoder(_ArrayEvents).decode
_WHOLE_MAP = msgspec.msgpack.Decoder(_MapEvents).decode
_PACKED_MIXED = msgspec.msgpack.Decoder(_twin(_MixedEvents, _PACKED_MAP_EVENTS, array_like=True)).decode
_PACKED_ARRAY = msgspec.msgpack.Decoder(_twin(_ArrayEvents, _PACKED_ARRAY_EVENTS, array_like=True)).decode
_PACKED_MAP = msgspec.msgpack.Decoder(_twin(_MapEvents, _PACKED_MAP_EVENTS)).decode
_TOKEN_IDS = msgspec.msgpack.Decoder(list[int]).decode
_ARRAY_BATCH = msgspec.msgpack.Decoder(_ArrayBatch)
_MAP_BATCH = msgspec.msgpack.Decoder(_MapBatch)
_ARRAY_EVENT = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)
_MAP_EVENT = msgspec.msgpack.Decoder(_BlockStoredMap | _BlockRemovedMap | _AllBlocksClearedMap)
_ANY = msgspec.msgpack.Decoder()
_ENCODER = msgspec.msgpack.Encoder(enc_hook=lambda obj: _encodable(obj))
_KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


@dataclass
class DecodedBatch:
    """One decoded ``KVEventBatch``: the events that decoded, and an error kind per one that did not."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    errors: list[str] = field(default_factory=list)
    shape: str = "array"


def decode_batch(payload: bytes, packed_tokens: bool = False) -> DecodedBatch:
    """Decode one payload; raises :class:`EventDecodeError` only if it is not a batch at all.
    ``packed_tokens``: the stores of a well-formed batch keep their ``token_ids`` as
    :class:`PackedTokens` (a batch that needs the per-event path decodes them as lists)."""
    whole = _decode_whole(payload, packed_tokens)
    if whole is not None:
        _check_ts(whole.ts)
        return whole
    batch, shape = _decode_envelope(payload)
    _check_ts(batch.ts)
    events: list[Event] = []
    errors: list[str] = []
    for raw in batch.events:
        event = _decode_event(raw)
        if isinstance(event, str):
            errors.append(event)
        else:
            events.append(event)
    return DecodedBatch(batch.ts, events, batch.data_parallel_rank, errors, shape)


def _check_ts(ts: float) -> None:
    if not math.isfinite(ts):
        raise EventDecodeError(f"not a KVEventBatch: ts is {ts}, not a finite number")


class _ArrayHead(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: msgspec.Raw


class _MapHead(msgspec.Struct, gc=False):
    events: msgspec.Raw


_ARRAY_HEAD = msgspec.msgpack.Decoder(_ArrayHead).decode
_MAP_HEAD = msgspec.msgpack.Decoder(_MapHead).decode


def count_events(payload: bytes) -> int:
    """How many events the payload's batch holds, from the header of its ``events`` array; the
    events are skipped, not decoded. 0 for a payload that is not a batch (its decode fails
    alike, at no cost per event)."""
    data = memoryview(payload)
    found = _count_in_place(data)
    if found is not None:
        return found
    try:  # another layout (keys in another order, say): msgspec skips to the events, in C
        head = _MAP_HEAD(data) if len(data) and _is_map_header(data[0]) else _ARRAY_HEAD(data)
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError):
        return 0
    return _array_length(memoryview(head.events), 0) or 0


#: Bytes of a msgpack number by its first byte (floats and the sized ints; fixints are 1).
_NUMBER_WIDTH = {0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}


def _count_in_place(data: memoryview) -> int | None:
    """The events' count for the layouts engines send, ``[ts, events, ...]`` and ``{"ts": ts,
    "events": ...}`` in that order, read from fixed places (no skipping); None for another."""
    if not len(data):
        return None
    first = data[0]
    if 0x80 <= first <= 0x8F:  # a map: "ts" first, then "events"
        if data[1:4].tobytes() != b"\xa2ts":
            return None
        at, key = 4, b"\xa6events"
    else:
        at = 1 if 0x90 <= first <= 0x9F else 3 if first == 0xDC else 5 if first == 0xDD else 0
        key = b""
        if not at:
            return None
    width = _NUMBER_WIDTH.get(data[at], 1 if data[at] <= 0x7F or data[at] >= 0xE0 else 0) if at < len(data) else 0
    at += width
    if not width or data[at : at + len(key)].tobytes() != key:
        return None
    return _array_length(data, at + len(key))


def _array_length(data: memoryview, at: int) -> int | None:
    """The length in the msgpack array header at ``at``; None if there is none."""
    if at >= len(data):
        return None
    head = data[at]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    width = 2 if head == 0xDC else 4 if head == 0xDD else 0
    if not width or len(data) < at + 1 + width:
        return None
    return int.from_bytes(data[at + 1 : at + 1 + width], "big")


def _decode_whole(payload: bytes, packed: bool = False) -> DecodedBatch | None:
    """The batch if it decodes in one pass (every event well formed), else None."""
    first = payload[:1]
    mixed, array, whole_map = (_PACKED_MIXED, _PACKED_ARRAY, _PACKED_MAP) if packed else (_WHOLE_MIXED, _WHOLE_ARRAY, _WHOLE_MAP)
    try:
        if first and _is_map_header(first[0]):
            whole = whole_map(payload)
            shape = "map"
        else:
            shape = "array"
            try:
                whole = mixed(payload)
            except msgspec.ValidationError:  # positional events: the other array shape
                whole = array(payload)
        if packed:
            return DecodedBatch(whole.ts, [_from_packed(ev) for ev in whole.events], whole.data_parallel_rank, [], shape)
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError):
        return None
    if isinstance(whole, _ArrayEvents):
        return DecodedBatch(whole.ts, whole.events, whole.data_parallel_rank, [], shape)
    return DecodedBatch(whole.ts, [_from_map(ev) for ev in whole.events], whole.data_parallel_rank, [], shape)


def _decode_envelope(payload: bytes) -> tuple[_ArrayBatch | _MapBatch, str]:
    first = payload[:1]
    try:
        if first and _is_map_header(first[0]):
            return _MAP_BATCH.decode(payload), "map"
        return _ARRAY_BATCH.decode(payload), "array"
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError) as exc:
        raise EventDecodeError(f"not a KVEventBatch: {exc}") from None


def _is_map_header(b: int) -> bool:
    return 0x80 <= b <= 0x8F or b in (0xDE, 0xDF)


def _decode_event(raw: msgspec.Raw) -> Event | str:
    """The event, or the error kind if it cannot be decoded."""
    data = memoryview(raw)  # Raw supports the buffer protocol: no copy
    try:
        if len(data) and _is_map_header(data[0]):
            return _from_map(_MAP_EVENT.decode(data))
        event: Event = _ARRAY_EVENT.decode(data)
        return event
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError):
        return _classify_failure(data)


def _from_map(ev: _BlockStoredMap | _BlockRemovedMap | _AllBlocksClearedMap) -> Event:
    if type(ev) is _BlockStoredMap:
        return _stored(ev, ev.token_ids)
    if type(ev) is _BlockRemovedMap:
        return BlockRemoved(ev.block_hashes, ev.medium, ev.group_idx)
    return AllBlocksCleared()


def _from_packed(ev: Any) -> Event:
    """An event of a ``packed_tokens`` decode; ValueError if a store's token_ids is no array."""
    if type(ev) in _PACKED_STORED:
        return _stored(ev, PackedTokens.of(ev.token_ids))
    return ev if type(ev) in (BlockRemoved, AllBlocksCleared) else _from_map(ev)


def _stored(ev: Any, tokens: Sequence[int]) -> BlockStored:
    return BlockStored(ev.block_hashes, ev.parent_block_hash, tokens, ev.block_size, ev.lora_id, ev.medium,
                       ev.lora_name, ev.extra_keys, ev.group_idx, ev.kv_cache_spec_kind,
                       ev.kv_cache_spec_sliding_window)  # fmt: skip


def _encodable(obj: Any) -> Any:
    """PackedTokens encode as the arrays they came in (one) or as their ids."""
    if isinstance(obj, PackedTokens):
        if len(obj.raws) > 1:
            return obj.ids
        raw = obj.raws[0]
        return raw if isinstance(raw, msgspec.Raw) else msgspec.Raw(raw)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")  # msgspec: "not a type I know"


def _classify_failure(data: Any) -> str:
    """Tell an unknown tag (a newer engine) from a broken event, for the error metric."""
    try:
        obj = _ANY.decode(data)
    except Exception:  # noqa: BLE001 - any failure here just means "broken"
        return BAD_EVENT
    if isinstance(obj, dict):
        tag = obj.get("type")
    elif isinstance(obj, list) and obj:
        tag = obj[0]
    else:
        return BAD_EVENT
    return UNKNOWN_EVENT if isinstance(tag, str) and tag not in _KNOWN_TAGS else BAD_EVENT


def hash_to_u64(h: ExternalBlockHash) -> int:
    """Normalise an engine block hash to an unsigned 64-bit int.

    Ints are masked (SGLang sends signed int64); bytes keep their **last** 8 bytes, big-endian,
    which is exactly what vLLM itself sends in its default int mode, so a source switching
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` keeps the same identities.
    """
    if type(h) is int:
        return h & _M64
    if isinstance(h, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(h)[-8:], "big")
    raise TypeError(f"block hash must be int or bytes, got {type(h).__name__}")


# --- encoder ----------------------------------------------------------------------------------


def encode_batch(
    events: Sequence[Event],
    ts: float,
    data_parallel_rank: int | None = None,
    encoding: str = "map",
    extras: Sequence[dict[str, Any] | None] | None = None,
) -> bytes:
    """Encode a batch in one of :data:`ENCODINGS`, byte-compatible with vLLM's own encoder.

    ``map``: map batch (``data_parallel_rank`` omitted when ``None``) + map events;
    ``array``: array batch + positional events; ``mixed``: array batch + map events.
    ``extras``: per event, additional map fields (map shapes only; consumers ignore unknown keys).
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}, expected one of {ENCODINGS}")
    as_map = encoding != "array"
    body: list[Any] = [_event_map(e) if as_map else _event_array(e) for e in events]
    if extras is not None and as_map:
        for item, extra in zip(body, extras):
            if extra:
                item.update(extra)
    if encoding == "map":
        batch: Any = {"ts": float(ts), "events": body}
        if data_parallel_rank is not None:
            batch["data_parallel_rank"] = data_parallel_rank
    else:
        batch = [float(ts), body, data_parallel_rank]
    return _ENCODER.encode(batch)


_OPTIONAL_STORED = ("extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")


def _event_map(e: Event) -> dict[str, Any]:
    if type(e) is BlockStored:
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": e.block_hashes,
            "parent_block_hash": e.parent_block_hash,
            "token_ids": e.token_ids,
            "block_size": e.block_size,
            "lora_id": e.lora_id,
            "medium": e.medium,
            "lora_name": e.lora_name,
        }
        # vLLM's structs have no default for the fields above, but omit these when None.
        for name in _OPTIONAL_STORED:
            value = getattr(e, name)
            if value is not None:
                out[name] = value
        return out
    if type(e) is BlockRemoved:
        out = {"type": "BlockRemoved", "block_hashes": e.block_hashes, "medium": e.medium}
        if e.group_idx is not None:
            out["group_idx"] = e.group_idx
        return out
    return {"type": "AllBlocksCleared"}


def _event_array(e: Event) -> list[Any]:
    if type(e) is BlockStored:
        out = [
            "BlockStored", e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size,
            e.lora_id, e.medium, e.lora_name, e.extra_keys, e.group_idx,
        ]  # fmt: skip
        # Positions 10-11 (spec kind, window) exist only in builds that know them; the
        # golden legacy payloads stop at group_idx, so emit them only when set.
        if e.kv_cache_spec_kind is not None or e.kv_cache_spec_sliding_window is not None:
            out += [e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window]
        return out
    if type(e) is BlockRemoved:
        return ["BlockRemoved", e.block_hashes, e.medium, e.group_idx]
    return ["AllBlocksCleared"]


def event_to_meaning(e: Event) -> dict[str, Any]:
    """A JSON-able view of an event (hashes as ``{"int": n}`` / ``{"bytes_hex": s}``), as in
    ``data/vllm_events/golden.jsonl`` and ``kvcm events record``."""
    out: dict[str, Any] = {"type": type(e).__name__}
    for name in e.__struct_fields__:
        value = getattr(e, name)
        if name == "block_hashes":
            value = [_hash_meaning(h) for h in value]
        elif name == "parent_block_hash" and value is not None:
            value = _hash_meaning(value)
        out[name] = value
    return out


def _hash_meaning(h: ExternalBlockHash) -> dict[str, Any]:
    return {"bytes_hex": h.hex()} if isinstance(h, bytes) else {"int": h}
