"""Engine-tier requests: ``add_event_source``, ``remove_event_source``, ``list_event_sources``,
``match_engines``, ``note_routed``, ``get_host_cache_state`` and ``report_events`` (a push
source's report, docs/engines.md#push-ingestion).

Every request may carry ``trace_id`` and ``auth`` and refuses unknown fields (INVALID_ARGUMENT
naming the field).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvcm.proto.extra_keys import ExtraKeys
from kvcm.proto.requests.prompt import PromptRequest
from kvcm.proto.schema import KEYS_CEILING, Keys, RequestBase, Tokens

__all__ = [
    "MAX_LABEL", "MAX_LOAD", "MAX_MEDIA", "MAX_REPORT_EVENTS", "MAX_REPORT_PAYLOADS", "AddEvent",
    "AddEventSourceRequest", "ClearEvent", "GetHostCacheStateRequest", "Hash", "Hashes", "ListEventSourcesRequest",
    "Loads", "LoraName", "MatchEnginesRequest", "Media", "Medium", "Name", "NoteRoutedRequest", "Payload",
    "RemoveEvent", "RemoveEventSourceRequest", "ReportEventsRequest", "ReportMode", "ReportOp", "Seq", "Ts",
]

#: Characters of a medium or adapter name at most (the engine index keys slots and tables by
#: them, and holds none longer).
MAX_LABEL = 256
#: The bound of one load a router gives (beyond it a value is a mistake, not a setting).
MAX_LOAD = 1e12
#: ``loads``: source id -> load, each checked while decoding (a router sends a hundred per call),
#: at most one per source events.max_sources allows at its most. NaN fails the bounds too.
Loads = Annotated[
    dict[Annotated[str, msgspec.Meta(max_length=200)], Annotated[float, msgspec.Meta(ge=0.0, le=MAX_LOAD)]],
    msgspec.Meta(max_length=16000),
]
#: A medium name as queries give it.
Medium = Annotated[str, msgspec.Meta(max_length=MAX_LABEL)]
#: ``media`` filters: a handful of names, bounded so that no filter costs more than its keys.
MAX_MEDIA = 64
Media = Annotated[list[Medium], msgspec.Meta(max_length=MAX_MEDIA)]
#: An adapter name as queries give it.
LoraName = Annotated[str, msgspec.Meta(max_length=MAX_LABEL)]
#: vLLM's ``kv_cache_report_mode``: ``full`` also re-reports reused prefixes (docs/engines.md).
ReportMode = Literal["incremental", "full"]


# msgspec.Struct named again only so that linters see a Struct (its defaults are copied, not shared).
class _Request(RequestBase, msgspec.Struct, kw_only=True):
    pass


class AddEventSourceRequest(_Request):
    source_id: str
    instance_id: str
    endpoint: str | None = None  # PUB endpoint as given (tcp://, ipc://, inproc://)
    replay_endpoint: str | None = None  # replay ROUTER; absent = no replay (endpoint form)
    host: str | None = None  # instead of endpoint: tcp://host:port+dp_rank (IPv4, IPv6, DNS)
    port: int | None = None  # default events.pub_port (5557)
    replay_port: int | None = None  # default events.replay_port (5558)
    replay: bool = True  # host form only: false = no replay ROUTER
    topic: str = ""
    dp_rank: int = 0
    pod: str | None = None  # the pod this DP rank belongs to (match_engines groups by it); absent = source_id
    report_mode: ReportMode | None = None  # vLLM's kv_cache_report_mode of the engine's requests; absent = incremental
    replay_timeout_s: float | None = None
    backoff_initial_s: float | None = None
    backoff_max_s: float | None = None
    poll_ms: int | None = None


class RemoveEventSourceRequest(_Request):
    source_id: str


class ListEventSourcesRequest(_Request):
    instance_id: str | None = None


class MatchEnginesRequest(PromptRequest, msgspec.Struct, kw_only=True):
    instance_id: str
    media: Media | None = None  # e.g. ["GPU"]; absent = every medium
    medium: Medium | None = None  # shorthand for media=[medium]
    group_idx: int | None = None  # absent = full-attention-like groups
    limit: int = 0  # 0 = every source with a match
    include_stale: bool = False  # also match sources not heard for events.stale_after_s
    top_k: int = 0  # the same as limit (the name routers use); give one of them
    loads: Loads | None = None  # source_id -> load, subtracted from its score (docs/routers.md)
    include_storage: bool = False  # add the storage tier's prefix as the pseudo-source "storage"


class NoteRoutedRequest(PromptRequest, msgspec.Struct, kw_only=True):
    instance_id: str
    source_id: str
    ttl_s: float = 2.0  # at most events.speculative_max_ttl_s


class GetHostCacheStateRequest(PromptRequest, msgspec.Struct, kw_only=True):
    """Tair KVCM's GetHostCacheState, answered from match_engines (docs/routers.md)."""

    instance_id: str
    block_cache_keys: Keys = []  # Tair's name of block_keys
    query_type: str | int = "prefix_match"  # prefix matching only: "prefix_match", "QT_PREFIX_MATCH" or 2
    medium: Media | None = None  # Tair's media filter; absent or empty = every medium
    p2p_host_count: int = 0  # Tair's P2P peer count: accepted, kvcm does not plan P2P fetches
    top_k: int = 0  # 0 = every host
    loads: Loads | None = None
    include_stale: bool = False
    include_storage: bool = True


# -- report_events ----------------------------------------------------------------------------------

#: An engine block hash: an int (unsigned 64-bit, or SGLang's signed int64) or up to 64 bytes.
#: (msgpack itself bounds ints to that range; msgspec cannot express a bound past int64.)
Hash = int | Annotated[bytes, msgspec.Meta(max_length=64)]
Hashes = Annotated[list[Hash], msgspec.Meta(max_length=KEYS_CEILING)]
Name = Annotated[str, msgspec.Meta(max_length=200)]
Seq = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
#: A batch's time (seconds): finite, and never a date no clock gives (NaN fails the bounds too).
Ts = Annotated[float, msgspec.Meta(ge=0.0, le=1e12)]
#: What a report does: a source's ``register``, ``heartbeat`` or ``down``, or batches.
ReportOp = Literal["register", "heartbeat", "payloads", "events", "snapshot", "down"]
#: Bounds of one report: what one turn's budget can apply (docs/engines.md#push-ingestion).
MAX_REPORT_EVENTS = 4096
MAX_REPORT_PAYLOADS = 1024
_UNSET = msgspec.UNSET


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class AddEvent(_Strict, tag="add", tag_field="type"):
    """``BlockStored``: consecutive full blocks, each the parent of the next."""

    block_hashes: Hashes
    parent_block_hash: Hash | None = None
    token_ids: Tokens = []
    block_size: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    medium: Annotated[str, msgspec.Meta(max_length=32)] | None = None  # absent = the source's medium
    lora_name: Name | None = None
    group_idx: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] | None = None
    kv_cache_spec_kind: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    #: a sliding-window group's window in tokens (vLLM's ``kv_cache_spec_sliding_window``)
    kv_cache_spec_sliding_window: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)] | None = None
    #: per block, its extra keys as vLLM's BlockStored carries them (kvcm.proto.extra_keys)
    extra_keys: ExtraKeys | None = None
    #: block_hashes are kvcm block keys, held as they are (no token_ids, no parent); a batch of
    #: keyed events only may come without seq (unsequenced: applied in arrival order)
    keyed: bool = False


class RemoveEvent(_Strict, tag="remove", tag_field="type"):
    """``BlockRemoved``: one holding of each block, on one medium."""

    block_hashes: Hashes
    medium: Annotated[str, msgspec.Meta(max_length=32)] | None = None
    group_idx: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] | None = None
    keyed: bool = False  # of keyed adds' blocks (removed alike: by hash, which is the key)


class ClearEvent(_Strict, tag="clear", tag_field="type"):
    """``AllBlocksCleared``."""


class Payload(_Strict):
    """One vLLM ``KVEventBatch`` as the engine encoded it: ``payload`` (msgpack bin) or
    ``payload_b64`` (base64 text, for JSON over HTTP)."""

    seq: Seq
    # UNSET, not None: an explicit null is refused like any value of the wrong type
    payload: bytes | msgspec.UnsetType = _UNSET
    payload_b64: str | msgspec.UnsetType = _UNSET


class ReportEventsRequest(_Request):
    """The optional fields are UNSET when absent: an explicit null is a wrong type (refused,
    naming the field), never read as 0, "" or "now"."""

    source_id: Name
    op: ReportOp
    generation: Seq = 0
    # register
    instance_id: str | msgspec.UnsetType = _UNSET
    dp_rank: Annotated[int, msgspec.Meta(ge=0, lt=4096)] | msgspec.UnsetType = _UNSET
    pod: Name | msgspec.UnsetType = _UNSET
    medium: Annotated[str, msgspec.Meta(max_length=32)] | msgspec.UnsetType = _UNSET
    report_mode: ReportMode | msgspec.UnsetType = _UNSET
    # events, snapshot
    seq: Seq | msgspec.UnsetType = _UNSET
    ts: Ts | msgspec.UnsetType = _UNSET
    events: Annotated[list[AddEvent | RemoveEvent | ClearEvent], msgspec.Meta(max_length=MAX_REPORT_EVENTS)] = []
    # payloads
    payloads: Annotated[list[Payload], msgspec.Meta(max_length=MAX_REPORT_PAYLOADS)] = []
