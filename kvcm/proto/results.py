"""Typed replies of the kvcm RPCs, for :class:`kvcm.Client` and :class:`kvcm.aio.Client`.

One ``msgspec.Struct`` per reply shape; field names are the wire names (docs/rpc.md). The
client decodes a reply's bytes straight into these (no intermediate dicts), with one cached
decoder per reply type (:func:`decoder`).

The structs are ``gc=False``: a reply is a tree of strings, numbers and lists that never
holds a cycle, and leaving its thousands of small objects out of the cycle collector's counts
is a good part of why decoding one costs less than building the same reply as dicts.

Replies are read leniently on purpose: a field the server adds later is skipped, never an
error (``forbid_unknown_fields`` stays off). Strictness is the server's rule, for requests.
Fields that only some replies carry (``get_cache_meta`` details by ``detail_level``, for one)
default to ``None``. ``msgspec.to_builtins(result)`` gives the plain map back.

:class:`Mask` is also what the typed methods take for ``block_mask`` and ``success_blocks``.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec

from kvcm.proto.locations import CompactLocations, LazyLocations, Location, LocationSpec
from kvcm.proto.wire import refuse_ext

T = TypeVar("T")


class Mask(msgspec.Struct, omit_defaults=True, gc=False):
    """A block mask: ``Mask(offset=n)`` (the first n keys) or ``Mask(bool_masks=[...])``."""

    offset: int | None = None
    bool_masks: list[bool] | None = None


class CacheLocations(msgspec.Struct, omit_defaults=True, gc=False):
    """``get_cache_location``: ``locations`` (the matched prefix for ``prefix_match``, one per
    key otherwise); ``engine_locations`` only with ``include_engines``.

    A compact reply (``reply_format="compact"``, what the typed clients ask for) arrives in
    ``compact`` and is read lazily: ``locations`` is then a :class:`LazyLocations` (``len()``
    free, :meth:`uri` without building a location, iteration building them on first use) and
    ``compact`` is cleared, so the result compares equal to the classic one.
    ``msgspec.to_builtins(result, enc_hook=kvcm.proto.locations.builtins)`` gives the classic map."""

    locations: Sequence[Location] = ()
    engine_locations: list[object] | None = None
    compact: CompactLocations | None = None

    def __post_init__(self) -> None:
        if self.compact is not None:
            self.locations = LazyLocations(self.compact)
            self.compact = None

    def uri(self, block: int, spec: str) -> str:
        """The URI of ``block``'s spec named ``spec`` (KeyError when it has none)."""
        locations = self.locations
        if isinstance(locations, LazyLocations):
            return locations.uri(block, spec)
        for s in locations[block].location_specs:
            if s.name == spec:
                return s.uri
        raise KeyError(spec)


class CacheLocationLen(msgspec.Struct, gc=False):
    """``get_cache_location_len``: how many locations ``get_cache_location`` would answer."""

    cache_location_len: int


class BlockMeta(msgspec.Struct, gc=False):
    """One key of ``get_cache_meta``; the fields past ``id`` come with ``detail_level >= 1``,
    ``all`` with ``detail_level = 2``."""

    key: int
    status: str
    id: str | None = None
    storage: str | None = None
    type: str | None = None
    nbytes: int | None = None
    created: float | None = None
    written: float | None = None
    updated: float | None = None
    parent: int | None = None
    location_count: int | None = None
    all: list[dict[str, object]] | None = None


class CacheMeta(msgspec.Struct, gc=False):
    locations: list[Location]
    metas: list[BlockMeta]


class WriteSession(msgspec.Struct, gc=False):
    """``start_write_cache``: ``block_mask`` marks the request keys already there; one location
    per new key, in order."""

    write_session_id: str
    block_mask: Mask
    locations: list[Location]


class WriteFinished(msgspec.Struct, gc=False):
    served: int
    failed: int


class Removed(msgspec.Struct, gc=False):
    """``remove_cache`` and ``trim_cache``: copies marked or forgotten."""

    removed: int


class Lost(msgspec.Struct, gc=False):
    lost: int


class Pinned(msgspec.Struct, gc=False):
    """``pin_cache``: distinct keys pinned and their expiry (wall-clock seconds)."""

    pinned: int
    expires_at: float


class Unpinned(msgspec.Struct, gc=False):
    unpinned: int


class StorageConfig(msgspec.Struct, gc=False):
    global_unique_name: str
    storage_type: str
    storage_spec: dict[str, Any] = {}
    enabled: bool = True
    available: bool = True
    create_time: int = 0
    update_time: int = 0
    storage_id: str = ""


class StorageSpecs(msgspec.Struct, gc=False):
    """``get_storage_specs``: the client-visible part of each storage the instance may use, in
    candidate order (``storage_spec`` holds only the fields a client needs, never credentials)."""

    storages: list[StorageConfig]


class Registered(msgspec.Struct, gc=False):
    """``register_instance``: the group's candidate storages, in order; ``created`` is false when
    the same instance was registered before."""

    storage_configs: list[StorageConfig]
    created: bool


class SpecInfo(msgspec.Struct, gc=False):
    """A location spec: bytes per block of one shard. Also accepted by ``register_instance``."""

    name: str
    size: int


class SpecGroup(msgspec.Struct, gc=False):
    name: str
    spec_names: list[str] = []


class ModelDeployment(msgspec.Struct, omit_defaults=True, gc=False):
    model_name: str = ""
    dtype: str = ""
    use_mla: bool = False
    tp_size: int = 0
    dp_size: int = 0
    lora_name: str = ""
    pp_size: int = 0
    extra: str = ""
    user_data: str = ""


class InstanceInfo(msgspec.Struct, gc=False):
    instance_id: str
    instance_group_name: str
    block_size: int
    location_spec_infos: list[SpecInfo]
    quota_group_name: str = ""
    location_spec_groups: list[SpecGroup] = []
    model_deployment: ModelDeployment = msgspec.field(default_factory=ModelDeployment)
    create_time: int = 0


class InstanceInfoReply(msgspec.Struct, gc=False):
    instance_group: str
    instance_info: InstanceInfo


class EngineGroup(msgspec.Struct, gc=False):
    """One KV-cache group of a hybrid source's ``match_engines`` entry (docs/engines.md,
    "Hybrid models"): the blocks it holds from the first on, and the longest prefix it alone
    would let the engine reuse, in the instance's blocks."""

    group_idx: int
    kind: str | None
    block_size: int
    held_blocks: int = 0
    reusable_blocks: int = 0
    window: int | None = None


class EngineMatch(msgspec.Struct, gc=False):
    """One engine source: the longest prefix of the query it holds, per medium, and its score
    (docs/routers.md)."""

    source_id: str
    dp_rank: int
    matched_blocks: int
    media: dict[str, int]
    pod: str = ""
    matched_tokens: int = 0
    media_tokens: dict[str, int] = {}
    score: float = 0.0
    speculative: bool = False  # counts blocks note_routed said are on their way (speculative_blocks of them)
    speculative_blocks: int = 0
    groups: list[EngineGroup] | None = None  # a hybrid model's KV-cache groups: why its prefix is what it is
    unsupported: str | None = None  # why a hybrid source counts as holding nothing (a group kvcm cannot reason about)


class EnginePod(msgspec.Struct, gc=False):
    """One pod of a ``match_engines`` reply: its best rank's figures and its ranks, best first."""

    pod: str
    score: float
    matched_blocks: int
    matched_tokens: int
    best_source: str
    sources: list[str]


class SourceFreshness(msgspec.Struct, gc=False):
    """How recently an engine source was heard: ``live``, ``replaying``, ``gap``, ``stale``, ``expired``."""

    state: str
    age_s: float


class EngineMatches(msgspec.Struct, gc=False):
    instance_id: str
    num_blocks: int
    sources: list[EngineMatch]
    stale_sources: int = 0  # stale sources left out (include_stale=False)
    freshness: dict[str, SourceFreshness] = {}  # every source of the instance
    num_tokens: int = 0
    pods: list[EnginePod] = []
    storage: EngineMatch | None = None  # kvcm's own storage tier as a pseudo-source (include_storage)


class Routed(msgspec.Struct, gc=False):
    """``note_routed``: the speculative entry recorded."""

    instance_id: str
    source_id: str
    num_blocks: int
    ttl_s: float


class HostCacheMatch(msgspec.Struct, gc=False):
    """One host (a pod) of ``get_host_cache_state``, in Tair KVCM's shape (docs/routers.md)."""

    host_ip_port: str
    local: int
    p2p_1_fetch: int
    p2p_1_total_match: int
    score: float = 0.0
    best_source: str = ""
    sources: list[str] = []


class HostCacheState(msgspec.Struct, gc=False):
    instance_id: str
    num_blocks: int
    hosts: list[HostCacheMatch]
    storage: int = 0  # the storage tier's prefix (include_storage)
    # the longest prefix held anywhere, as the reply's "global" (a Python keyword)
    global_: int = msgspec.field(default=0, name="global")


class EventsReported(msgspec.Struct, gc=False):
    """``report_events``: where the push source stands after the report. ``resync`` asks for a
    snapshot (a seq gap, or the source expired: its blocks may be missing or stale)."""

    source_id: str
    generation: int
    state: str  # live, gap, stale, expired; "down" after op down
    resync: bool
    last_seq: int = -1
    applied_blocks: int = 0
    duplicates: int = 0  # batches at or below last_seq, ignored
    missed: int = 0  # batches skipped by a seq gap
    errors: dict[str, int] = {}


class StorageHealth(msgspec.Struct, gc=False):
    enabled: bool
    available: bool
    unavailable_reason: str | None = None


class Health(msgspec.Struct, gc=False):
    status: str
    is_health: bool
    is_leader: bool
    uptime_s: float
    counts: dict[str, int]
    storages: dict[str, StorageHealth]
    node: dict[str, object] = {}


#: Open-ended admin replies (storages, groups, accounts, snapshots, metrics...).
AdminReply = dict[str, Any]


class Envelope(msgspec.Struct, Generic[T], array_like=True, gc=False):
    """A msgpack-RPC response ``[1, msgid, error, result]`` with a typed result."""

    kind: int
    msgid: int
    error: dict[str, object] | None
    result: T | None


class Head(msgspec.Struct, array_like=True):
    """The first two items of a response: enough to route it by msgid (the rest is skipped)."""

    kind: int
    msgid: int


_DECODERS: dict[object, msgspec.msgpack.Decoder[Envelope[Any]]] = {}


def decoder(result: type[T]) -> msgspec.msgpack.Decoder[Envelope[T]]:
    """The cached decoder of responses whose result is ``result`` (a type; ``object`` for any)."""
    dec = _DECODERS.get(result)
    if dec is None:
        # Envelope[result], built as a value (msgspec reads it as the same generic type)
        dec = _DECODERS[result] = msgspec.msgpack.Decoder(types.GenericAlias(Envelope, (result,)), ext_hook=refuse_ext)
    return dec


HEAD = msgspec.msgpack.Decoder(Head, ext_hook=refuse_ext)

__all__ = [
    "AdminReply", "BlockMeta", "CacheLocationLen", "CacheLocations", "CacheMeta", "EngineMatch", "EngineMatches", "EnginePod", "Envelope",
    "EventsReported", "Head", "Health", "HostCacheMatch", "HostCacheState", "InstanceInfo", "InstanceInfoReply",
    "LazyLocations", "Location", "LocationSpec", "Lost", "Mask", "ModelDeployment", "Pinned", "Registered", "Removed", "Routed",
    "SourceFreshness", "SpecGroup", "SpecInfo", "StorageConfig", "StorageHealth", "StorageSpecs", "Unpinned",
    "WriteFinished", "WriteSession", "decoder",
]
