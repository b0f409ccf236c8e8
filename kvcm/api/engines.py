"""Engine-tier RPCs: ``add_event_source``, ``remove_event_source``, ``list_event_sources``,
``match_engines``, ``note_routed``, ``get_host_cache_state``, ``report_events``.

``match_engines`` is what a KV-aware router asks: for this prompt (``token_ids``, hashed with the
instance's block size, or ready ``block_keys``), how many leading blocks does each engine source
hold, per medium, scored by tier and the caller's loads, best first, grouped by pod too
(docs/routers.md).

The requests are :mod:`kvcm.proto.requests.engines`'s; replies are plain maps.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping
from operator import attrgetter
from typing import TypeVar

import msgspec

from kvcm.api.costs import US_PER_KEY, US_PER_MATCH_OPTION
from kvcm.api.token_keys import TokenWork, hash_tokens, prompt_work
from kvcm.cache.manager import CacheManager
from kvcm.engines.index import KEYED
from kvcm.engines.push import Report, Reporter
from kvcm.engines.scoring import BLOCKS, SCORE, SOURCE, pod_summary
from kvcm.engines.service import EngineService
from kvcm.engines.sources import SourceSpec
from kvcm.errors import Code, InvalidArgument, error
from kvcm.proto.extra_keys import MAX_BLOCK_BYTES
from kvcm.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Event, count_events
from kvcm.proto.requests import engines as requests
from kvcm.proto.requests.engines import (
    AddEvent,
    AddEventSourceRequest,
    ClearEvent,
    GetHostCacheStateRequest,
    ListEventSourcesRequest,
    MatchEnginesRequest,
    NoteRoutedRequest,
    Payload,
    RemoveEvent,
    RemoveEventSourceRequest,
)
from kvcm.proto.schema import RequestBase
from kvcm.proto.wire import Raw
from kvcm.rpc.auth import Authenticator
from kvcm.rpc.dispatch import Estimate, Method

T = TypeVar("T")
A = TypeVar("A")

#: RequestBase's fields: the dispatcher's business, never part of a source's definition.
_COMMON = frozenset(RequestBase.__struct_fields__)


class _Handlers:
    def __init__(
        self, service: EngineService, auth: Authenticator | None = None, cache: Callable[[], CacheManager | None] | None = None
    ) -> None:
        self.service = service
        self.auth = auth
        self.cache = cache

    def add_event_source(self, req: AddEventSourceRequest) -> Mapping[str, object]:
        params = {f: getattr(req, f) for f in req.__struct_fields__ if f not in _COMMON}
        return self.service.add_source(params)

    def remove_event_source(self, req: RemoveEventSourceRequest) -> Mapping[str, object]:
        return self.service.remove_source(req.source_id)

    def list_event_sources(self, req: ListEventSourcesRequest) -> Mapping[str, object]:
        # A non-admin sees the sources (endpoints included) of its own groups' instances only.
        visible = None if self.auth is None else self.auth.visible(req)
        return self.service.list_sources(req.instance_id, visible)

    def match_tokens(self, req: MatchEnginesRequest | NoteRoutedRequest | GetHostCacheStateRequest) -> TokenWork | None:
        """Keys of a token query, derived by the dispatcher a slice at a time before the match."""
        given = bool(req.block_keys) or bool(getattr(req, "block_cache_keys", None))
        return prompt_work(req, given, lambda: self.service.instance_lookup(req.instance_id))

    def match_cost(self, req: MatchEnginesRequest) -> Estimate:
        # with include_storage, the storage tier's prefix too (its locations, counted by type)
        per_key = US_PER_KEY["match_engines"] + (US_PER_KEY["storage_prefix"] if req.include_storage else 0.0)
        per_key += self._hybrid_us(req.instance_id, req.lora_name, req.group_idx)
        n = len(req.block_keys)
        return Estimate(n * per_key + _options_us(req.media, req.loads), 0, per_key, n)

    def host_cost(self, req: GetHostCacheStateRequest) -> Estimate:
        # with include_storage (Tair's default), the storage tier's prefix length too
        per_key = US_PER_KEY["match_engines"] + (US_PER_KEY["prefix_match_len"] if req.include_storage else 0.0)
        per_key += self._hybrid_us(req.instance_id, req.lora_name, None)
        n = len(req.block_keys or req.block_cache_keys)
        return Estimate(n * per_key + _options_us(req.medium, req.loads), 0, per_key, n)

    def _hybrid_us(self, instance_id: str, lora_name: str | None, group_idx: int | None) -> float:
        """Per key, what a default query's hybrid answer adds (none when it names one group)."""
        if group_idx is not None:
            return 0.0
        slots = self.service.index.hybrid_slots(instance_id, lora_name)
        return US_PER_KEY["hybrid"] + slots * US_PER_KEY["hybrid_slot"] if slots else 0.0

    def note_cost(self, req: NoteRoutedRequest) -> Estimate:
        n = len(req.block_keys)
        return Estimate(n * US_PER_KEY["note_routed"], 0, US_PER_KEY["note_routed"], n)

    def match_engines(self, req: MatchEnginesRequest) -> Raw:
        media = req.media if req.media is not None else ([req.medium] if req.medium else None)
        storage = self._storage_prefix(req.instance_id, req.token_ids, req.block_keys) if req.include_storage else None
        return Raw(self.service.match_packed(
            req.instance_id, req.token_ids, req.block_keys,
            lora_name=req.lora_name, media=media, group_idx=req.group_idx, limit=_top_k(req.limit, req.top_k),
            include_stale=req.include_stale, loads=_check_loads(req.loads, self.service.settings.max_sources),
            storage=storage,
        ))  # fmt: skip

    def _storage_prefix(self, instance_id: str, token_ids: list[int], block_keys: list[int]) -> dict[str, int]:
        """Storage type -> blocks of the storage tier's prefix of the query: what
        ``get_cache_location`` with ``prefix_match`` answers for the instance."""
        cache = self.cache() if self.cache is not None else None
        if cache is None:
            raise InvalidArgument("include_storage: this server has no storage tier to ask")
        keys = self.service.keys_for(instance_id, token_ids, block_keys)
        if not keys:
            return {}
        reply = cache.get_cache_location(instance_id, "prefix_match", keys, None, None)
        counts: dict[str, int] = {}
        for loc in _LOCATIONS.decode(reply.data).locations:
            counts[loc.type] = counts.get(loc.type, 0) + 1
        return counts

    def _storage_length(self, instance_id: str, keys: list[int]) -> int:
        """Blocks of the storage tier's prefix of ``keys`` (its length alone: no location built)."""
        cache = self.cache() if self.cache is not None else None
        if cache is None:
            raise InvalidArgument("include_storage: this server has no storage tier to ask")
        return cache.get_cache_location_len(instance_id, "prefix_match", keys, None, None) if keys else 0

    def note_routed(self, req: NoteRoutedRequest) -> Mapping[str, object]:
        return self.service.note_routed(req.instance_id, req.source_id, req.token_ids, req.block_keys, req.ttl_s,
                                        req.lora_name)  # fmt: skip

    def get_host_cache_state(self, req: GetHostCacheStateRequest) -> dict[str, object]:
        """Tair's per-host answer from the same ranking: ``local`` is the pod's own prefix,
        ``p2p_1_total_match`` the longest prefix held anywhere (any engine, or kvcm's storage
        tier) and ``p2p_1_fetch`` the blocks the pod would fetch to reach it."""
        if req.query_type not in ("prefix_match", "QT_PREFIX_MATCH", 2):
            raise InvalidArgument(f"query_type: only prefix matching is answered, got {str(req.query_type)[:40]!r}")
        if req.block_cache_keys and req.block_keys:
            raise InvalidArgument("block_cache_keys and block_keys: give one of them")
        if not 0 <= req.p2p_host_count <= _MAX_TOP_K:
            raise InvalidArgument(f"p2p_host_count must be in 0..{_MAX_TOP_K}")
        service = self.service
        block_size = service.instance_lookup(req.instance_id)
        keys = service.keys_for(req.instance_id, req.token_ids, req.block_cache_keys or req.block_keys)
        stored = self._storage_length(req.instance_id, keys) if req.include_storage else 0
        ranked = service.ranked(req.instance_id, keys, block_size, lora_name=req.lora_name, media=req.medium or None,
                                include_stale=req.include_stale,
                                loads=_check_loads(req.loads, service.settings.max_sources))  # fmt: skip
        pods = pod_summary(ranked)
        shared = max([stored] + [best[BLOCKS] for _, best, _ in pods])
        hosts = [_host(pod, best[BLOCKS], shared, best[SCORE], best[SOURCE], ranks) for pod, best, ranks in pods]
        listed = {h["host_ip_port"] for h in hosts}
        for pod, ranks in service.pods_of(req.instance_id, req.include_stale).items():
            if pod not in listed:  # Tair lists every host of the instance, holding nothing or not
                hosts.append(_host(pod, 0, shared, -(req.loads or {}).get(ranks[0], 0.0), ranks[0], ranks))
        limit = _top_k(0, req.top_k)
        return {"instance_id": req.instance_id, "num_blocks": len(keys), "global": shared,
                "storage": stored, "hosts": hosts[:limit] if limit else hosts}  # fmt: skip


def _host(pod: str, local: int, shared: int, score: float, best: str, ranks: list[str]) -> dict[str, object]:
    return {"host_ip_port": pod, "local": local, "p2p_1_fetch": max(0, shared - local),
            "p2p_1_total_match": max(shared, local), "score": score, "best_source": best, "sources": ranks}  # fmt: skip


class _Location(msgspec.Struct):
    type: str


class _Locations(msgspec.Struct):
    locations: list[_Location]


_LOCATIONS = msgspec.msgpack.Decoder(_Locations)


def _top_k(limit: int, top_k: int) -> int:
    if not limit and not top_k:  # the usual request: every source, nothing to check
        return 0
    for name, value in (("limit", limit), ("top_k", top_k)):
        if not 0 <= value <= _MAX_TOP_K:
            raise InvalidArgument(f"{name} must be in 0..{_MAX_TOP_K}, got {value}")
    if limit and top_k and limit != top_k:
        raise InvalidArgument(f"top_k ({top_k}) and limit ({limit}) disagree: give one of them")
    return top_k or limit


def _check_loads(loads: dict[str, float] | None, most: int) -> dict[str, float] | None:
    """Loads are per source: at most one per followed source (each id and value is bounded by
    the request schema, :data:`Loads`)."""
    if not loads:
        return None
    if len(loads) > most:
        raise InvalidArgument(f"loads: {len(loads)} entries, more than the {most} sources followed at most "
                              f"(events.max_sources)")  # fmt: skip
    return loads


_MAX_TOP_K = 1 << 16


def _options_us(media: list[str] | None, loads: dict[str, float] | None) -> float:
    """The work of a match's filter and loads, both bounded by the schema."""
    return (len(media or ()) + len(loads or ())) * US_PER_MATCH_OPTION


# --- report_events (push sources: kvcm/engines/push.py) ------------------------------------------

_UNSET = msgspec.UNSET
_ENCODE = msgspec.msgpack.Encoder().encode
#: Bounds of one report's decoded work: what one turn's budget can apply (docs/engines.md#push-ingestion).
MAX_REPORT_BLOCKS = 65536
MAX_REPORT_TOKENS = 1 << 20


class ReportEventsRequest(requests.ReportEventsRequest, dict=True):
    """:class:`kvcm.proto.requests.engines.ReportEventsRequest` as the server decodes it: with room
    for what the hooks work out once per request (its :class:`~kvcm.engines.push.Report`, and
    what it was charged when first costed: a carried report is costed again and paid once)."""


#: The fields each op takes besides source_id, op and generation (any other one given is refused).
_OP_FIELDS = {
    "register": frozenset({"instance_id", "dp_rank", "pod", "medium", "report_mode"}),
    "heartbeat": frozenset(),
    "payloads": frozenset({"payloads"}),
    "events": frozenset({"seq", "ts", "events"}),
    "snapshot": frozenset({"seq", "ts", "events"}),
    "down": frozenset(),
}
_OP_DEFAULTS: dict[str, object] = {"instance_id": _UNSET, "dp_rank": _UNSET, "pod": _UNSET, "medium": _UNSET,
                                "report_mode": _UNSET, "seq": _UNSET, "ts": _UNSET, "events": [], "payloads": []}  # fmt: skip


def _not_taken(taken: frozenset[str]) -> tuple[Callable[[ReportEventsRequest], tuple[object, ...]], tuple[object, ...],
                                              tuple[str, ...]]:
    """A getter of the fields an op does not take, their defaults, and their names. Every op
    leaves out at least two fields, so the getter returns a tuple."""
    names = tuple(n for n in _OP_DEFAULTS if n not in taken)
    return attrgetter(*names), tuple(_OP_DEFAULTS[n] for n in names), names


#: Per op, for :func:`report`: a report's unused fields are checked in one C-level call.
_NOT_TAKEN = {op: _not_taken(taken) for op, taken in _OP_FIELDS.items()}

# RPC-thread work of a report, in microseconds (measured by scripts/bench_events, with margin).
_US_PER_BLOCK = 3.0
_US_PER_TOKEN = 0.15
_US_PER_PAYLOAD_BYTE = 0.12
_US_PER_REPORT = 30.0
#: Per event, broken ones included: a batch of many tiny or unknown events costs per event.
_US_PER_EVENT = 2.0
#: Payloads estimated above this are refused on their size alone, without decoding them.
_DECODE_CEILING_US = 100_000.0


def report(req: ReportEventsRequest) -> Report:
    """The request as a :class:`~kvcm.engines.push.Report`; INVALID_ARGUMENT naming a field
    the op does not take."""
    get, defaults, names = _NOT_TAKEN[req.op]
    if get(req) != defaults:
        name = next(n for n, v, d in zip(names, get(req), defaults) if v != d)
        raise InvalidArgument(f"report_events: op {req.op} does not take the field {name}")
    keyed = bool(req.events) and all(getattr(e, "keyed", False) for e in req.events)
    if req.op == "events" and req.seq is _UNSET and not keyed:
        raise InvalidArgument("report_events: op events needs seq (the batch's sequence number), "
                              "unless every event is keyed")
    for i, e in enumerate(req.events):
        if type(e) is AddEvent and e.keyed and (e.token_ids or e.parent_block_hash is not None or e.extra_keys):
            raise InvalidArgument(f"report_events: events[{i}] is keyed: its hashes are kvcm keys, with no "
                                  f"token_ids, parent_block_hash or extra_keys")
    if req.op == "payloads" and not req.payloads:
        raise InvalidArgument("report_events: op payloads needs payloads")
    if req.op == "snapshot" and any(type(e) is not AddEvent for e in req.events):
        raise InvalidArgument("report_events: a snapshot holds add events only (it replaces the source's blocks)")
    return Report(
        source_id=req.source_id, op=req.op, generation=req.generation, instance_id=_given(req.instance_id, None),
        dp_rank=_given(req.dp_rank, 0), pod=_given(req.pod, ""), medium=_given(req.medium, ""),
        report_mode=_given(req.report_mode, "incremental"),
        seq=_given(req.seq, None), ts=_given(req.ts, None),
        events=[_event(e) for e in req.events], payloads=[(p.seq, _payload(i, p)) for i, p in enumerate(req.payloads)],
    )  # fmt: skip


def _given(value: T | msgspec.UnsetType, absent: A) -> T | A:
    """A request field's value, or what its absence means."""
    return absent if isinstance(value, msgspec.UnsetType) else value


def _work(r: Report) -> tuple[int, int, int]:
    """Events (broken ones included), blocks and tokens of the report's (decoded) batches."""
    blocks = tokens = events = 0
    for _, batch in r.batches or ():
        if batch is None:
            continue
        events += len(batch.events) + len(batch.errors)
        for e in batch.events:
            if type(e) is BlockStored:
                blocks, tokens = blocks + len(e.block_hashes), tokens + len(e.token_ids)
            elif type(e) is BlockRemoved:
                blocks += len(e.block_hashes)
    return events, blocks, tokens


def _extra_bytes(req: ReportEventsRequest) -> int:
    """Encoded bytes of the typed events' extra keys (one C-level encode each). Extra keys that
    cannot be encoded are refused per event when applied; until then they cost their bound."""
    total = 0
    for e in req.events:
        if type(e) is AddEvent and e.extra_keys:
            try:
                total += len(_ENCODE(e.extra_keys))
            except (TypeError, ValueError, OverflowError):
                total += len(e.extra_keys) * MAX_BLOCK_BYTES
    return total


def _typed_blocks(req: ReportEventsRequest) -> int:
    """Blocks the report's typed events name: their work is known before anything is decoded."""
    return sum(len(e.block_hashes) for e in req.events if isinstance(e, AddEvent | RemoveEvent))


def _event(e: AddEvent | RemoveEvent | ClearEvent) -> Event:
    if type(e) is AddEvent and e.keyed:
        return BlockStored(list(e.block_hashes), None, [], 0, None, e.medium, e.lora_name, KEYED, e.group_idx)
    if type(e) is AddEvent:
        return BlockStored(list(e.block_hashes), e.parent_block_hash, e.token_ids, e.block_size, None, e.medium,
                           e.lora_name, e.extra_keys, e.group_idx, e.kv_cache_spec_kind,
                           e.kv_cache_spec_sliding_window)  # fmt: skip
    if type(e) is RemoveEvent:
        return BlockRemoved(list(e.block_hashes), e.medium, e.group_idx)
    return AllBlocksCleared()


def _payload(i: int, p: Payload) -> bytes:
    if (p.payload is _UNSET) == (p.payload_b64 is _UNSET):
        raise InvalidArgument(f"report_events: payloads[{i}] needs exactly one of payload and payload_b64")
    if not isinstance(p.payload, msgspec.UnsetType):
        return p.payload
    try:
        return base64.b64decode(_given(p.payload_b64, ""), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"report_events: payloads[{i}].payload_b64 is not base64") from None


#: The ``report_events`` operations that carry batches, paid from the owner's work budget.
_PAID_OPS = frozenset({"payloads", "events", "snapshot"})


class _Reports:
    """``report_events``: the cost hook converts and decodes each report of a turn
    (``EngineService.push.prepare``), the admitted hook pools those that run for hashing
    (``EngineService.push.pool``), and the handler applies each."""

    def __init__(self, service: EngineService, auth: Authenticator | None) -> None:
        self.service = service
        self.auth = auth

    def prepared(self, req: ReportEventsRequest) -> Report:
        """The request's Report, made once (kept on the request: a carried one is costed again)."""
        made: Report | None = req.__dict__.get("report")
        if made is None:
            made = req.__dict__["report"] = report(req)
        return made

    def cost(self, req: ReportEventsRequest) -> Estimate:
        made = self.prepared(req)
        # Typed events' extra keys cost what the same bytes in a payload do (checked and digested per block).
        size = sum(len(p) for _, p in made.payloads) + _extra_bytes(req)
        # What the payloads claim, from their headers: a payload of many tiny events is refused
        # on that before any of them is decoded.
        claimed = _US_PER_REPORT + size * _US_PER_PAYLOAD_BYTE + _typed_blocks(req) * _US_PER_BLOCK + \
            (len(req.events) + sum(map(count_events, (p for _, p in made.payloads)))) * _US_PER_EVENT
        if claimed > _DECODE_CEILING_US:
            return Estimate(claimed)
        # A carried report is costed again and paid once; a register, heartbeat or down carries
        # no batches and is never refused for budget (a source kept quiet would turn stale).
        charged = req.__dict__.get("charged") if req.op in _PAID_OPS else 0.0
        if charged is None:
            self.service.push_budget.check(self._owner(req), claimed, "report_events")  # before decoding
        self.service.push.prepare(made)
        events, blocks, tokens = _work(made)
        if blocks > MAX_REPORT_BLOCKS or tokens > MAX_REPORT_TOKENS:
            raise error(Code.TOO_MANY_KEYS, f"report_events: {blocks} blocks and {tokens} tokens; a report takes "
                                            f"at most {MAX_REPORT_BLOCKS} blocks and {MAX_REPORT_TOKENS} tokens")
        us = (_US_PER_REPORT + events * _US_PER_EVENT + blocks * _US_PER_BLOCK + tokens * _US_PER_TOKEN
              + size * _US_PER_PAYLOAD_BYTE)
        if charged is None:
            self.service.push_budget.charge(self._owner(req), us, "report_events")
            req.__dict__["charged"] = us
        return Estimate(us)

    def _owner(self, req: ReportEventsRequest) -> str:
        """Who pays for a report: its caller's account with auth on, else its source."""
        principal = None if self.auth is None else self.auth.principal(req)
        return f"account {principal.user_name}" if principal is not None else f"source {req.source_id}"

    def admitted(self, reqs: list[ReportEventsRequest]) -> None:
        """The turn's reports that run: their batches are hashed together (``PushIngest.pool``)."""
        self.service.push.pool([self.prepared(req) for req in reqs])

    def settle(self) -> None:
        """The end of a turn that ran reports: their batches are persisted together, in one
        engine-store transaction, before any of the turn's replies (``Method.settle``)."""
        self.service.index.flush()

    def report_events(self, req: ReportEventsRequest) -> Mapping[str, object]:
        made = self.prepared(req)
        principal = None if self.auth is None else self.auth.principal(req)
        if self.auth is None or principal is None:
            return self.service.report_events(made)
        auth = self.auth

        def authorize(spec: SourceSpec) -> None:
            auth.check_reporter(req, spec.owner, spec.instance_id, spec.source_id)

        return self.service.report_events(made, Reporter(principal.user_name, principal.admin, authorize))


def methods(
    service: EngineService, auth: Authenticator | None = None, cache: Callable[[], CacheManager | None] | None = None
) -> list[Method]:
    """The engine-tier method table for the dispatcher; ``auth`` filters ``list_event_sources``;
    ``cache`` returns the data plane (built after the engine tier) for ``include_storage``."""
    h, reports = _Handlers(service, auth, cache), _Reports(service, auth)
    return [
        Method("add_event_source", h.add_event_source, AddEventSourceRequest, writes=True, admin=True),
        Method("remove_event_source", h.remove_event_source, RemoveEventSourceRequest, writes=True, idempotent=False, admin=True),
        Method("list_event_sources", h.list_event_sources, ListEventSourcesRequest),
        Method("match_engines", h.match_engines, MatchEnginesRequest, cost=h.match_cost, prepare=hash_tokens(h.match_tokens)),
        Method("note_routed", h.note_routed, NoteRoutedRequest, idempotent=False, cost=h.note_cost,
               prepare=hash_tokens(h.match_tokens)),
        Method("get_host_cache_state", h.get_host_cache_state, GetHostCacheStateRequest, cost=h.host_cost,
               prepare=hash_tokens(h.match_tokens)),
        Method("report_events", reports.report_events, ReportEventsRequest, idempotent=False, cost=reports.cost,
               settle=reports.settle, admitted=reports.admitted),
    ]
